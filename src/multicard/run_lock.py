"""One run per out_dir: a lock on out_dir/.multicard.lock, held for the run's life.

The lock is an advisory `flock`: the kernel drops it when its holder exits, however it exits,
so a lock left by a killed run is free. The file names its holder (host, pid, start time):
a second run says who holds it, and a run taking over after a killed one says so.

Who holds it: the built-in launcher on node 0 (its workers, restarted ones included, run under
it); otherwise rank 0 of the job (one process, torchrun, srun).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from multicard.errors import UserError

LOCK_NAME = ".multicard.lock"


class RunLock:
    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, say: Callable[[str], None]) -> None:
        """Hold the lock, or fail in one line naming the run that holds it."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(f"cannot create {self.path} ({exc.strerror}); choose a writable out_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd) or "another process"
            os.close(fd)
            raise UserError(
                f"out_dir={self.path.parent} is in use by another run ({holder}); wait for it to end, "
                f"stop it, or choose another out_dir"
            ) from None
        previous = _read(fd)
        if previous:
            say(f"out_dir={self.path.parent}: taking over from a run that ended without releasing it ({previous})")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%H:%M:%S')}".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Clear the holder's name and drop the lock (the file stays: nothing to race over)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read(fd: int) -> str:
    return os.pread(fd, 200, 0).decode(errors="replace").strip()
