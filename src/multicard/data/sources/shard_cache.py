"""An optional cache of remote shards on local disk (`data.remote_cache_gb`), shared by every loader
process and rank of a node, so that later epochs and later runs read shards from local disk.

A shard is stored whole under `data.cache_dir` (default ~/.cache/multicard)/remote-shards, named by a
hash of its URL, size and ETag: a pack replaced at the same URL is never served stale. At most
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
import threading
import time
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


class ShardCache:
    """Whole shards on local disk, at most `max_bytes`, least recently used removed first."""

    def __init__(self, cache_dir: Path, max_bytes: int) -> None:
        self.folder = Path(cache_dir) / FOLDER
        self.max_bytes = max_bytes

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    def open(self, key: str, size: int) -> int | None:
        """A read-only descriptor of the cached shard, its use recorded; None where it is not there whole."""
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None  # never stored, or removed by another process
        if os.fstat(fd).st_size != size:
            os.close(fd)
            return None
        try:
            touch(path)
        except OSError:
            pass  # removed since it was opened: the descriptor still reads it
        return fd

    def read(self, key: str, size: int) -> bytes | None:
        """The cached shard's bytes, None where it is not there whole."""
        fd = self.open(key, size)
        if fd is None:
            return None
        try:
            data = os.pread(fd, size, 0)
        finally:
            os.close(fd)
        return data if len(data) == size else None

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
