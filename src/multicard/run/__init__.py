"""The public API for a user's own training loop: `multicard.Run` (run.py), and the `Scores` that
`run.evaluate` returns. Reference: docs/library.md."""

from multicard.run.evaluation import Scores
from multicard.run.run import Run

__all__ = ["Run", "Scores"]
