"""A multicard error that a user's script does not catch ends its process as `multicard train`
ends: one line (no traceback) and the documented exit code — a bad usage 2, a divergence 3, a
stop 128 + the signal after its checkpoint, a lost peer 6. Other exceptions keep Python's own
report. Installed by the first multicard.Run of the process."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import TracebackType

from multicard.base.errors import MulticardError
from multicard.runtime.exits import communication_failure, report_error

_cleanups: list[Callable[[BaseException], None]] = []  # what to release before such an end (a run's lock and files)


def ours(exc: BaseException) -> bool:
    return isinstance(exc, (MulticardError, KeyboardInterrupt)) or communication_failure(exc) is not None


def on_error(cleanup: Callable[[BaseException], None]) -> None:
    """`cleanup(exc)` runs before the process ends on such an error (the latest registered first)."""
    _cleanups.append(cleanup)


def forget(cleanup: Callable[[BaseException], None]) -> None:
    """A closed run's cleanup: nothing of it is left to release."""
    if cleanup in _cleanups:
        _cleanups.remove(cleanup)


def install() -> None:
    """The hook, once per process (a wrapper torch's process group puts around it keeps it)."""
    if any(getattr(hook, "multicard", False) for hook in _hooks_in(sys.excepthook)):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not ours(exc):
            previous(kind, exc, tb)
            return
        # torch's process group wraps this hook and collects what it writes to prefix it with the
        # rank; the process ends here, so the line goes straight to the real stderr.
        sys.stderr = sys.__stderr__ or sys.stderr  # (None only in a process started without one)
        for release in reversed(_cleanups):
            release(exc)
        code = report_error(exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if code is not None else 1)

    hook.multicard = True  # type: ignore[attr-defined]  # a mark on the function: install() knows its own by it
    sys.excepthook = hook


def _hooks_in(hook: object) -> list[object]:
    """`hook` and, if it wraps ours (torch's _distributed_excepthook keeps the one it replaced in a
    closure), the hooks inside it."""
    found = [hook]
    for cell in getattr(hook, "__closure__", None) or ():
        if callable(cell.cell_contents):
            found.append(cell.cell_contents)
    return found
