"""A multicard error that a user's script does not catch ends its process as `multicard train`
ends: one line (no traceback) and the documented exit code — a bad usage 2, a divergence 3, a
stop 128 + the signal after its checkpoint, a lost peer 6. Other exceptions keep Python's own
report. Installed by the first multicard.Run of the process."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import TracebackType

from multicard.errors import MulticardError
from multicard.exits import report_error
from multicard.process_group import communication_failure

_cleanups: list[Callable[[BaseException], None]] = []  # what to release before such an end (a run's lock and files)


def ours(exc: BaseException) -> bool:
    return isinstance(exc, (MulticardError, KeyboardInterrupt)) or communication_failure(exc) is not None


def end_on_error(cleanup: Callable[[BaseException], None]) -> None:
    """Install the hook once per process; `cleanup(exc)` runs before the process ends on such an error
    (the latest registered first)."""
    _cleanups.append(cleanup)
    if getattr(sys.excepthook, "multicard", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not ours(exc):
            previous(kind, exc, tb)
            return
        for release in reversed(_cleanups):
            release(exc)
        code = report_error(exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if code is not None else 1)

    hook.multicard = True  # type: ignore[attr-defined]
    sys.excepthook = hook
