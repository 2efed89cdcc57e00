"""The one training step, shared by the command line's classifier loop (trainer.Trainer) and a
user's own loop (multicard.Run).

A step is `grad_accum` micro-steps whose gradients are reduced on the last one only (the
strategy's no_sync on the others), the loss scaled for accumulation and for fp16, then clipping,
the optimizer and LR-scheduler step, the run's position and the graceful stop every rank agrees
on. This module is the one place a backward pass and an optimizer step are written.

The loop is stateful: `state_dict()` / `load_state_dict()` carry the model, optimizer,
scheduler, scaler, position and every rank's random streams, plus each component registered in
`components` (the weights' EMA, a user's own state): the one list of what a checkpoint holds.
Callbacks are told of the loop's events and receive the loop.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.nn as nn

from multicard.base.errors import Stopped
from multicard.engine.phases import BACKWARD, COMMUNICATION, IDLE, OPTIMIZER, REDUCING, PhaseClock, StepTimes
from multicard.runtime.stopping import GracefulStop

if TYPE_CHECKING:  # annotations only: the strategies import torch's sharding stack
    from multicard.engine.meters import EvalResult
    from multicard.strategy.base import Strategy

OPTIMIZER_KERNEL_KEYS = ("fused", "foreach")  # param-group entries that choose kernels, not maths


# ---------------------------------------------------------------- random streams as tensors
# Stored as tensors and plain Python values only, so checkpoints load with torch's safe
# (weights-only) unpickler.


def rng_state() -> dict[str, Any]:
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss, "gauss": gauss},
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(state["python"])


def own_streams(streams: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's random streams among every rank's saved: at the same world size each rank continues
    its own; otherwise rank 0's seed them all."""
    return streams[rank] if len(streams) == world_size else streams[0]


def load_keeping_kernels(
    strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer, model_state: Any, optim_state: Any
) -> None:
    """Load model and optimizer state. How this run computes the update (fused kernels or not) is
    its own choice, not the checkpoint's: a fused kernel saved by one strategy may not exist for
    another's tensors."""
    kernels = [{k: g[k] for k in OPTIMIZER_KERNEL_KEYS if k in g} for g in optimizer.param_groups]
    strategy.load_state_dicts(model, optimizer, model_state, optim_state)
    for group, keep in zip(optimizer.param_groups, kernels, strict=True):
        group.update(keep)


# ---------------------------------------------------------------- the loop's state and settings


@dataclass
class Position:
    """Where a run stands; saved in every checkpoint so a resumed run continues exactly."""

    epoch: int = 0  # the epoch in progress (or the next one, at an epoch boundary)
    step_in_epoch: int = 0  # optimizer steps of `epoch` already done
    global_step: int = 0
    best_top1: float = -1.0  # the best validation score so far (top-1, or a user loop's monitored value)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Position:
        """The position saved in `state` (which may hold more: the meter's epoch sums)."""
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})


