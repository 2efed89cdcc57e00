"""One run per out_dir: a lock on out_dir/.multicard.lock, held for the run's life.

The lock is an advisory `flock`: the kernel drops it when its holder exits, however it exits,
so a lock left by a killed run is free. The file names its holder (host, pid, start time):
a second run says who holds it, and a run taking over after a killed one says so. A run that is
refused (bad input) leaves out_dir as it found it: the lock file goes if that run made it, and
out_dir too if the run made it and it is empty.

Who holds it: the built-in launcher on node 0 (its workers, restarted ones included, run under
it); otherwise rank 0 of the job (one process, torchrun, srun). It also holds, for as long, the run's
other locks (`hold_also`: a checkpoint.dir elsewhere, base/store_lock.py).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from multicard.base.errors import UserError

LOCK_NAME = ".multicard.lock"


class RunLock:
    def __init__(self, out_dir: Path, made_out_dir: bool = False) -> None:
        self.path = out_dir / LOCK_NAME
        self._fd: int | None = None
        self._made_out_dir = made_out_dir  # this run created out_dir (prepare_out_dir)
        self._made_file = False
        self._refused = False
        self._others: list[Any] = []  # locks held with this one, released before it

    def acquire(self, say: Callable[[str], None]) -> None:
        """Hold the lock, or fail in one line naming the run that holds it."""
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd) or "another process"
                os.close(fd)
                raise UserError(
                    f"out_dir={self.path.parent} is in use by another run ({holder}); wait for it to end, "
                    f"stop it, or choose another out_dir"
                ) from None
            if _is_current(fd, self.path):
                break
            os.close(fd)  # a refused run removed that file after we opened it: lock the one there now
        previous = _read(fd)
        if previous:
            say(f"out_dir={self.path.parent}: taking over from a run that ended without releasing it ({previous})")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%H:%M:%S')}".encode(), 0)
        self._fd = fd

    def hold_also(self, other: Any, say: Callable[[str], None]) -> None:
        """Acquire another lock of this run and hold it for as long as this one."""
        other.acquire(say)
        self._others.append(other)

    def _open(self) -> int:
        """The lock file's descriptor, noting whether this run made the file."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            self._made_file = True
            return fd
        except FileExistsError:
            self._made_file = False
        except OSError as exc:
            raise UserError(f"cannot create {self.path} ({exc.strerror}); choose a writable out_dir") from None
        try:
            return os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return self._open()  # removed in between
        except OSError as exc:
            raise UserError(f"cannot open {self.path} ({exc.strerror}); choose a writable out_dir") from None

    def refused(self) -> None:
        """This run was refused (bad input): on release it leaves out_dir as it found it."""
        self._refused = True

    def release(self) -> None:
        """Clear the holder's name and drop the lock (the file stays, unless a refused run made
        it: acquire checks that the file it locked is still the one at the path)."""
        while self._others:
            self._others.pop().release()
        if self._fd is not None:
            if self._refused and self._made_file:
                self.path.unlink(missing_ok=True)  # while still locked: no other run holds this file
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None
        if self._refused and self._made_out_dir:
            try:
                self.path.parent.rmdir()  # only if empty
            except OSError:
                pass

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _is_current(fd: int, path: Path) -> bool:
    """The file `fd` refers to is still the one at `path` (not one removed since it was opened)."""
    try:
        here, locked = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (locked.st_dev, locked.st_ino)


def _read(fd: int) -> str:
    return os.pread(fd, 200, 0).decode(errors="replace").strip()
