"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over ranks.

ZeRO-3 (fsdp.reshard_after_forward=true) gathers each unit's parameters for its forward and
again for its backward; ZeRO-2 keeps them from forward to backward. HSDP (fsdp.replicate=nodes)
shards inside a node and replicates across nodes on a 2-D device mesh.

Precision maps to FSDP's MixedPrecisionPolicy instead of autocast: bf16/fp16 gather and compute
with parameters in that dtype, reduce gradients in fp32, and keep fp32 master parameters and
optimizer state. BatchNorm layers keep fp32 parameters (units of their own), as autocast would.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from multicard.base.config import FSDPConfig
from multicard.base.malloc import release_large_buffers, wants_release
from multicard.runtime.process_group import ProcessContext
from multicard.strategy.base import ModelSetup, Optimizers, StateDict
from multicard.strategy.collectives import DistributedStrategy, broadcast_buffers
from multicard.strategy.compilation import compile_in_place
from multicard.strategy.fsdp_units import choose_units
from multicard.strategy.precision import Precision

REDUCED = {"bf16": torch.bfloat16, "fp16": torch.float16}


class FSDPStrategy(DistributedStrategy):
    name = "fsdp"
    checkpoint_format = "sharded"  # one shard per rank, written in parallel

    def __init__(
        self,
        ctx: ProcessContext,
        precision: Precision,
        setup: ModelSetup,
        options: FSDPConfig,
        sync_bn: bool,
        model_name: str,
    ) -> None:
        super().__init__(ctx, precision, setup, sync_bn)
        self.options = options
        self.model_name = model_name
        if ctx.device.type == "cpu" and wants_release(options.cpu_release_memory):
            release_large_buffers()  # before the model is built: see malloc.py

    def mesh(self) -> DeviceMesh:
        ctx = self.ctx
        if self.options.replicate == "nodes":
            nodes = ctx.world_size // ctx.local_world_size
            shape, names = (nodes, ctx.local_world_size), ("replicate", "shard")
            return init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
        return init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("shard",))

    def prepare(self, model: nn.Module) -> nn.Module:
        """Place, convert, shard each unit then the root, compile: one model object throughout
        (fully_shard turns it into a sharded module in place; no wrapper, no prefix)."""
        model = model.to(self.ctx.device, dtype=self.precision.param_dtype)
        if self.setup.channels_last:
            model = model.to(memory_format=torch.channels_last)
        model = self.convert(model)
        shard: dict[str, Any] = {  # fully_shard's keyword arguments
            "mesh": self.mesh(), "reshard_after_forward": self.options.reshard_after_forward, "mp_policy": self.policy()
        }
        if self.precision.name in REDUCED:
            fp32 = MixedPrecisionPolicy(torch.float32, torch.float32, output_dtype=REDUCED[self.precision.name])
            for norm in (m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)):
                fully_shard(norm, **{**shard, "mp_policy": fp32})
        for unit in choose_units(model, self.options, self.model_name):
            fully_shard(unit, **shard)
        fully_shard(model, **shard)
        if not self.sync_bn and self.ctx.world_size > 1 and any(True for _ in model.buffers()):
            model.register_forward_pre_hook(_sync_buffers)
        if self.setup.compile_mode is not None:
            # Static shapes: blocks of one class but different widths share a forward, and dynamic
            # shapes fail to compile under FSDP's hooks.
            compile_in_place(model, self.setup.compile_mode, dynamic=False)
        return model

    def policy(self) -> MixedPrecisionPolicy:
        dtype = REDUCED.get(self.precision.name)
        if dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        sharded = cast(FSDPModule, model)  # prepare() made it one: fully_shard turns the module itself into one
        sharded.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            sharded.set_requires_gradient_sync(True)

    def state_dicts(
        self, bare: nn.Module, optimizer: Optimizers, whole: bool = False
    ) -> tuple[StateDict, StateDict]:
        """Sharded state (DTensors) for a sharded checkpoint; with `whole`, gathered to CPU on rank 0."""
        if not whole:
            return super().state_dicts(bare, optimizer)
        return get_state_dict(bare, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_state_dicts(
        self, bare: nn.Module, optimizer: Optimizers, model_state: StateDict, optim_state: StateDict
    ) -> None:
        """Sharded state (a sharded checkpoint, read into this layout) loads as it is; whole tensors
        (a single-file checkpoint) are sharded on the way in."""
        if any(isinstance(v, DTensor) for v in model_state.values()):
            return super().load_state_dicts(bare, optimizer, model_state, optim_state)
        whole = StateDictOptions(full_state_dict=True)
        # Two calls, not set_state_dict: its broadcast_from_rank0 path deadlocks when ranks differ.
        set_model_state_dict(bare, model_state, options=whole)
        if optimizer:  # [] : the model's state alone (a model of the run that no optimizer steps)
            set_optimizer_state_dict(bare, optimizer, optim_state, options=whole)
        return None


def _sync_buffers(module: nn.Module, args: Any) -> None:
    """BatchNorm running statistics: rank 0's on every rank before each training forward, as DDP
    does (FSDP shards parameters only; buffers would otherwise drift apart)."""
    if module.training:
        broadcast_buffers(list(module.buffers()))
