"""Graceful stop: SIGTERM, SIGINT or SIGUSR1 asks every rank to checkpoint and exit at a step boundary.

SIGUSR1 is the warning a Slurm job asks for before its time limit (`--signal=USR1@120`):
the job checkpoints, exits 138, and its requeued run resumes (examples/slurm/train.sbatch).

The handler only records the signal. At each optimizer step the ranks agree on it with a
small all-reduce on the CPU, started one step and collected the next, so the check never
stalls training and every rank stops after the same step. A second SIGINT stops at once.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

from multicard.errors import MulticardError

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Stopped(MulticardError):
    """The run stopped on a signal after writing a checkpoint; exit code 128 + signal number."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class GracefulStop:
    def __init__(self, agree_max: Callable[[int], Callable[[], int]]) -> None:
        """`agree_max(v)` starts a max-reduction of v over ranks and returns its waiter."""
        self.agree_max = agree_max
        self.signum = 0
        self._pending: Callable[[], int] | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._pending is not None and exc_type is None:
            self._pending()  # a clean end: complete the collective every rank started
        self._pending = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: do not wait for the checkpoint
        self.signum = self.signum or signum

    def poll(self) -> int:
        """The signal all ranks agreed on one step ago (0: keep going); call once per step."""
        agreed = self._pending() if self._pending is not None else 0
        self._pending = self.agree_max(self.signum)
        return agreed
