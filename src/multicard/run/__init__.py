"""The public API: `multicard.Run` (run.py: a user's own loop, and the loop `multicard train`'s
recipe runs), the `Scores` that `run.evaluate` returns (reference: docs/library.md), and what the
loop's callbacks are: `Callback` (its hooks, in the order the run calls them), the `Loop` they
receive (the run's models, optimizers, position and phase) and `StepEnd` (what a step's end tells).
The run is assembled below it (multicard.assembly).

Loaded on first use: `import multicard` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multicard.engine.loop import Callback, Loop, StepEnd
    from multicard.run.evaluation import Scores
    from multicard.run.run import Run

_HOME = {
    "Run": "multicard.run.run",
    "Scores": "multicard.run.evaluation",
    "Callback": "multicard.engine.loop",
    "Loop": "multicard.engine.loop",
    "StepEnd": "multicard.engine.loop",
}
__all__ = ["Callback", "Loop", "Run", "Scores", "StepEnd"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'multicard.run' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
