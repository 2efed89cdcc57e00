"""Optimizer and per-iteration learning-rate schedule, with an explicit LR scaling rule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from multicard.base.config import OptimConfig, SchedConfig

OPTIMIZER_KERNEL_KEYS = ("fused", "foreach")  # param-group entries that choose kernels, not maths


def scaled_lr(o: OptimConfig, global_batch: int) -> float:
    """Peak LR: optim.lr × (global batch / base batch)^p, p = 0 (none), 1 (linear), 1/2 (sqrt)."""
    power = {"none": 0.0, "linear": 1.0, "sqrt": 0.5}[o.lr_scaling]
    return o.lr * (global_batch / o.base_batch_size) ** power


def _param_groups(model: nn.Module, weight_decay: float, decay_1d: bool) -> list[dict]:
    """No weight decay on biases and normalisation weights (1-D parameters) unless decay_1d."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 and not decay_1d else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@dataclass(frozen=True)
class OptimizerRecipe:
    """What to build: the class, its parameter groups and arguments (strategies may wrap it: ZeRO-1)."""

    cls: type[torch.optim.Optimizer]
    groups: list[dict]
    kwargs: dict[str, Any]

    def build(self) -> torch.optim.Optimizer:
        return self.cls(self.groups, **self.kwargs)


def optimizer_recipe(model: nn.Module, o: OptimConfig, global_batch: int) -> OptimizerRecipe:
    groups = _param_groups(model, o.weight_decay, o.decay_bias_and_norm)
    fused = {"fused": True} if o.fused and _fused_supported(model, o.name) else {}
    lr = scaled_lr(o, global_batch)
    if o.name == "adamw":
        return OptimizerRecipe(torch.optim.AdamW, groups, {"lr": lr, "betas": tuple(o.betas), **fused})
    nesterov = o.nesterov and o.momentum > 0
    return OptimizerRecipe(torch.optim.SGD, groups, {"lr": lr, "momentum": o.momentum, "nesterov": nesterov, **fused})


def _fused_supported(model: nn.Module, name: str) -> bool:
    """Fused SGD/AdamW kernels exist for floating parameters on CPU (torch >= 2.4) and CUDA;
    for sharded (DTensor) parameters only AdamW's has a sharding rule (fused SGD raises).

    On our 2-core CPUs the fused SGD step of resnet18 takes ~4 ms against ~16 ms for the
    per-tensor-list (foreach) one: it reads and writes each parameter once. Under fsdp×2 the
    fused AdamW step of 12 ViT-sized blocks takes 30 ms against 70 ms for the per-tensor loop.
    """
    params = list(model.parameters())
    devices = {p.device.type for p in params}
    floating = all(p.is_floating_point() for p in params)
    sharded_ok = fused_on_shards(name) or not any(isinstance(p, DTensor) for p in params)
    return bool(params) and devices <= {"cpu", "cuda"} and floating and sharded_ok


def fused_on_shards(name: str) -> bool:
    """Whether optimizer `name` has a fused kernel for sharded (DTensor) parameters."""
    return name == "adamw"


def lr_factor(step: int, total_steps: int, warmup_steps: int, steps_per_epoch: int, s: SchedConfig) -> float:
    """Multiplier of the peak LR before optimizer step `step` (0-based). With sched.per_epoch the
    rule is read at the epoch's first step and held for the epoch, as schedulers stepped once an
    epoch do (torchvision's reference scripts): warm-up epoch e of W then gives start + (1 - start) × e/W."""
    start = s.warmup_start
    if s.per_epoch:
        epoch, epochs, warmup = step // steps_per_epoch, max(1, total_steps // steps_per_epoch), round(s.warmup_epochs)
        if epoch < warmup:
            return start + (1 - start) * epoch / warmup
        return _after_warmup(epoch - warmup, epochs - warmup, epoch, s)
    if step < warmup_steps:
        return start + (1 - start) * (step + 1) / warmup_steps
    return _after_warmup(step - warmup_steps, total_steps - warmup_steps, step // steps_per_epoch, s)


def _after_warmup(done: int, span: int, epoch: int, s: SchedConfig) -> float:
    """The schedule's multiplier `done` steps (or epochs) into its `span` after the warm-up."""
    if s.name == "constant":
        return 1.0
    if s.name == "step":
        return s.gamma ** (epoch // s.step_epochs)
    progress = min(1.0, done / max(1, span))
    shape = 1 - progress if s.name == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return s.final_lr_ratio + (1 - s.final_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, s: SchedConfig, total_steps: int, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = round(s.warmup_epochs * steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warmup, steps_per_epoch, s)
    )
