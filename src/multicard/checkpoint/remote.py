"""Checkpoints on object storage: checkpoint.dir=s3://bucket/run1/checkpoints (any fsspec protocol).

Object stores have no rename, so a checkpoint there exists only once its commit object,
step-NNNNNNNNN.commit, written last, says so: every reader (resume, eval, export, model.weights,
`last`/`best`, pruning) sees committed checkpoints alone, and pruning removes the commit object first.
`last` is the newest commit; `best` a small object naming a step. Every request goes through
storage.Remote: retries with backoff on transient errors, then one line.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from multicard.base.errors import UserError
from multicard.base.storage import Remote, check_url, is_url

PREFIX = "step-"
COMMIT = ".commit"  # step-NNNNNNNNN.commit beside step-NNNNNNNNN.pt (or the step-NNNNNNNNN/ of DCP)
BEST = "best"  # an object whose text is the name of the best step's checkpoint
LAST_NAMES, BEST_NAMES = ("last", "last.pt"), ("best", "best.pt")
RETRIES = 3  # transient failures of one request tried again after 0.5, 1 and 2 s


def checkpoint_folder(default: Path, configured: str | None) -> Path | str:
    """Where a run's checkpoints are: checkpoint.dir (a local path, or a URL kept as text: a Path
    would fold its `//`), else `default`, out_dir/checkpoints. The one place that decides it."""
    if not configured:
        return default
    return configured.rstrip("/") if is_url(configured) else Path(configured)


def is_remote(path: Any) -> bool:
    return isinstance(path, str) and is_url(path)


def step_of(name: str) -> int | None:
    """N of step-NNNNNNNNN, step-NNNNNNNNN.pt or step-NNNNNNNNN.commit; None for any other name."""
    digits = name[len(PREFIX) :].removesuffix(".pt").removesuffix(COMMIT)
    return int(digits) if name.startswith(PREFIX) and digits.isdigit() else None


def _names(fs: Any, path: str) -> list[str]:
    """The names directly under `path`: none for a folder not yet written, but a missing bucket is said."""
    fs.invalidate_cache(path)
    try:
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)]
    except FileNotFoundError:
        fs.ls(path.split("/", 1)[0], detail=False)  # the bucket: FileNotFoundError if it is missing
        return []


_REMOTES: dict[tuple[str, int], Remote] = {}  # (bucket URL, pid) → its session: opening one takes ~0.3 s


class RemoteFolder:
    """A folder of checkpoints on object storage: which are committed, and the requests that write,
    commit, point at and remove them (each retried, failing in one line). One session per bucket and
    process (a forked process opens its own: storage.Remote)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        scheme, rest = self.url.split("://", 1)
        bucket, _, self.prefix = rest.partition("/")
        key = (f"{scheme}://{bucket}", os.getpid())
        if key not in _REMOTES:
            _REMOTES[key] = Remote(key[0], RETRIES)
        self.remote = _REMOTES[key]

    def join(self, name: str) -> str:
        return f"{self.url}/{name}"

    def path(self, name: str = "") -> tuple[Any, str]:
        """The session's filesystem, and the path in it of `name` in this folder (of the folder without)."""
        fs, root = self.remote.fs()
        return fs, "/".join(part for part in (root, self.prefix, name) if part)

    def _call(self, name: str, action: str, request: Any) -> Any:
        fs, path = self.path(name)
        return self.remote.attempt(self.join(name), lambda: request(fs, path), action)

    def names(self) -> list[str]:
        fs, path = self.path()
        return self.remote.attempt(self.url, lambda: _names(fs, path))

    def committed(self, names: list[str] | None = None) -> list[tuple[int, str]]:
        """(step, URL) of every committed checkpoint, newest first."""
        names = self.names() if names is None else names
        present = set(names)
        found = []
        for name in names:
            step = step_of(name)
            if step is not None and name.endswith(COMMIT):
                stem = name.removesuffix(COMMIT)
                found.append((step, self.join(f"{stem}.pt" if f"{stem}.pt" in present else stem)))
        return sorted(found, reverse=True)

    def uncommitted(self, names: list[str] | None = None) -> list[str]:
        """URLs of step checkpoints without a commit object (an upload cut short), newest first."""
        names = self.names() if names is None else names
        committed = {url for _, url in self.committed(names)}
        return [
            self.join(n) for n in sorted(names, reverse=True)
            if not n.endswith(COMMIT) and step_of(n) is not None and self.join(n) not in committed
        ]  # fmt: skip

    def newest(self) -> str | None:
        committed = self.committed()
        return committed[0][1] if committed else None

    def best(self) -> str | None:
        """The checkpoint `best` names, if it is committed (train.resume=never may have removed it)."""
        names = self.names()
        if BEST not in names:
            return None
        url = self.join(self.read(BEST).decode().strip())
        return url if url in [u for _, u in self.committed(names)] else None

    def read(self, name: str) -> bytes:
        return self._call(name, "read", lambda fs, path: fs.cat_file(path))

    def upload(self, name: str, data: bytes) -> None:
        self._call(name, "write", lambda fs, path: fs.pipe_file(path, data))

    def commit(self, url: str) -> None:
        """Make the checkpoint at `url` exist for every reader: its commit object, written last."""
        name = url.rsplit("/", 1)[-1]
        self.upload(f"{name.removesuffix('.pt')}{COMMIT}", f"{name}\n".encode())

    def delete(self, name: str) -> None:
        self._call(name, "remove", lambda fs, path: fs.rm(path))

    def point_best(self, url: str) -> None:
        self.upload(BEST, f"{url.rsplit('/', 1)[-1]}\n".encode())

    def remove(self, url: str) -> None:
        """The commit object first (no reader sees the checkpoint from then on), then its objects."""
        name = url.rsplit("/", 1)[-1]
        self._call(f"{name.removesuffix('.pt')}{COMMIT}", "remove", lambda fs, path: fs.rm(path))
        self.discard(url)

    def discard(self, url: str) -> None:
        """An uncommitted checkpoint's objects (no reader sees them: there is no commit object to remove)."""
        name = url.rsplit("/", 1)[-1]
        self._call(name, "remove", lambda fs, path: fs.rm(path, recursive=not name.endswith(".pt")))

    def is_committed(self, url: str) -> bool:
        return url in [u for _, u in self.committed()]


