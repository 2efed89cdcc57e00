"""Packed shards on object storage: `data.name=shards data.root=s3://bucket/prefix` (any fsspec URL,
multicard/base/storage.py), a folder `multicard pack` wrote, uploaded as it is.

The index is read whole, the shards' sizes checked against it with one listing, and each sample
read by a ranged request; a loader process keeps `data.reads_in_flight` requests of its batch in
flight, neighbours in one request (ShardSamples.prefetch). The samples, their order and every
guarantee are those of the same pack on local disk: training ends with the same parameters.
"""

from __future__ import annotations

import json

from multicard.base.errors import UserError
from multicard.base.storage import Remote
from multicard.data.sources.folders import Splits
from multicard.data.sources.shard_format import INDEX, PackedSplit, check_shards, check_splits, parse_index
from multicard.data.sources.shards import ShardSamples, packed_splits


class RemoteShardSamples(ShardSamples):
    """ShardSamples whose shards are objects: ranged reads through this process's own session."""

    def __init__(self, split: PackedSplit, remote: Remote, reads_in_flight: int = 1) -> None:
        super().__init__(split, reads_in_flight)
        self.remote = remote
        self.names = [str(url).rsplit("/", 1)[-1] for url in split.shards]

    def _open(self, shards: set[int]) -> None:
        self.remote.fs()  # the session, opened before the pool's threads share it

    def _pread(self, shard: int, length: int, start: int) -> bytes:
        return self.remote.read(self.names[shard], start, start + length)


def remote_shard_splits(url: str, reads_in_flight: int, retries: int) -> Splits:
    """The training and validation splits of a pack at `url` (its index read, its shards' sizes checked)."""
    remote = Remote(url, retries)
    what = f"data.root={remote.url}"
    sizes = {remote.join(name): size for name, size in remote.sizes().items()}  # no bucket or prefix: one line
    if remote.join(INDEX) not in sizes:
        raise UserError(
            f"{what} has no {INDEX}: upload a folder multicard pack wrote (its {INDEX} and shards) there, "
            f"or correct the URL"
        )
    try:
        raw = json.loads(remote.read(INDEX))
    except ValueError as exc:
        raise UserError(
            f"index {remote.join(INDEX)} cannot be read ({type(exc).__name__}); upload the folder multicard pack "
            f"wrote again"
        ) from None
    index = parse_index(raw, remote.join(INDEX), remote.join)
    check_splits(index)
    for name in ("train", "val"):
        check_shards(index.splits[name], sizes.get)
    return packed_splits(index, lambda split: RemoteShardSamples(split, remote, reads_in_flight), what)
