"""DistributedDataParallel (and ZeRO-1 beside it): every rank holds the whole model."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager as ContextManager
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer

from multicard.base.config import DDPConfig
from multicard.runtime.process_group import ProcessContext
from multicard.strategy.base import ModelSetup, Optimizers, StateDict
from multicard.strategy.collectives import DistributedStrategy
from multicard.strategy.optim import OptimizerRecipe
from multicard.strategy.precision import PassThrough, Precision

_DDP_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters


class DDPStrategy(DistributedStrategy):
    """DistributedDataParallel: one process per device, gradients all-reduced in buckets; with
    ddp.shard_optimizer, each rank keeps the optimizer state of its share of the parameters."""

    name = "ddp"
    reduces_gradients = True

    def __init__(
        self, ctx: ProcessContext, precision: Precision, setup: ModelSetup, options: DDPConfig, sync_bn: bool
    ) -> None:
        super().__init__(ctx, precision, setup, sync_bn)
        self.options = options
        self._optimizer_order: list[str] = []  # parameter names in the optimizer's index order (ZeRO-1)
        self._recipe: OptimizerRecipe | None = None  # what ZeRO-1 shards (for a template of the whole state)

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP around the model; a model with nothing to train (a frozen teacher) has no gradients
        to reduce and stays as it is (DDP refuses it)."""
        if not any(p.requires_grad for p in model.parameters()):
            return model
        knobs = self.options
        # Newer torch renamed broadcast_buffers; pass the knob under whichever name it knows.
        buffers_kw = "forward_sync_buffers" if _DDP_HAS_FORWARD_SYNC else "broadcast_buffers"
        ddp = DistributedDataParallel(
            model,
            device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None,
            bucket_cap_mb=knobs.bucket_cap_mb,
            static_graph=knobs.static_graph,
            gradient_as_bucket_view=knobs.gradient_as_bucket_view,
            find_unused_parameters=knobs.find_unused_parameters,
            **cast("dict[str, Any]", {buffers_kw: knobs.broadcast_buffers}),  # a bool, under either name
        )
        hook = comm_hook(knobs)
        if hook is not None:
            ddp.register_comm_hook(*hook)
        return ddp

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        # wrap()'s DDP: a model left unwrapped (nothing to train) has no gradients to hold back
        return cast(nn.parallel.DistributedDataParallel, model).no_sync()

    # ------------------------------------------------------------ ZeRO-1

    def make_optimizer(self, recipe: OptimizerRecipe, bare: nn.Module) -> torch.optim.Optimizer:
        if not self.options.shard_optimizer:
            return recipe.build()
        self._recipe = recipe
        names = {id(p): name for name, p in bare.named_parameters()}
        self._optimizer_order = [names[id(p)] for group in recipe.groups for p in group["params"]]
        return ZeroRedundancyOptimizer(recipe.groups, optimizer_class=recipe.cls, **recipe.kwargs)

    def state_dicts(
        self, bare: nn.Module, optimizer: Optimizers, whole: bool = False
    ) -> tuple[StateDict, StateDict]:
        """ZeRO-1: the whole optimizer state, gathered on rank 0 (empty elsewhere: rank 0 writes).
        Not `whole` (ZeRO-1 writes single files, so only as the template a sharded checkpoint of
        another strategy is read into): on every rank, the layout of the whole state, from a plain
        optimizer of the same recipe (its state made, as torch's get_state_dict makes it)."""
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            return super().state_dicts(bare, optimizer, whole)
        if not whole:
            assert self._recipe is not None
            return get_state_dict(bare, self._recipe.build())
        optimizer.consolidate_state_dict(to=0)
        names = dict(enumerate(self._optimizer_order))
        optim_state = rekeyed(optimizer.state_dict(), names) if self.ctx.is_main else {}
        return get_model_state_dict(bare), optim_state

    def load_state_dicts(
        self, bare: nn.Module, optimizer: Optimizers, model_state: StateDict, optim_state: StateDict
    ) -> None:
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            return super().load_state_dicts(bare, optimizer, model_state, optim_state)
        set_model_state_dict(bare, model_state)
        # Every rank reads the whole state and keeps its share (load_state_dict edits what it is given).
        index = {name: i for i, name in enumerate(self._optimizer_order)}
        optimizer.load_state_dict(rekeyed(copy.deepcopy(optim_state), index))
        return None


class DistributedDataParallel(PassThrough, nn.parallel.DistributedDataParallel):
    """torch's DDP, through which the wrapped module's own methods and attributes stay reachable."""


def rekeyed(state: StateDict, key: Mapping[Any, Any]) -> StateDict:
    """A torch.optim state dict with its parameters' keys mapped by `key`: index → parameter name (as
    get_state_dict keys it), or name → index for optimizers that load index-keyed state."""
    return {
        "state": {key[k]: v for k, v in state["state"].items()},
        "param_groups": [{**g, "params": [key[k] for k in g["params"]]} for g in state["param_groups"]],
    }


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
