"""nn.DataParallel: one process drives several GPUs; the batch is split per forward."""

from __future__ import annotations

import torch
import torch.nn as nn

from multicard.runtime.process_group import ProcessContext
from multicard.strategy.base import ModelSetup, Strategy
from multicard.strategy.precision import PassThrough, Precision


class DataParallelStrategy(Strategy):
    """Replicas of the model on each GPU, made anew at every forward; gradients summed on the first GPU."""

    name = "dp"

    def __init__(self, ctx: ProcessContext, precision: Precision, setup: ModelSetup, gpus: list[int]) -> None:
        super().__init__(ctx, precision, setup)
        self.gpus = gpus

    @property
    def devices(self) -> list[torch.device]:
        return [torch.device("cuda", i) for i in self.gpus]

    def wrap(self, model: nn.Module) -> nn.Module:
        return DataParallel(model, device_ids=self.gpus, output_device=self.gpus[0])


class DataParallel(PassThrough, nn.DataParallel):
    """torch's DataParallel, through which the wrapped module's own methods and attributes stay reachable."""
