"""The sections of what is trained and how: model, train, ema, optim and sched, each with its rules."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from multicard.base.config.rules import choice, positive, within
from multicard.base.errors import UserError

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("cosine", "linear", "step", "constant")
LR_SCALING = ("none", "linear", "sqrt")


@dataclass(frozen=True)
class ModelConfig:
    name: str = "resnet18"  # torchvision name, resnet18_cifar, smallcnn, or package.module:function
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments for the builder
    channels_last: bool = False
    # Initial weights (fine-tuning): a multicard checkpoint or a state dict file; tensors load by name
    # where shapes agree, the rest keep their initialisation. A resumed run takes its checkpoint's instead.
    weights: str | None = None


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 10
    max_steps: int = 0  # stop after this many optimizer steps in total; 0 = no limit
    global_batch_size: int = 256  # samples per optimizer step, across all devices and micro-steps
    grad_accum: int = 1  # micro-steps per optimizer step
    label_smoothing: float = 0.0  # training loss only; evaluation reports plain cross-entropy
    resume: str = "auto"  # auto: continue from out_dir's newest valid checkpoint | never | PATH

    def check(self) -> None:
        positive(self.global_batch_size, "train.global_batch_size")
        positive(self.grad_accum, "train.grad_accum")
        positive(self.epochs, "train.epochs")
        positive(self.max_steps, "train.max_steps", zero_ok=True)
        if not 0 <= self.label_smoothing < 1:
            raise UserError(f"train.label_smoothing={self.label_smoothing} must be in [0, 1)")
        if self.global_batch_size % self.grad_accum:
            raise UserError(
                f"train.global_batch_size={self.global_batch_size} is not divisible by "
                f"train.grad_accum={self.grad_accum}; change one of them"
            )

    def run_length(self, steps_per_epoch: int) -> int:
        """Optimizer steps of the whole run: train.epochs, cut short by train.max_steps if set."""
        steps = self.epochs * steps_per_epoch
        return min(steps, self.max_steps) if self.max_steps else steps

    def micro_batch(self, world_size: int) -> int:
        """Samples one process handles in one micro-step, or why the global batch does not split."""
        return micro_batch(self.global_batch_size, self.grad_accum, world_size)


def check_world_sizes(global_batch: int, grad_accum: int, world_sizes: list[int], nodes: str) -> None:
    """An elastic job (--nnodes MIN:MAX) keeps its global batch at every size it may run at: each
    must split it, or the job is refused before it starts, in one line naming a batch that fits all."""
    if all(global_batch % (size * grad_accum) == 0 for size in world_sizes):
        return
    per_step = math.lcm(*(size * grad_accum for size in world_sizes))
    lo = (global_batch // per_step) * per_step or per_step
    raise UserError(
        f"train.global_batch_size={global_batch} does not split over every world size --nnodes {nodes} allows "
        f"({', '.join(map(str, world_sizes))} processes) × train.grad_accum={grad_accum}; "
        f"use a multiple of {per_step} such as {lo} or {lo + per_step}"
    )


def micro_batch(global_batch: int, grad_accum: int, world_size: int) -> int:
    """global batch = micro-batch × processes × micro-steps: the one rule (data/loading/sampling.py's
    BatchSplit derives its micro-batch here)."""
    per_step = world_size * grad_accum
    if global_batch % per_step:
        lo = (global_batch // per_step) * per_step or per_step
        raise UserError(
            f"train.global_batch_size={global_batch} is not divisible by "
            f"{world_size} process(es) × train.grad_accum={grad_accum}; "
            f"use a multiple of {per_step} such as {lo} or {lo + per_step}"
        )
    return global_batch // per_step


@dataclass(frozen=True)
class EMAConfig:
    """An exponential moving average of the weights (ema.py), validated beside the model and kept in
    checkpoints; `multicard eval --ema` and `multicard export --ema` use it."""

    decay: float = 0.0  # weight of the old average at each update; 0 = off
    every: int = 1  # optimizer steps between updates
    start_epoch: float = 0.0  # until then an update copies the model (torchvision's recipes: the warm-up)

    def check(self) -> None:
        within(self.decay, "ema.decay", 0, 1)
        positive(self.every, "ema.every")
        positive(self.start_epoch, "ema.start_epoch", zero_ok=True)


@dataclass(frozen=True)
class OptimConfig:
    name: str = "sgd"
    lr: float = 0.1  # peak learning rate at base_batch_size (see lr_scaling)
    lr_scaling: str = "none"  # none | linear | sqrt: lr × (global_batch_size / base_batch_size)^p
    base_batch_size: int = 256
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    decay_bias_and_norm: bool = False  # also decay 1-D parameters (biases, norm weights), as older recipes do
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw
    fused: bool = True  # one fused kernel per step where torch has it (same update, far less memory traffic)

    def check(self) -> None:
        choice(self.name, "optim.name", OPTIMIZERS)
        choice(self.lr_scaling, "optim.lr_scaling", LR_SCALING)
        positive(self.lr, "optim.lr")
        positive(self.base_batch_size, "optim.base_batch_size")
        positive(self.weight_decay, "optim.weight_decay", zero_ok=True)
        within(self.momentum, "optim.momentum", 0, 1)
        for i, beta in enumerate(self.betas):
            within(beta, f"optim.betas[{i}]", 0, 1)
        if len(self.betas) != 2:
            raise UserError("optim.betas needs 2 values, e.g. optim.betas=[0.9,0.999]")


@dataclass(frozen=True)
class SchedConfig:
    name: str = "cosine"  # cosine | linear (to final_lr_ratio) | step | constant, after the warm-up
    warmup_epochs: float = 0.0  # linear warm-up from 0, counted in (fractional) epochs
    warmup_start: float = 0.0  # the warm-up's first lr as a fraction of the peak (torchvision's recipes: 0.01)
    per_epoch: bool = False  # the lr changes once an epoch (torchvision's reference scripts), not every step
    final_lr_ratio: float = 0.0  # cosine, linear: last lr as a fraction of the peak
    step_epochs: int = 30  # step: decay every this many epochs
    gamma: float = 0.1  # step: decay factor

    def check(self) -> None:
        """The schedule's name; the warm-up's start and the schedule's floor, as fractions of the peak
        lr; the epochs' counts."""
        choice(self.name, "sched.name", SCHEDULES)
        within(self.warmup_start, "sched.warmup_start", 0, 1)
        within(self.final_lr_ratio, "sched.final_lr_ratio", 0, 1, hi_open=False)
        positive(self.warmup_epochs, "sched.warmup_epochs", zero_ok=True)
        positive(self.step_epochs, "sched.step_epochs")
