"""The model and how the processes share it: built (models.py), placed and wrapped by one small Strategy
interface for single, dp, ddp and fsdp (base.py, data_parallel.py, ddp.py, fsdp.py; factory.py builds the
one topology.py chose), with its precision, compilation, optimizer and synced BatchNorm.

Each strategy places and wraps the model, moves the collectives the loop needs, skips
gradient reduction on accumulation micro-steps, builds the optimizer (ZeRO-1 wraps it) and
gives its state keyed by parameter name so any other strategy can load it.

The names below are the package's public surface (the tools use these, never its modules).
Importing the package stays light: each is loaded on first use (fsdp loads torch's sharding stack).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multicard.strategy.base import ModelSetup, Strategy, one_device_strategy
    from multicard.strategy.fsdp_units import choose_units
    from multicard.strategy.models import build_model, check_input_size
    from multicard.strategy.optim import OPTIMIZER_KERNEL_KEYS, build_scheduler, fused_on_shards, optimizer_recipe
    from multicard.strategy.precision import Precision
    from multicard.strategy.topology import Topology, resolve

_HOME = {  # public name -> the module that defines it
    "ModelSetup": "base",
    "Strategy": "base",
    "one_device_strategy": "base",
    "choose_units": "fsdp_units",
    "build_model": "models",
    "check_input_size": "models",
    "fused_on_shards": "optim",
    "optimizer_recipe": "optim",
    "OPTIMIZER_KERNEL_KEYS": "optim",
    "build_scheduler": "optim",
    "Precision": "precision",
    "resolve": "topology",
    "Topology": "topology",
}
__all__ = [  # the keys of _HOME (tests/test_structure.py checks they agree)
    "ModelSetup",
    "Precision",
    "Strategy",
    "build_model",
    "check_input_size",
    "choose_units",
    "fused_on_shards",
    "one_device_strategy",
    "resolve",
    "Topology",
    "optimizer_recipe",
    "build_scheduler",
    "OPTIMIZER_KERNEL_KEYS",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
