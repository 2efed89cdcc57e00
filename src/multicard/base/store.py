"""One storage interface: a folder at a location — a local path, or a URL of any protocol fsspec knows
(s3://, gs://, az://, hdfs://, …) — used alike by the checkpointer and by the packed shards' reader and
writer. `open_store` is the one place that tells a URL from a local path (base/locations.py gives the
location's canonical form first).

Both kinds list, read and remove through fsspec (the local filesystem's, or the protocol's, opened once
per process: a forked loader process opens its own). What differs stays behind the same methods:

- the commit protocol. `write` puts one object whole or not at all; a folder of objects is written under
  `staging(name)`, then `commit(name)`, last, makes it exist for every reader; `committed` and
  `uncommitted` tell them apart in a listing, `remove` uncommits first. On local disk a commit is an
  atomic rename (the staged folder `.NAME.incomplete` becomes NAME). Object stores have no rename: there
  the commit is a small object, `STEM.commit`, written last, and objects without one are uncommitted
  (a writer cut short).
- pointers (`point`): hard or symbolic links on local disk; on object storage a small object naming its
  target.
- writes that take long (`write_later`): local disk writes at once; an object store takes the bytes at
  once and returns the upload, for the caller to run while it goes on.
- reads (`reader`): local files by positional reads of one descriptor; objects by ranged requests, each
  a round trip (`round_trips`: a reader then reads whole objects and keeps them).
- errors: requests to object storage are tried again on transient errors (base/storage.py), then one
  line naming the URL; local errors are one line at once.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from multicard.base.atomic import link_atomic, probe_write, remove_temporaries, symlink_atomic, write_atomic
from multicard.base.errors import UserError
from multicard.base.locations import canonical, check_url, filesystem_class, is_url, protocol
from multicard.base.storage import attempt, first_line, os_reason, storage_error

RETRIES = 3  # transient failures of one request tried again after 0.5, 1 and 2 s
COMMIT = ".commit"  # STEM.commit commits STEM.pt or the folder STEM on object storage
STAGED = ".incomplete"  # .NAME.incomplete: NAME being written on local disk
# What a protocol needs beyond its Python package, where opening it fails without (pyarrow's HDFS loads
# the JVM and Hadoop's native client when the filesystem is made).
NEEDS = {
    "hdfs": "hdfs:// (pyarrow's HadoopFileSystem) needs a Java runtime and Hadoop's client: install both and set "
    "JAVA_HOME, HADOOP_HOME and CLASSPATH=$(hadoop classpath --glob), or copy the data to local disk or a bucket",
}
SESSIONS: dict[tuple[str, str, int], Any] = {}  # (protocol, bucket, pid) → its filesystem: one takes ~0.3 s to open


def open_store(location: str, key: str = "path", retries: int = RETRIES) -> Store:
    """The store of a path or URL given for `key` (its canonical form: base/locations.py); a URL that
    cannot be read (unknown protocol, missing package, credentials in it) is one line."""
    location = canonical(location, key)
    if is_url(location):
        check_url(location, key)
        return ObjectStore(location, retries)
    return LocalStore(location, retries)


def commit_name(name: str) -> str:
    """The commit object of `name`: step-000000006.pt and step-000000006/ have step-000000006.commit."""
    return f"{name.split('.', 1)[0]}{COMMIT}"


class Store:
    """A folder at a location, read and written through fsspec. See the module's docstring."""

    round_trips = False  # each read a request over the network
    uncommitted_note = ""  # why a leftover is no checkpoint, as a line says it

    def __init__(self, url: str, retries: int = RETRIES) -> None:
        self.url, self.retries = url, retries
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "retries": self.retries, "_pid": -1}  # a session does not cross processes

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # ------------------------------------------------------------ where

    def join(self, name: str) -> str:
        """The location of `name` in this folder, as messages show it and open_store takes it."""
        return f"{self.url}/{name}" if name else self.url

    def location(self, name: str = "") -> Any:
        """`name`'s location as the public API gives it: a Path on local disk, a URL as text."""
        return self.join(name)

    def in_the_way(self) -> str | None:
        """A file where this folder (or one above it) goes, which makes it no folder; None if there is none."""
        return None

    def overlaps(self, path: str) -> str | None:
        """How this folder and the local folder `path` overlap: "inside" (this one lies inside `path`, or is
        it), "holds" (`path` lies inside this one), or None."""
        return None

    def check_writable(self, key: str) -> None:
        """Files can be made in this folder (checked before any work, nothing made), else one line."""

    @contextmanager
    def workspace(self, staging: Path) -> Iterator[Path]:
        """A local folder in which to make what then goes to this folder: `staging` (kept if the block fails,
        so that a rerun continues there; removed once it completes), or on local disk the folder itself."""
        yield staging
        shutil.rmtree(staging, ignore_errors=True)

    def open_binary(self, name: str) -> IO[bytes]:
        """`name` as a binary file to read through."""
        return io.BytesIO(self.read(name))

    def fs(self) -> tuple[Any, str]:
        """This process's filesystem, and this folder's path in it."""
        if self._pid != os.getpid():
            self._fs, self._root = self._open()
            self._pid = os.getpid()
        return self._fs, self._root

    def path(self, name: str = "") -> str:
        root = self.fs()[1]
        return f"{root}/{name}" if name else root

    def _open(self) -> tuple[Any, str]:
        raise NotImplementedError

    def attempt(self, what: str, call: Callable[[], Any], action: str = "read") -> Any:
        return attempt(what, call, self.retries, action)

    # ------------------------------------------------------------ objects

    def listing(self) -> dict[str, dict[str, Any]]:
        """name → entry (size, type, …) of everything directly in the folder, in one request: a folder not
        there yet holds nothing (a missing bucket is one line)."""
        raise NotImplementedError

    def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes [start, end) of `name` (all of it without them)."""
        fs, path = self.fs()[0], self.path(name)
        return self.attempt(self.join(name), lambda: fs.cat_file(path, start=start, end=end))

    def reader(self, name: str) -> Callable[[int, int], bytes]:
        """read(start, length) of `name`: what a reader of many small parts of one object calls."""
        return lambda start, length: self.read(name, start, start + length)

    def write(self, name: str, data: bytes) -> None:
        """`name` with these bytes, whole or not at all."""
        raise NotImplementedError

    def put(self, name: str, local: Path) -> None:
        """A local file copied to `name`, whole or not at all."""
        raise NotImplementedError

    def write_later(self, name: str, write: Callable[[IO[bytes]], Any] | None) -> Callable[[], None] | None:
        """`name` written by write(f) and committed: on local disk at once (None); on object storage the
        bytes are taken now and the call returned uploads and commits them (run where it may take time).
        Without `write` (a process that writes nothing of it) the same answer, with nothing to do."""
        raise NotImplementedError

    def remove(self, name: str) -> None:
        """`name` removed, an object or a folder of them (nothing if it is not there)."""
        raise NotImplementedError

    @contextmanager
    def local_copy(self, name: str) -> Iterator[Path]:
        """`name` (an object or a folder) as a local path for as long as the block runs; a one-line error
        of what reads it names the location, not a copy."""
        raise NotImplementedError

    def write_failure(self, name: str, exc: BaseException, probe: bool) -> UserError:
        """The one line of a failed write of `name` (`probe`: this process may look for the reason)."""
        return storage_error(self.join(name), exc, 1, 0.0, "write")

    def probe_write(self, size: int) -> float | None:
        """Seconds a test write of `size` bytes takes where writes cross a network (a grace period must
        cover a save), else None."""
        return None

    # ------------------------------------------------------------ the commit protocol

    def staging(self, name: str) -> str:
        """Where the objects of folder `name` are written before `commit(name)`."""
        raise NotImplementedError

    def commit(self, name: str) -> None:
        """Make `name` (written under staging(name)) exist for every reader: the last write."""
        raise NotImplementedError

    def committed(self, listing: dict[str, Any]) -> list[str]:
        """The committed names of a listing (as listed)."""
        raise NotImplementedError

    def uncommitted(self, listing: dict[str, Any]) -> dict[str, str]:
        """Leftovers of writes never committed: the name listed → the name it was meant to become."""
        raise NotImplementedError

    def retire(self, name: str) -> None:
        """Remove the committed `name`: uncommitted first (from then on no reader sees it), then its objects."""
        raise NotImplementedError

    def discard(self, leftover: str) -> None:
        """Remove a leftover of a write never committed (a name `uncommitted` gave)."""
        self.remove(leftover)

    def abandon(self, name: str) -> None:
        """After a failed write of folder `name`: what local disk holds of it goes at once (object storage
        keeps its leftovers, uncommitted, for the next run: a failing store takes no more requests)."""

    def tidy(self) -> None:
        """Remove what a killed writer left that is no one's (temporary files)."""

    # ------------------------------------------------------------ pointers

    def point(self, pointer: str, name: str) -> str | None:
        """`pointer` (last.pt, best) names `name` from now on; what it needs kept (`pointed`)."""
        raise NotImplementedError

    def pointed(self, pointer: str, listing: dict[str, Any]) -> str | None:
        """The name `pointer` names where the pointer needs it kept (rotation keeps it), else None."""
        raise NotImplementedError

    def resolve(self, name: str, listing: dict[str, Any]) -> str:
        """The name a pointer names (a name that is no pointer: itself)."""
        return name


