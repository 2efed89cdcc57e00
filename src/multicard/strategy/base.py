"""The Strategy interface, and its simplest form: one process, one device.

Single-process training is world size 1 with no-op collectives; dp, ddp and fsdp refine only
what differs. The training loop talks to the model and to the other ranks through a Strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from multicard.runtime.process_group import ProcessContext
from multicard.strategy.compilation import compile_in_place, compiled_original
from multicard.strategy.optim import OptimizerRecipe
from multicard.strategy.precision import AutocastForward, Precision

StateDict = dict[str, Any]
# A model's optimizer, or [] for none (a model no optimizer steps: its state alone), as torch's get_state_dict
# takes them.
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]


@dataclass(frozen=True)
class ModelSetup:
    """How every strategy places the model: memory format and compilation."""

    channels_last: bool = False
    compile_mode: str | None = None  # a torch.compile mode, or None to run eagerly


class Strategy:
    """One process, one device: the base every other strategy refines."""

    name = "single"
    # Gradients are reduced over ranks at the end of backward (the loop times what is exposed).
    reduces_gradients = False
    checkpoint_format = "file"  # what checkpoint.format=auto writes: one file by rank 0

    def __init__(self, ctx: ProcessContext, precision: Precision, setup: ModelSetup) -> None:
        self.ctx = ctx
        self.precision = precision
        self.setup = setup

    @property
    def devices(self) -> list[torch.device]:
        """Devices whose memory this process uses."""
        return [self.ctx.device]

    def prepare(self, model: nn.Module) -> nn.Module:
        """Move to the device and dtype, convert layers, compile, wrap for autocast and the strategy.

        The order matters: torch.compile sees the converted bare model (so it never traces a
        wrapper), and autocast sits inside DataParallel/DDP (see AutocastForward).
        """
        model = model.to(self.ctx.device, dtype=self.precision.param_dtype)
        if self.setup.channels_last:
            model = model.to(memory_format=torch.channels_last)
        model = self.convert(model)
        if self.setup.compile_mode is not None:
            model = compile_in_place(model, self.setup.compile_mode)
        if self.precision.autocast_dtype is not None:
            model = AutocastForward(model, self.precision)
        return self.wrap(model)

    def convert(self, model: nn.Module) -> nn.Module:
        """Layer replacements the strategy needs, made on the bare model."""
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The bare model (no `module.` or `_orig_mod.` prefixes), for saving and evaluation."""
        while True:
            if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
                model = model.module
            elif isinstance(model, AutocastForward):
                model = model.model
            elif (original := compiled_original(model)) is not None:
                model = original
            else:
                return model

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        """Context for micro-steps whose gradients need not be reduced yet."""
        return nullcontext()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        self.ctx.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        return obj

    def agree_buffers(self, bare: nn.Module) -> None:
        """Make every rank's buffers (BatchNorm running statistics) rank 0's: the ones a checkpoint
        holds. Every rank calls it before evaluating and before saving."""

    def start_max(self, value: int) -> Callable[[], int]:
        """Start agreeing on the max of an int over ranks (on the CPU); the result's waiter."""
        return lambda: value

    def make_optimizer(self, recipe: OptimizerRecipe, bare: nn.Module) -> torch.optim.Optimizer:
        """The optimizer for the bare model's parameters (ZeRO-1 wraps it)."""
        return recipe.build()

    # ------------------------------------------------------------ checkpoint state

    def state_dicts(
        self, bare: nn.Module, optimizer: Optimizers, whole: bool = False
    ) -> tuple[StateDict, StateDict]:
        """(model, optimizer) state keyed by parameter names (no wrapper prefixes), so any
        strategy can load it; `whole`: whole tensors on rank 0 (they are whole already here).
        Every rank calls it."""
        return get_state_dict(bare, optimizer)

    def whole_model_state(self, bare: nn.Module) -> StateDict:
        """A copy of the model's state as whole CPU tensors on rank 0 (gathered under fsdp; empty
        elsewhere). A copy: on the CPU, offloading would hand out the live parameters themselves."""
        whole = get_model_state_dict(bare, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in whole.items()}

    def load_whole_model_state(self, bare: nn.Module, state: StateDict) -> None:
        """Whole tensors into the model, every rank giving them (sharded on the way in under fsdp)."""
        set_model_state_dict(bare, state, options=StateDictOptions(full_state_dict=True))

    def load_state_dicts(
        self, bare: nn.Module, optimizer: Optimizers, model_state: StateDict, optim_state: StateDict
    ) -> None:
        set_state_dict(bare, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def one_device_strategy(ctx: ProcessContext, precision: Precision, channels_last: bool = False) -> Strategy:
    """The single strategy on `ctx`'s device as a process of its own (rank 0 of 1, eager): what
    `multicard plan` traces a step on and `multicard input-split` times one with."""
    alone = ProcessContext(0, ctx.local_rank, 1, ctx.local_world_size, ctx.device, distributed=False, store=ctx.store)
    return Strategy(alone, precision, ModelSetup(channels_last))