@dataclass(frozen=True)
class Schedule:
    """The loop's fixed settings, derived once from the config (or a Run's arguments) and the data."""

    steps_per_epoch: int
    total_steps: int  # optimizer steps of the whole run (train.epochs, cut by train.max_steps)
    grad_accum: int = 1
    log_every: int = 50
    label_smoothing: float = 0.0
    clip_grad_norm: float = 0.0
    eval_flip: bool = False  # test-time flip in evaluation

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps of `epoch` in this run (the last one may be cut by train.max_steps)."""
        return max(0, min(self.steps_per_epoch, self.total_steps - epoch * self.steps_per_epoch))


class Stateful(Protocol):
    """A part of a checkpoint beside the model and optimizer (`whole`: gathered whole on rank 0)."""

    def state_dict(self, whole: bool = False) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class GradientWatch:
    """Marks the end of backward's compute: once the step's last gradient has been accumulated,
    what remains of backward is waiting for gradient communication.

    The parameters' hooks hold this object, which holds no model: no reference cycle keeps the
    model (and DDP's reducer with its process group) alive past the run.
    """

    def __init__(self, clock: PhaseClock, model: nn.Module) -> None:
        self.clock = clock
        params = [p for p in model.parameters() if p.requires_grad]
        self.count = len(params)
        self.pending = -1  # gradients still to come in this backward; 0 → communication
        for p in params:
            p.register_post_accumulate_grad_hook(self._arrived)

    def expect(self, synced: bool) -> None:
        """Before a backward: watch it if its gradients are reduced (the last micro-step)."""
        self.pending = self.count if synced else -1

    def _arrived(self, _: torch.Tensor) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.clock.enter(COMMUNICATION)


# ---------------------------------------------------------------- callbacks


@dataclass(frozen=True)
class StepEnd:
    """What callbacks learn after every optimizer step."""

    epoch: int
    global_step: int
    step_in_epoch: int
    last_in_epoch: bool  # the epoch's (or the run's) last step: an epoch end follows
    times: StepTimes
    stop_signal: int  # nonzero: every rank stops after this step


class Callback:
    """Hooks into a run's loop; every rank calls them at the same points. Override what you need."""

    def on_fit_start(self, loop: Loop) -> None: ...

    def on_gradients(self, loop: Loop) -> None:
        """The step's gradients are reduced and about to be applied (before clipping and the optimizer)."""

    def on_step_end(self, loop: Loop, step: StepEnd) -> None: ...

    def on_log(self, loop: Loop, record: dict[str, Any]) -> None:
        """A step record with statistics reduced over ranks, every log_every steps."""

    def on_epoch_end(self, loop: Loop, record: dict[str, Any], val: EvalResult | None, best: bool) -> None: ...

    def on_stop(self, loop: Loop, stop: Stopped) -> None:
        """Every rank agreed to stop after this step; `stop` is raised after the callbacks."""

    def on_fit_end(self, loop: Loop) -> None: ...


class Hooks:
    """A run's callbacks as one: `hooks.on_log(loop, record)` calls each callback's on_log, in order."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)

    def __getattr__(self, hook: str) -> Callable[..., None]:
        def call(*args: Any) -> None:
            for cb in self.callbacks:
                getattr(cb, hook)(*args)

        return call


# ---------------------------------------------------------------- the loop


class Loop:
    """The model, optimizer, scheduler and scaler of one run, its position, and the one step."""

    def __init__(self, strategy: Strategy, schedule: Schedule, stop: GracefulStop | None = None) -> None:
        self.strategy = strategy
        self.schedule = schedule
        self.stop = stop
        self.scaler = strategy.precision.grad_scaler()
        self.position = Position()
        self.clock = PhaseClock(strategy.ctx.device)
        self.hooks = Hooks([])
        self.model: nn.Module | None = None  # as the strategy wrapped it: what forward runs through
        self.bare: nn.Module | None = None  # parameters, checkpoints and evaluation
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None  # an LR scheduler (anything with step() and a state dict), or None
        self.components: dict[str, Stateful] = {}  # saved under their names (the EMA, a user's state)
        self.position_state: list[Stateful] = []  # saved inside the position (the meter's epoch sums)
        self.ending: BaseException | None = None  # what ended training, for on_fit_end (None: it completed)
        self._gradients: GradientWatch | None = None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any = None) -> None:
        """The model as the strategy prepared it, and what steps it."""
        self.model, self.bare = model, self.strategy.unwrap(model)
        self.optimizer, self.scheduler = optimizer, scheduler
        if self.strategy.reduces_gradients:
            self._gradients = GradientWatch(self.clock, self.bare)

    @property
    def finished(self) -> bool:
        return self.position.global_step >= self.schedule.total_steps

    @property
    def phase(self) -> str:
        """What this rank is doing now (read by the stall watchdog from another thread)."""
        return self.clock.phase

    def set_phase(self, phase: str) -> None:
        """Work between steps (evaluation, checkpoints) says so here."""
        self.clock.set_phase(phase)

    # ------------------------------------------------------------ the step

    @contextmanager
    def micro_step(self, micro: int) -> Iterator[None]:
        """Micro-step `micro` of the step: its gradients are reduced only if it is the last one (the
        forward too runs inside the strategy's no_sync: DDP decides there)."""
        sync = micro == self.schedule.grad_accum - 1
        with nullcontext() if sync else self.strategy.no_sync(self.model):  # type: ignore[arg-type]
            if self._gradients is not None:
                self._gradients.expect(sync)
            yield

    def backpropagate(self, loss: torch.Tensor) -> None:
        """The gradients of one micro-step's mean loss, as a share of the global batch's (the one
        backward pass of multicard: train, a user's loop, and every tool that times a step)."""
        self.clock.enter(BACKWARD)
        self.scaler.scale(loss / self.schedule.grad_accum).backward()

    def optimizer_step(self) -> None:
        """Apply the step's gradients (reduced by now): clip, step (skipped by the fp16 scaler on
        NaN/inf), zero them, advance the LR schedule."""
        assert self.optimizer is not None and self.model is not None
        self.clock.enter(OPTIMIZER)
        self.hooks.on_gradients(self)
        if self.schedule.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.schedule.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def count_step(self) -> None:
        self.position.global_step += 1
        self.position.step_in_epoch += 1

    def end_step(self) -> tuple[StepTimes, int]:
        """The step's phase times, and the signal every rank agreed to stop on after it (0: none)."""
        times = self.clock.end_step()
        if self.stop is None:
            return times, 0
        self.clock.set_phase(REDUCING)
        signum = self.stop.poll()
        self.clock.set_phase(IDLE)
        return times, signum

    # ------------------------------------------------------------ state

    def state_dict(self, whole: bool = False) -> dict[str, Any]:
        """Everything a checkpoint holds. A collective: every rank calls it at the same step. Model
        and optimizer state are keyed by parameter name, as the strategy holds them (sharded under
        fsdp), or with `whole`, gathered whole on rank 0."""
        assert self.bare is not None and self.optimizer is not None
        position = asdict(self.position)
        for part in self.position_state:
            position.update(part.state_dict(whole))
        self.strategy.agree_buffers(self.bare)
        model_state, optim_state = self.strategy.state_dicts(self.bare, self.optimizer, whole)
        state = {
            "model": model_state,
            "optimizer": optim_state,
            "scaler": self.scaler.state_dict(),
            "position": position,
            "rng": self.strategy.all_gather_object(rng_state()),
            **({"scheduler": self.scheduler.state_dict()} if self.scheduler is not None else {}),
        }
        return state | {name: part.state_dict(whole) for name, part in self.components.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (any strategy and world size that keep this global batch). A part
        this run has no component for (yet) is left; a component the state lacks starts afresh."""
        assert self.bare is not None and self.optimizer is not None
        load_keeping_kernels(self.strategy, self.bare, self.optimizer, state["model"], state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.position = Position.from_state(state["position"])
        for part in self.position_state:
            part.load_state_dict(state["position"])
        set_rng_state(own_streams(state["rng"], self.strategy.ctx.rank, self.strategy.ctx.world_size))
        for name, part in self.components.items():
            if name in state:
                part.load_state_dict(state[name])
