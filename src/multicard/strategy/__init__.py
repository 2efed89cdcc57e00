"""How the processes share work: one small Strategy interface for single, dp, ddp and fsdp.

Each strategy places and wraps the model, moves the collectives the trainer needs, skips
gradient reduction on accumulation micro-steps, builds the optimizer (ZeRO-1 wraps it) and
gives its state keyed by parameter name so any other strategy can load it.
"""

from __future__ import annotations

from multicard.config import Config
from multicard.precision import Precision
from multicard.process_group import ProcessContext
from multicard.strategy.base import ModelSetup, StateDict, Strategy
from multicard.strategy.data_parallel import DataParallelStrategy
from multicard.strategy.ddp import DDPStrategy
from multicard.strategy.fsdp import FSDPStrategy
from multicard.topology import Topology

__all__ = [
    "DDPStrategy",
    "DataParallelStrategy",
    "FSDPStrategy",
    "ModelSetup",
    "StateDict",
    "Strategy",
    "make_strategy",
]


def make_strategy(
    topology: Topology, ctx: ProcessContext, precision: Precision, setup: ModelSetup, cfg: Config
) -> Strategy:
    """Build the strategy `topology.resolve` chose, with its own options."""
    if topology.strategy == "dp":
        return DataParallelStrategy(ctx, precision, setup, topology.gpus)
    if topology.strategy == "ddp":
        return DDPStrategy(ctx, precision, setup, cfg.ddp, cfg.sync_bn)
    if topology.strategy == "fsdp":
        return FSDPStrategy(ctx, precision, setup, cfg.fsdp, cfg.sync_bn, cfg.model.name)
    return Strategy(ctx, precision, setup)