class LocalStore(Store):
    """A folder on local disk (a mounted filesystem counts)."""

    uncommitted_note = "it was never renamed into place"

    def __init__(self, url: str, retries: int = RETRIES) -> None:
        super().__init__(str(Path(url)), 0)  # local errors are not transient: no retries

    def _open(self) -> tuple[Any, str]:
        import fsspec

        return fsspec.filesystem("file"), os.path.abspath(self.url)

    def attempt(self, what: str, call: Callable[[], Any], action: str = "read") -> Any:
        try:
            return call()
        except FileNotFoundError:
            raise UserError(f"{what} does not exist; check the path") from None
        except OSError as exc:
            raise UserError(f"cannot {action} {what} ({exc.strerror or type(exc).__name__}); check the path") from None

    def listing(self) -> dict[str, dict[str, Any]]:
        try:
            entries = list(os.scandir(self.url))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        found = {}
        for entry in entries:
            try:
                size = entry.stat().st_size
            except OSError:
                size = 0  # a link whose target is gone
            kind = "directory" if entry.is_dir() else "file"
            found[entry.name] = {"name": entry.path, "size": size, "type": kind, "islink": entry.is_symlink()}
        return found

    def join(self, name: str) -> str:
        return str(Path(self.url) / name) if name else self.url

    def location(self, name: str = "") -> Path:
        return Path(self.join(name))

    def in_the_way(self) -> str | None:
        path = Path(self.url).absolute()
        where = next((folder for folder in (path, *path.parents) if folder.exists()), None)
        return None if where is None or where.is_dir() else str(where if where != path else self.url)

    def overlaps(self, path: str) -> str | None:
        here, there = Path(self.url).resolve(), Path(path).resolve()
        if here == there or there in here.parents:
            return "inside"
        return "holds" if here in there.parents else None

    def check_writable(self, key: str) -> None:
        """A file in the folder's path, or a folder that cannot be written, is one line: a file is made and
        removed in the folder (or its nearest existing parent), as permission bits do not tell (root,
        read-only mounts)."""
        out = Path(self.url).expanduser()
        where = next(folder for folder in (out, *out.parents) if folder.exists())
        if not where.is_dir():
            inside = "" if where == out else f": {where}"
            raise UserError(f"{key} {self.url}{inside} is a file; give a folder (the results are written inside it)")
        try:
            probe_write(where)
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise UserError(f"{key} {self.url} cannot be written ({reason}); choose another folder") from None

    @contextmanager
    def workspace(self, staging: Path) -> Iterator[Path]:
        yield Path(self.url)  # made in place

    def open_binary(self, name: str) -> IO[bytes]:
        return open(self.join(name), "rb")

    def reader(self, name: str) -> Callable[[int, int], bytes]:
        return FileReader(self.join(name))

    def write(self, name: str, data: bytes) -> None:
        write_atomic(Path(self.join(name)), lambda f: f.write(data))

    def put(self, name: str, local: Path) -> None:
        target = Path(self.join(name))
        if target.exists() and os.path.samefile(target, local):
            return
        with open(local, "rb") as src:
            write_atomic(target, lambda f: shutil.copyfileobj(src, f))

    def write_later(self, name: str, write: Callable[[IO[bytes]], Any] | None) -> Callable[[], None] | None:
        if write is not None:
            write_atomic(Path(self.join(name)), write)  # the rename is the commit
        return None

    def remove(self, name: str) -> None:
        path = Path(self.join(name))
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    @contextmanager
    def local_copy(self, name: str) -> Iterator[Path]:
        yield Path(self.join(name))

    def staging(self, name: str) -> str:
        return f".{name}{STAGED}"

    def commit(self, name: str) -> None:
        staged, target = Path(self.join(self.staging(name))), Path(self.join(name))
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(staged, target)

    def committed(self, listing: dict[str, Any]) -> list[str]:
        return [name for name in listing if not name.startswith(".")]

    def uncommitted(self, listing: dict[str, Any]) -> dict[str, str]:
        return {name: name[1 : -len(STAGED)] for name in listing if name.startswith(".") and name.endswith(STAGED)}

    def retire(self, name: str) -> None:
        staged = self.staging(name)
        try:
            os.replace(self.join(name), self.join(staged))
        except FileNotFoundError:
            return
        self.remove(staged)

    def abandon(self, name: str) -> None:
        self.remove(self.staging(name))

    def write_failure(self, name: str, exc: BaseException, probe: bool) -> UserError:
        staged = Path(self.join(self.staging(name)))
        reason = os_reason(exc) or (_space_left(staged) if probe else None) or first_line(exc)
        return UserError(
            f"cannot write {self.join(name)} ({reason}); free space in {self.url} or choose another out_dir "
            f"(earlier checkpoints are intact)"
        )

    def tidy(self) -> None:
        if os.path.isdir(self.url):
            remove_temporaries(Path(self.url))

    def point(self, pointer: str, name: str) -> str | None:
        target, link = Path(self.join(name)), Path(self.join(pointer))
        if target.is_dir():
            symlink_atomic(name, link)  # a folder: a symbolic link
            return name
        link_atomic(target, link)  # a file: a hard link, which outlives the step file it was made from
        return None

    def pointed(self, pointer: str, listing: dict[str, Any]) -> str | None:
        link = Path(self.join(pointer))
        return os.readlink(link).rstrip("/").rsplit("/", 1)[-1] if link.is_symlink() else None


