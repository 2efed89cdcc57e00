"""Recipes: what `multicard train` and `multicard eval` run, written on the public API
(multicard.Run) as a user's script would be. `ImageClassifier` (classifier.py) trains the image
classifier a config describes; `evaluate_checkpoint` (evaluation.py) evaluates one of its
checkpoints exactly. The tools drive them through these names.

Loaded on first use: the command line imports the package without the training stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multicard.engine.meters import EvalResult
    from multicard.recipes.classifier import ImageClassifier, cross_entropy, train_top1
    from multicard.recipes.ema import WeightAverage
    from multicard.recipes.evaluation import check_eval, evaluate_checkpoint, weights_of

_HOME = {
    "ImageClassifier": "multicard.recipes.classifier",
    "cross_entropy": "multicard.recipes.classifier",
    "train_top1": "multicard.recipes.classifier",
    "WeightAverage": "multicard.recipes.ema",
    "EvalResult": "multicard.engine.meters",
    "check_eval": "multicard.recipes.evaluation",
    "evaluate_checkpoint": "multicard.recipes.evaluation",
    "weights_of": "multicard.recipes.evaluation",
}
__all__ = [  # the keys of _HOME
    "EvalResult", "ImageClassifier", "WeightAverage", "check_eval", "cross_entropy", "evaluate_checkpoint",
    "train_top1", "weights_of",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'multicard.recipes' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