def committed_target(url: str, key: str) -> str:
    """The committed checkpoint a URL names: a step checkpoint (file or DCP folder), or `last`/`best`
    of a folder of them; one line if it names an uncommitted or missing one."""
    check_url(url, key)
    url = url.rstrip("/")
    parent, name = url.rsplit("/", 1)
    if name in LAST_NAMES + BEST_NAMES:
        folder = RemoteFolder(parent)
        target = folder.newest() if name in LAST_NAMES else folder.best() or folder.newest()
        if target is None:
            raise UserError(f"{key}={url}: {parent} holds no committed checkpoint; give another one")
        return target
    if step_of(name) is not None:
        if not RemoteFolder(parent).is_committed(url):
            raise UserError(
                f"{key}={url} is not a committed checkpoint (no {name.removesuffix('.pt')}{COMMIT}: its upload "
                f"did not finish, or it does not exist); give a committed one, e.g. {parent}/last"
            )
        return url
    folder = RemoteFolder(url)
    newest = folder.newest()
    if newest is None:
        raise UserError(f"{key}={url} holds no committed checkpoint; give the URL of one (…/step-NNNNNNNNN.pt)")
    raise UserError(f"{key}={url} is a folder of checkpoints; give one of them, e.g. {url}/last or {newest}")


@contextmanager
def downloaded(url: str) -> Iterator[Path]:
    """A local copy of the object (or folder of objects) at `url`, in a temporary folder removed after;
    one-line errors of what reads it name the URL, not the copy."""
    parent, name = url.rsplit("/", 1)
    folder = RemoteFolder(parent)
    scratch = Path(tempfile.mkdtemp(prefix="multicard-checkpoint-"))
    local = scratch / name
    try:
        fs, path = folder.path(name)
        fs.invalidate_cache(path)  # what another process uploaded since this one listed the folder
        folder.remote.attempt(url, lambda: fs.get(path, str(local), recursive=True))
        try:
            yield local
        except UserError as exc:
            raise UserError(str(exc).replace(str(local), url)) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def readable(path: Path | str, key: str = "--checkpoint") -> Iterator[Path]:
    """A checkpoint as a local path its format reads: a local one as it is, a URL's committed
    checkpoint downloaded for the time of the reading."""
    if not is_remote(path):
        yield Path(path)
        return
    with downloaded(committed_target(path, key)) as local:
        yield local
