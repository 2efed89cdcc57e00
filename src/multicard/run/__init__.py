"""The public API for a user's own training loop, `multicard.Run` (run.py), and the `Scores` that
`run.evaluate` returns (reference: docs/library.md); and how every run is assembled: the preflight
checks (preflight.py) and the one object that builds a run's parts (assembly.py, from the recipes in
session.py).

Loaded on first use: the launcher imports the preflight checks without the training stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multicard.run.evaluation import Scores
    from multicard.run.run import Run

__all__ = ["Run", "Scores"]


def __getattr__(name: str) -> Any:
    if name == "Run":
        from multicard.run.run import Run

        return Run
    if name == "Scores":
        from multicard.run.evaluation import Scores

        return Scores
    raise AttributeError(f"module 'multicard.run' has no attribute {name!r}")
