"""How the processes share work: one small interface for single, dp and ddp.

Single-process training is world size 1 with no-op collectives; dp and ddp override only
what differs. The engine talks to the model and to the other ranks through a Strategy.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from multicard.compilation import compile_in_place, compiled_original
from multicard.config import DDPConfig
from multicard.precision import AutocastForward, Precision
from multicard.process_group import ProcessContext
from multicard.syncbn import convert_global_batchnorm
from multicard.topology import Topology

StateDict = dict[str, Any]


@dataclass(frozen=True)
class ModelSetup:
    """How every strategy places the model: memory format and compilation."""

    channels_last: bool = False
    compile_mode: str | None = None  # a torch.compile mode, or None to run eagerly

_DDP_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters


class Strategy:
    """One process, one device: the base every other strategy refines."""

    name = "single"
    # Gradients are reduced over ranks at the end of backward (the trainer times what is exposed).
    reduces_gradients = False

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
        pass

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        return obj

    def start_max(self, value: int) -> Callable[[], int]:
        """Start agreeing on the max of an int over ranks (on the CPU); the result's waiter."""
        return lambda: value

    # ------------------------------------------------------------ checkpoint state

    def state_dicts(self, bare: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[StateDict, StateDict]:
        """(model, optimizer) state keyed by parameter names (no wrapper prefixes), so any
        strategy can load it. Every rank calls it."""
        return get_state_dict(bare, optimizer)

    def load_state_dicts(
        self, bare: nn.Module, optimizer: torch.optim.Optimizer, model_state: StateDict, optim_state: StateDict
    ) -> None:
        set_state_dict(bare, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


class DataParallelStrategy(Strategy):
    """nn.DataParallel: one process drives several GPUs; the batch is split per forward."""

    name = "dp"

    def __init__(self, ctx: ProcessContext, precision: Precision, setup: ModelSetup, gpus: list[int]) -> None:
        super().__init__(ctx, precision, setup)
        self.gpus = gpus

    @property
    def devices(self) -> list[torch.device]:
        return [torch.device("cuda", i) for i in self.gpus]

    def wrap(self, model: nn.Module) -> nn.Module:
        return nn.DataParallel(model, device_ids=self.gpus, output_device=self.gpus[0])


class DDPStrategy(Strategy):
    """DistributedDataParallel: one process per device, gradients all-reduced in buckets."""

    name = "ddp"
    reduces_gradients = True

    def __init__(
        self, ctx: ProcessContext, precision: Precision, setup: ModelSetup, options: DDPConfig, sync_bn: bool
    ) -> None:
        super().__init__(ctx, precision, setup)
        self.options = options
        self.sync_bn = sync_bn
        # Control flags travel on the CPU: a gloo group beside NCCL (gloo's default group serves).
        self.control_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None

    def convert(self, model: nn.Module) -> nn.Module:
        if not self.sync_bn:
            return model
        if self.ctx.device.type == "cuda":
            return nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return convert_global_batchnorm(model)

    def wrap(self, model: nn.Module) -> nn.Module:
        knobs = self.options
        # Newer torch renamed broadcast_buffers; pass the knob under whichever name it knows.
        buffers_kw = "forward_sync_buffers" if _DDP_HAS_FORWARD_SYNC else "broadcast_buffers"
        ddp = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None,
            bucket_cap_mb=knobs.bucket_cap_mb,
            static_graph=knobs.static_graph,
            gradient_as_bucket_view=knobs.gradient_as_bucket_view,
            find_unused_parameters=knobs.find_unused_parameters,
            **{buffers_kw: knobs.broadcast_buffers},
        )
        hook = comm_hook(knobs)
        if hook is not None:
            ddp.register_comm_hook(*hook)
        return ddp

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        return model.no_sync()  # type: ignore[operator]

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def start_max(self, value: int) -> Callable[[], int]:
        flag = torch.tensor([value], dtype=torch.int64)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control_group, async_op=True)

        def wait() -> int:
            work.wait()
            return int(flag.item())

        return wait


def comm_hook(knobs: DDPConfig) -> tuple[Any, Callable[..., Any]] | None:
    """(state, hook) for DDP.register_comm_hook from ddp.comm_hook; None keeps DDP's own all-reduce."""
    if knobs.comm_hook == "fp16":
        return None, default_hooks.fp16_compress_hook
    if knobs.comm_hook == "bf16":
        return None, default_hooks.bf16_compress_hook
    if knobs.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=knobs.powersgd_rank,
            start_powerSGD_iter=knobs.powersgd_start_step,
        )
        return state, powerSGD_hook.powerSGD_hook
    return None


def make_strategy(
    topology: Topology, ctx: ProcessContext, precision: Precision, setup: ModelSetup, ddp: DDPConfig, sync_bn: bool
) -> Strategy:
    """Build the strategy `topology.resolve` chose, with its options."""
    if topology.strategy == "dp":
        return DataParallelStrategy(ctx, precision, setup, topology.gpus)
    if topology.strategy == "ddp":
        return DDPStrategy(ctx, precision, setup, ddp, sync_bn)
    return Strategy(ctx, precision, setup)
