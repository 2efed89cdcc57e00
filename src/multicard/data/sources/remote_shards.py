"""Packed shards on object storage: `data.name=shards data.root=s3://bucket/prefix` (any fsspec URL,
multicard/base/storage.py), what `multicard pack --out URL` wrote there (`upload_pack`), or a folder
`multicard pack` wrote, uploaded as it is. The index is uploaded last: a prefix without it holds no
pack, and one whose shards it lists are not all there whole is refused (their sizes are checked).

The index is read whole, the shards' sizes checked against it with one listing. A split of at most
WHOLE_SPLIT_BYTES is read in whole shards, each once per loader process and kept in its memory; a larger
one sample by sample, by ranged requests. Either way a loader process keeps `data.reads_in_flight`
requests in flight, neighbours in one request (ShardSamples.prefetch). The samples, their order and
every guarantee are those of the same pack on local disk: training ends with the same parameters.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from multicard.base.errors import UserError
from multicard.base.storage import Remote, etag
from multicard.data.sources.folders import Splits
from multicard.data.sources.shard_cache import ShardCache, shard_key
from multicard.data.sources.shard_format import (
    INDEX,
    MD5,
    SHARD_NAME,
    Index,
    PackedSplit,
    check_shards,
    check_splits,
    file_digest,
    parse_index,
)
from multicard.data.sources.shards import ShardSamples, packed_splits

# Each request costs the reading process ~4 ms of CPU (signing, HTTP; measured with s3fs, docs/benchmarks.md):
# a globally shuffled batch holds no neighbours, so ranged reads take one request per sample, and a
# loader process then reads ~250 samples/s. A split up to this size is read in whole shards instead
# (CIFAR-10's 45,000 training images: 116 MB), each once per loader process and kept in its memory.
WHOLE_SPLIT_BYTES = 256 << 20
PIECE_BYTES = 8 << 20  # a whole shard is read in requests of at most this size, reads_in_flight at once


class RemoteShardSamples(ShardSamples):
    """ShardSamples whose shards are objects, read through this process's own session: whole shards,
    kept, for a split of at most WHOLE_SPLIT_BYTES; else each read a ranged request. With a local
    `cache` (shard_cache.py; `keys`: each shard's name there), whole shards come from it where it holds
    them and are stored in it once downloaded; a larger split the cache can hold whole is then read from
    the cached files (each shard downloaded whole on its first read), one it cannot by ranged requests."""

    def __init__(self, split: PackedSplit, remote: Remote, reads_in_flight: int = 1, cache: ShardCache | None = None,
                 keys: list[str] | None = None) -> None:  # fmt: skip
        super().__init__(split, reads_in_flight)
        self.remote = remote
        self.names = [str(url).rsplit("/", 1)[-1] for url in split.shards]
        self.whole = sum(split.shard_bytes) <= WHOLE_SPLIT_BYTES
        # a split larger than the cache would evict each shard before its next read: a shard per sample
        fits = cache is not None and sum(split.shard_bytes) <= cache.max_bytes
        self.cache = cache if self.whole or fits else None
        self.keys = keys or []

    def _own(self) -> None:
        if self._pid != os.getpid():
            super()._own()
            self._kept: dict[int, bytes] = {}  # shard → its bytes, read whole (a forked process reads its own)
            self._uncached: set[int] = set()  # shards the cache could not take: read by ranged requests

    def _open(self, shards: set[int]) -> None:
        self.remote.fs()  # the session, opened before the pool's threads share it
        if self.whole:
            missing = sorted(shards - self._kept.keys())
            self._kept.update(zip(missing, self._whole_shards(missing), strict=True))
        elif self.cache is not None:
            missing = [shard for shard in sorted(shards) if shard not in self._fds and shard not in self._uncached]
            for shard in [shard for shard in missing if not self._open_cached(shard)]:
                self._uncached.add(shard)  # until downloaded and stored: ranged requests if it cannot be
            for shard, data in self._download([shard for shard in missing if shard in self._uncached]).items():
                self.cache.put(self.keys[shard], data)
                if self._open_cached(shard):
                    self._uncached.discard(shard)

    def _open_cached(self, shard: int) -> bool:
        fd = self.cache.open(self.keys[shard], self.split.shard_bytes[shard])
        if fd is not None:
            self._fds[shard] = fd
        return fd is not None

    def _whole_shards(self, shards: list[int]) -> list[bytes]:
        """These shards' bytes: from the cache where it holds them, else downloaded (and stored in it)."""
        sizes = self.split.shard_bytes
        found = {shard: self.cache.read(self.keys[shard], sizes[shard]) for shard in shards} if self.cache else {}
        downloaded = self._download([shard for shard in shards if found.get(shard) is None])
        for shard, data in downloaded.items():
            if self.cache is not None:
                self.cache.put(self.keys[shard], data)
        return [downloaded[shard] if shard in downloaded else found[shard] for shard in shards]

    def _download(self, shards: list[int]) -> dict[int, bytes]:
        """These shards read whole from the URL, in requests of PIECE_BYTES, `reads_in_flight` at once."""
        sizes = self.split.shard_bytes
        pieces = [(shard, start, min(start + PIECE_BYTES, sizes[shard]))
                  for shard in shards for start in range(0, sizes[shard], PIECE_BYTES)]  # fmt: skip
        if not pieces:
            return {}
        with ThreadPoolExecutor(max(1, self.reads_in_flight), thread_name_prefix="multicard-shard-read") as pool:
            data = list(pool.map(lambda piece: self.remote.read(self.names[piece[0]], *piece[1:]), pieces))
        return {shard: b"".join(part for (s, *_), part in zip(pieces, data, strict=True) if s == shard)
                for shard in shards}  # fmt: skip

    def _pread(self, shard: int, length: int, start: int) -> bytes:
        if self.whole or self.cache is not None:
            if shard not in self._kept and shard not in self._fds and shard not in self._uncached:
                self._open({shard})  # a read outside prefetch (one sample at a time)
            if shard in self._kept:
                return self._kept[shard][start : start + length]
            if shard in self._fds:
                return os.pread(self._fds[shard], length, start)
        return self.remote.read(self.names[shard], start, start + length)


def remote_shard_splits(url: str, reads_in_flight: int, retries: int, cache: ShardCache | None = None) -> Splits:
    """The training and validation splits of a pack at `url` (its index read, its shards' sizes checked),
    read through a local `cache` of whole shards where one is given."""
    remote = Remote(url, retries)
    what = f"data.root={remote.url}"
    index, _, versions = read_remote_index(remote, what)

    def samples(split: PackedSplit) -> RemoteShardSamples:
        keys = [shard_key(str(url), size, versions.get(str(url), "")) for url, size in zip(split.shards,
                split.shard_bytes, strict=True)]  # fmt: skip
        return RemoteShardSamples(split, remote, reads_in_flight, cache, keys)

    return packed_splits(index, samples, what)


def read_remote_index(remote: Remote, what: str) -> tuple[Index, dict[str, Any], dict[str, str]]:
    """The index of the pack at the URL, checked (shard_format.parse_index), with both splits and every
    shard there with the size it gives (one listing), its JSON, and each object's ETag by URL; else one
    line. `what`: how the URL was given."""
    objects = remote.objects()  # no bucket or prefix: one line
    sizes = {remote.join(name): int(entry["size"]) for name, entry in objects.items()}
    if remote.join(INDEX) not in sizes:
        if any(SHARD_NAME.match(url.rsplit("/", 1)[-1]) for url in sizes):
            raise UserError(
                f"{what} holds an unfinished pack (shards, but no {INDEX} yet: it is uploaded last); run the "
                f"multicard pack --out {remote.url} that wrote it again to finish it"
            )
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
    return index, raw, {remote.join(name): etag(entry) for name, entry in objects.items()}


# ---------------------------------------------------------------- writing: `multicard pack --out URL`


def remote_objects(remote: Remote) -> dict[str, dict[str, Any]]:
    """name → listing entry (size, ETag…) of every object directly under the URL; a prefix that holds
    nothing yet is empty, a missing bucket one line (storage.storage_error)."""
    fs, root = remote.fs()

    def listing() -> list[dict[str, Any]]:
        try:
            return fs.ls(root, detail=True)
        except FileNotFoundError:
            bucket = root.split("/", 1)[0]
            if bucket != root and fs.exists(bucket):
                return []  # a new prefix of a bucket that is there
            raise

    return {entry["name"].rstrip("/").rsplit("/", 1)[-1]: entry for entry in remote.attempt(remote.url, listing)}


def check_pack_prefix(remote: Remote, objects: dict[str, dict[str, Any]]) -> None:
    """pack writes only where there is nothing, or a pack (whole or not): never over another's objects."""
    foreign = sorted(name for name in objects if name != INDEX and not SHARD_NAME.match(name))
    if foreign:
        raise UserError(
            f"--out {remote.url} holds objects that are no pack's ({', '.join(foreign[:3])}"
            f"{', …' if len(foreign) > 3 else ''}); choose a new or empty prefix"
        )


def uploaded_index(remote: Remote) -> dict[str, Any] | None:
    """The index of the pack at the URL, None where there is none (or none readable: a pack replaces it)."""
    if INDEX not in remote_objects(remote):
        return None
    try:
        index = json.loads(remote.read(INDEX))
    except ValueError:
        return None
    return index if isinstance(index, dict) else None


def upload_pack(folder: Path, remote: Remote, say: Callable[[str], None]) -> tuple[int, int]:
    """Upload the finished pack in `folder` to the URL: its shards, then its index last (the index is
    the commit: readers take nothing without it). Shards the URL holds already whole (their size,
    and their MD5 where the store gives one) are not uploaded again; an index of another pack there
    is removed first, and shards no longer named after. (shards uploaded, shards in the pack)."""
    objects = remote_objects(remote)
    check_pack_prefix(remote, objects)
    index_bytes = (folder / INDEX).read_bytes()
    entries = [shard for split in json.loads(index_bytes)["splits"].values() for shard in split["shards"]]
    if INDEX in objects:
        if remote.read(INDEX) == index_bytes:
            return 0, len(entries)
        say(f"multicard pack: replacing the pack in {remote.url}: it was made from another source or other options")
        _remove(remote, INDEX)  # first: from here on the prefix no longer holds a pack
    named = {shard["name"] for shard in entries}
    for stale in sorted(name for name in objects if SHARD_NAME.match(name) and name not in named):
        _remove(remote, stale)
    todo = [shard for shard in entries if not _uploaded(objects.get(shard["name"]), folder / shard["name"], shard)]
    for shard in todo:
        upload_object(remote, folder / shard["name"], shard["name"])
    upload_object(remote, folder / INDEX, INDEX)
    return len(todo), len(entries)


def _uploaded(listed: dict[str, Any] | None, local: Path, shard: dict[str, Any]) -> bool:
    """Whether the object listed is the shard: its size, and its MD5 where the ETag is one (a single-part upload)."""
    if listed is None or int(listed.get("size", -1)) != int(shard["bytes"]):
        return False
    version = etag(listed)
    return not MD5.match(version) or version == file_digest(local, "md5")


def upload_object(remote: Remote, local: Path, name: str) -> None:
    """One object uploaded whole (object stores make it visible only once complete), with retries."""
    fs, root = remote.fs()
    remote.attempt(remote.join(name), lambda: fs.put_file(str(local), f"{root}/{name}"), "write")


def _remove(remote: Remote, name: str) -> None:
    fs, root = remote.fs()
    remote.attempt(remote.join(name), lambda: fs.rm_file(f"{root}/{name}"), "remove")
