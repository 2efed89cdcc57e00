"""An optional cache of remote shards on local disk (`data.remote_cache_gb`), shared by every loader
process and rank of a node, so that later epochs and later runs read shards from local disk.

A shard is stored whole under `data.cache_dir` (default ~/.cache/multicard)/remote-shards, named by a
hash of its URL, size and ETag: a pack replaced at the same URL is never served stale. Every cached byte
is checked before it is used: a process reads a cached shard only once its size and its sha256 are those
the pack's index gives; a file changed on disk is named, removed and read from the URL again (its bucket's
object is not to blame). At most
`max_bytes` in all: before a shard is stored, the least recently used are removed (each use touches its
file's time); a shard larger than the bound is not stored. Several processes use the folder at once: a
shard is written under a temporary name and renamed (os.replace), so a reader sees it whole or not at
all; one removed by another process is simply not found (the shard is read from the URL again), and one
already open stays readable (POSIX; its space is freed when the last process holding it closes it). A
cache that cannot be written (a full disk) stores nothing: the shard is read from the URL, as without a
cache.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

FOLDER = "remote-shards"
SUFFIX = ".tar"
GB = 1 << 30


def shard_key(url: str, size: int, etag: str) -> str:
    """The name of a shard's file in the cache: changes with the shard's URL, size and ETag."""
    return hashlib.sha256(f"{url}\0{size}\0{etag}".encode()).hexdigest()[:32]


def touch(path: Path) -> None:
    """A file's time set to now, to the nanosecond (the kernel's own stamp is as coarse as its tick):
    the order of use that eviction follows."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def warn(line: str) -> None:
    print(f"multicard: {line}", file=sys.stderr, flush=True)


class CachedFile:
    """Positional reads of a cached shard through its open descriptor (it stays readable if another
    process evicts the file meanwhile)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.what = fd, str(path)

    def __call__(self, start: int, length: int) -> bytes:
        return os.pread(self.fd, length, start)


class ShardCache:
    """Whole shards on local disk, at most `max_bytes`, least recently used removed first."""

    def __init__(self, cache_dir: Path, max_bytes: int, say: Callable[[str], None] = warn) -> None:
        self.folder = Path(cache_dir) / FOLDER
        self.max_bytes = max_bytes
        self.say = say

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    def open(self, key: str, size: int, sha256: str | None, what: str) -> CachedFile | None:
        """The cached shard, its use recorded, where it is there whole and holds what was packed (`sha256`,
        the index's: the whole file is read to check it; None: it was just stored from checked bytes);
        None where it is not there, or was changed on disk (said, and removed: `what`, the shard it
        caches, is read again)."""
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None  # never stored, or removed by another process
        if os.fstat(fd).st_size != size or (sha256 is not None and _digest(fd) != sha256):
            changed = os.fstat(fd).st_size == size
            os.close(fd)
            if changed:
                self._changed(path, what)
            return None
        try:
            touch(path)
        except OSError:
            pass  # removed since it was opened: the descriptor still reads it
        return CachedFile(fd, path)

    def read(self, key: str, size: int, sha256: str | None, what: str) -> bytes | None:
        """The cached shard's bytes, checked as `open` checks them; None where it is not there whole."""
        cached = self.open(key, size, None, what)
        if cached is None:
            return None
        try:
            data = cached(0, size)
        finally:
            os.close(cached.fd)
        if len(data) != size:
            return None
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            self._changed(Path(cached.what), what)
            return None
        return data

    def _changed(self, path: Path, what: str) -> None:
        """A cached file whose bytes are not what was packed: said (the cache file is to blame, not the
        shard it caches), and removed."""
        self.say(f"warning: cached shard {path} (of {what}) was changed on disk: its checksum is not the one the "
                 f"pack's index gives; removed, and {what} read again")  # fmt: skip
        path.unlink(missing_ok=True)

    def put(self, key: str, data: bytes) -> None:
        """Store a shard (unless larger than the bound), evicting the least recently used to make room."""
        if len(data) > self.max_bytes:
            return
        part = self.folder / f".{key}.{os.getpid()}.{threading.get_ident()}.part"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.evict(self.max_bytes - len(data))
            part.write_bytes(data)
            touch(part)
            os.replace(part, self.path(key))  # atomic: readers see the shard whole or not at all
        except OSError:
            part.unlink(missing_ok=True)  # no room, or no folder: nothing cached, nothing half-written

    def evict(self, budget: int) -> None:
        """Remove the least recently used shards until the folder holds at most `budget` bytes
        (shards being written by other processes count, and are theirs to finish)."""
        files = []
        for entry in os.scandir(self.folder):
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue  # removed or renamed by another process meanwhile
            files.append((stat.st_mtime_ns, stat.st_size, entry.name, entry.path))
        total = sum(size for _, size, _, _ in files)
        for _, size, name, path in sorted(files):
            if total <= budget:
                break
            if name.endswith(SUFFIX):
                Path(path).unlink(missing_ok=True)
                total -= size


def _digest(fd: int) -> str:
    """The sha256 of the file an open descriptor reads, read from its start (the descriptor's offset unused)."""
    h, at = hashlib.sha256(), 0
    while chunk := os.pread(fd, 8 << 20, at):
        h.update(chunk)
        at += len(chunk)
    return h.hexdigest()
