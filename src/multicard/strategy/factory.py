"""The strategy `topology.resolve` chose, built with its own options."""


from __future__ import annotations

from multicard.base.config import Config
from multicard.runtime.process_group import ProcessContext
from multicard.strategy.base import ModelSetup, Strategy
from multicard.strategy.data_parallel import DataParallelStrategy
from multicard.strategy.ddp import DDPStrategy
from multicard.strategy.fsdp import FSDPStrategy
from multicard.strategy.precision import Precision
from multicard.strategy.topology import Topology


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
