"""Packed shards on object storage: `data.name=shards data.root=s3://bucket/prefix` (any fsspec URL,
multicard/base/storage.py), a folder `multicard pack` wrote, uploaded as it is.

The index is read whole, the shards' sizes checked against it with one listing. A split of at most
WHOLE_SPLIT_BYTES is read in whole shards, each once per loader process and kept in its memory; a larger
one sample by sample, by ranged requests. Either way a loader process keeps `data.reads_in_flight`
requests in flight, neighbours in one request (ShardSamples.prefetch). The samples, their order and
every guarantee are those of the same pack on local disk: training ends with the same parameters.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

from multicard.base.errors import UserError
from multicard.base.storage import Remote
from multicard.data.sources.folders import Splits
from multicard.data.sources.shards import (
    INDEX,
    PackedSplit,
    ShardSamples,
    check_shards,
    check_splits,
    packed_splits,
    parse_index,
)

# Each request costs the reading process ~4 ms of CPU (signing, HTTP; measured with s3fs, docs/benchmarks.md):
# a globally shuffled batch holds no neighbours, so ranged reads take one request per sample, and a
# loader process then reads ~250 samples/s. A split up to this size is read in whole shards instead
# (CIFAR-10's 45,000 training images: 116 MB), each once per loader process and kept in its memory.
WHOLE_SPLIT_BYTES = 256 << 20
PIECE_BYTES = 8 << 20  # a whole shard is read in requests of at most this size, reads_in_flight at once


class RemoteShardSamples(ShardSamples):
    """ShardSamples whose shards are objects, read through this process's own session: whole shards,
    kept, for a split of at most WHOLE_SPLIT_BYTES; else each read a ranged request."""

    def __init__(self, split: PackedSplit, remote: Remote, reads_in_flight: int = 1) -> None:
        super().__init__(split, reads_in_flight)
        self.remote = remote
        self.names = [str(url).rsplit("/", 1)[-1] for url in split.shards]
        self.whole = sum(split.shard_bytes) <= WHOLE_SPLIT_BYTES

    def _own(self) -> None:
        if self._pid != os.getpid():
            super()._own()
            self._kept: dict[int, bytes] = {}  # shard → its bytes, read whole (a forked process reads its own)

    def _open(self, shards: set[int]) -> None:
        self.remote.fs()  # the session, opened before the pool's threads share it
        missing = sorted(shards - self._kept.keys()) if self.whole else []
        pieces = [(shard, start, min(start + PIECE_BYTES, self.split.shard_bytes[shard]))
                  for shard in missing for start in range(0, self.split.shard_bytes[shard], PIECE_BYTES)]  # fmt: skip
        if not pieces:
            return
        with ThreadPoolExecutor(max(1, self.reads_in_flight), thread_name_prefix="multicard-shard-read") as pool:
            data = list(pool.map(lambda piece: self.remote.read(self.names[piece[0]], *piece[1:]), pieces))
        for shard in missing:
            self._kept[shard] = b"".join(part for (s, *_), part in zip(pieces, data, strict=True) if s == shard)

    def _pread(self, shard: int, length: int, start: int) -> bytes:
        if not self.whole:
            return self.remote.read(self.names[shard], start, start + length)
        if shard not in self._kept:  # a read outside prefetch (one sample at a time)
            self._open({shard})
        return self._kept[shard][start : start + length]


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
