"""Code of the user's that multicard runs in its own process: a dataset or model module's import
and its function (`data.name=` / `model.name=package.module:function`).

Such code may change what the whole process runs under: torch's default dtype (the run's
precision comes from the config, and tensors multicard makes, e.g. the loaders' normalisation,
would follow the changed default), or the handlers of the stop signals (a module that ignores
SIGTERM would silently turn off the graceful stop). `user_code` puts both back as they were
before the call and says so in one line.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from multicard.runtime.stopping import HANDLED_SIGNALS


def _handlers() -> dict[int, Any]:
    return {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}


@contextmanager
def user_code(what: str) -> Iterator[None]:
    """Run the block (the user's `what`, e.g. "data.name=M:F"), then put back torch's default
    dtype and the stop signals' handlers if it changed them, with one warning line."""
    dtype, handlers = torch.get_default_dtype(), _handlers()
    try:
        yield
    finally:
        changes = []
        changed = torch.get_default_dtype()
        if changed != dtype:
            torch.set_default_dtype(dtype)
            changes.append(
                f"set torch's default dtype to {changed} (multicard put back {dtype}: the run's precision comes from "
                f"the config)"
            )
        moved = [sig for sig, handler in _handlers().items() if handler != handlers[sig]]
        for sig in moved:
            signal.signal(sig, handlers[sig])  # only the main thread can have changed them
        if moved:
            changes.append(
                f"changed the handler of {', '.join(signal.Signals(sig).name for sig in moved)} (multicard put back "
                f"the previous handlers: a stop signal still stops a training run with a checkpoint)"
            )
        if changes:
            print(f"multicard: warning: {what} {' and '.join(changes)}", file=sys.stderr, flush=True)