def _space_left(folder: Path) -> str | None:
    """Why `folder` takes no more bytes (disk full, quota), found by writing 1 MiB there; None if it
    does. DCP's shard writer loses the OS error (torch's zip writer says only 'unexpected pos')."""
    if not folder.is_dir():
        return None
    probe = folder / ".space-probe"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(2**20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return exc.strerror
    finally:
        probe.unlink(missing_ok=True)
    return None


class FileReader:
    """Positional reads of a local file through one descriptor, opened on the first read (per process:
    a descriptor is not shared with a forked loader process; once, whichever thread reads first)."""

    def __init__(self, path: str) -> None:
        self.path = self.what = path
        self._fd, self._pid = -1, -1
        self._opening = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "what": self.what, "_fd": -1, "_pid": -1}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _opening=threading.Lock())

    def __call__(self, start: int, length: int) -> bytes:
        if self._pid != os.getpid():
            with self._opening:
                if self._pid != os.getpid():
                    self._fd = os.open(self.path, os.O_RDONLY)
                    self._pid = os.getpid()
        return os.pread(self._fd, length, start)


class ObjectStore(Store):
    """A prefix of object storage (or any other filesystem fsspec reaches by a URL)."""

    round_trips = True
    uncommitted_note = "it has no commit object"

    def __init__(self, url: str, retries: int = RETRIES) -> None:
        super().__init__(url.rstrip("/") if url.split("://", 1)[1].strip("/") else url, retries)
        self.scheme = protocol(url)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "scheme": self.scheme}

    def _open(self) -> tuple[Any, str]:
        """The protocol's filesystem, one per bucket and process: a new session (never one a parent process
        made), for s3:// without botocore's own retries (ours are the only ones) and with bounded timeouts."""
        cls = filesystem_class(self.scheme, self.url)  # a package missing here too is one line
        bucket = self.url.split("://", 1)[1].split("/", 1)[0]
        key = (self.scheme, bucket, os.getpid())
        if key not in SESSIONS:
            import fsspec.core

            options: dict[str, Any] = {"skip_instance_cache": True}
            if self.scheme in ("s3", "s3a"):
                options["config_kwargs"] = {"retries": {"total_max_attempts": 1}, "connect_timeout": 10,
                                            "read_timeout": 60}  # fmt: skip
            try:
                fs = fsspec.core.url_to_fs(self.url, **options)[0]
            except (OSError, ImportError, RuntimeError) as exc:
                raise _unopened(self.url, self.scheme, exc) from None
            if hasattr(fs, "retries"):
                fs.retries = 1  # s3fs tries 5 times by itself: ours are the retries
            SESSIONS[key] = fs
        return SESSIONS[key], cls._strip_protocol(self.url).rstrip("/")

    def listing(self) -> dict[str, dict[str, Any]]:
        fs, path = self.fs()

        def ls() -> list[dict[str, Any]]:
            fs.invalidate_cache(path)
            try:
                return fs.ls(path, detail=True)
            except FileNotFoundError:
                bucket = path.split("/", 1)[0]
                if bucket != path and fs.exists(bucket):
                    return []  # a new prefix of a bucket that is there
                raise

        return {entry["name"].rstrip("/").rsplit("/", 1)[-1]: entry for entry in self.attempt(self.url, ls)}

    def write(self, name: str, data: bytes) -> None:
        fs, path = self.fs()[0], self.path(name)
        self.attempt(self.join(name), lambda: fs.pipe_file(path, data), "write")

    def put(self, name: str, local: Path) -> None:
        fs, path = self.fs()[0], self.path(name)
        self.attempt(self.join(name), lambda: fs.put_file(str(local), path), "write")

    def write_later(self, name: str, write: Callable[[IO[bytes]], Any] | None) -> Callable[[], None] | None:
        if write is None:
            return lambda: None
        buffer = io.BytesIO()
        write(buffer)  # the bytes of now: the caller may change what they were made from
        data = buffer.getvalue()

        def upload() -> None:
            self.write(name, data)
            self.commit(name)

        return upload

    def remove(self, name: str) -> None:
        fs, path = self.fs()[0], self.path(name)
        self.attempt(self.join(name), lambda: fs.rm(path, recursive=True), "remove")

    @contextmanager
    def local_copy(self, name: str) -> Iterator[Path]:
        scratch = Path(tempfile.mkdtemp(prefix="multicard-download-"))
        local = scratch / name.rsplit("/", 1)[-1]
        try:
            fs, path = self.fs()[0], self.path(name)
            fs.invalidate_cache(path)  # what another process uploaded since this one listed the folder
            self.attempt(self.join(name), lambda: fs.get(path, str(local), recursive=True))
            try:
                yield local
            except UserError as exc:
                raise UserError(str(exc).replace(str(local), self.join(name))) from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def probe_write(self, size: int) -> float | None:
        began = time.monotonic()
        self.write(".multicard-write-test", bytes(size))
        took = max(time.monotonic() - began, 1e-6)
        self.remove(".multicard-write-test")
        return took

    def staging(self, name: str) -> str:
        return name  # written in place: the commit object says when it is whole

    def commit(self, name: str) -> None:
        self.write(commit_name(name), f"{name}\n".encode())

    def committed(self, listing: dict[str, Any]) -> list[str]:
        return [name for name in listing if not name.endswith(COMMIT) and commit_name(name) in listing]

    def uncommitted(self, listing: dict[str, Any]) -> dict[str, str]:
        return {name: name for name in listing if not name.endswith(COMMIT) and commit_name(name) not in listing}

    def retire(self, name: str) -> None:
        self.remove(commit_name(name))
        self.remove(name)

    def point(self, pointer: str, name: str) -> str | None:
        self.write(pointer, f"{name}\n".encode())
        return name

    def pointed(self, pointer: str, listing: dict[str, Any]) -> str | None:
        return self.read(pointer).decode().strip() if pointer in listing else None

    def resolve(self, name: str, listing: dict[str, Any]) -> str:
        return self.pointed(name, listing) or name


def _unopened(url: str, scheme: str, exc: BaseException) -> UserError:
    """A filesystem that could not be made (a library it loads is missing: pyarrow's HDFS without a JVM),
    in one line naming what to install."""
    if scheme in NEEDS:
        return UserError(f"cannot open {url} ({type(exc).__name__}: {first_line(exc)[:120]}); {NEEDS[scheme]}")
    return storage_error(url, exc, 1, 0.0, "open")
