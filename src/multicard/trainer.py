"""The training loop and exact evaluation: the one place a training step is written.

`Trainer.fit` runs optimizer steps until a given step, evaluates at epoch ends and tells its
callbacks what happened (step end with the step's phase times, log records, epoch ends, a
stop). Checkpointing, telemetry, benchmarks and checks are callbacks; none of them steps the
model itself. The trainer is stateful: `state_dict()` / `load_state_dict()` carry the model,
optimizer, scheduler, scaler, position and every rank's random streams.

Host syncs happen only at log intervals, epoch ends and saves: per-step statistics stay on the
device until then, in the loop's meter (multicard.meters), which also writes the step and epoch
records. Every control-flow decision (NaN stop, best epoch, graceful stop) is taken
from values reduced across ranks, so all ranks decide alike.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from multicard.data.loaders import Batch, EvalLoader, TrainLoader
from multicard.data.mixing import StepMix
from multicard.ema import WeightAverage
from multicard.errors import Stopped, TrainingDiverged
from multicard.meters import EvalResult, TrainMeter
from multicard.meters import peak_memory_mb as peak_memory_mb  # re-exported: its users import it from here
from multicard.phases import (
    BACKWARD,
    COMMUNICATION,
    DATA,
    EVALUATION,
    FORWARD,
    IDLE,
    OPTIMIZER,
    REDUCING,
    PhaseClock,
    StepTimes,
)
from multicard.precision import Precision
from multicard.stopping import GracefulStop

if TYPE_CHECKING:  # annotations only: the strategies import torch's sharding stack
    from multicard.strategy import Strategy

OPTIMIZER_KERNEL_KEYS = ("fused", "foreach")  # param-group entries that choose kernels, not maths


def logits_for_loss(out: torch.Tensor) -> torch.Tensor:
    # Reduced-precision logits are upcast so the loss and its statistics are computed in fp32.
    return out if out.dtype in (torch.float32, torch.float64) else out.float()


def prepare_input(x: torch.Tensor, precision: Precision, channels_last: bool) -> torch.Tensor:
    if precision.param_dtype != torch.float32:
        x = x.to(precision.param_dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: Iterable[Batch], strategy: Strategy, progress: Callable[[], None] = lambda: None,
    flip: bool = False,
) -> EvalResult:  # fmt: skip
    """Exact metrics: each rank sums (loss, correct@1, correct@5, count) over its own share,
    then the sums are reduced. No sample is padded or counted twice. `progress` is told of each
    batch. With `flip` (eval_flip), the logits are the mean of each image's and its mirror's."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=strategy.ctx.device)
    for x, y in batches:
        x = prepare_input(x, strategy.precision, strategy.setup.channels_last)
        with strategy.precision.autocast():
            logits = logits_for_loss(model(x))
            if flip:
                logits = (logits + logits_for_loss(model(x.flip(-1)))) / 2
        k = min(5, logits.shape[1])
        hits = logits.topk(k, dim=1).indices == y.view(-1, 1)
        totals[0] += F.cross_entropy(logits, y, reduction="sum").double()
        totals[1] += hits[:, 0].sum()
        totals[2] += hits.any(dim=1).sum()
        totals[3] += y.numel()
        progress()
    strategy.all_reduce_sum(totals)
    loss_sum, c1, c5, n = totals.tolist()
    model.train(was_training)
    if n == 0:
        return EvalResult(loss=float("nan"), top1=0.0, top5=0.0, samples=0)
    return EvalResult(loss=loss_sum / n, top1=100 * c1 / n, top5=100 * c5 / n, samples=int(n))


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


def own_streams(streams: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's random streams among every rank's saved: at the same world size each rank continues
    its own; otherwise rank 0's seed them all."""
    return streams[rank] if len(streams) == world_size else streams[0]


# ---------------------------------------------------------------- the loop's state and settings


@dataclass
class Position:
    """Where a run stands; saved in every checkpoint (with the meter's epoch sums) so a resumed
    run continues exactly."""

    epoch: int = 0  # the epoch in progress (or the next one, at an epoch boundary)
    step_in_epoch: int = 0  # optimizer steps of `epoch` already done
    global_step: int = 0
    best_top1: float = -1.0

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Position:
        """The position saved in `state` (which holds the meter's epoch sums too)."""
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})


@dataclass(frozen=True)
class Schedule:
    """The loop's fixed settings, derived once from the config and the data."""

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
    """Hooks into `Trainer.fit`; every rank calls them at the same points. Override what you need."""

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def on_gradients(self, trainer: Trainer) -> None:
        """The step's gradients are reduced and about to be applied (before clipping and the optimizer)."""

    def on_step_end(self, trainer: Trainer, step: StepEnd) -> None: ...

    def on_log(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """A step record with statistics reduced over ranks, every log_every steps."""

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any], val: EvalResult | None, best: bool) -> None: ...

    def on_stop(self, trainer: Trainer, stop: Stopped) -> None:
        """Every rank agreed to stop after this step; `stop` is raised after the callbacks."""

    def on_fit_end(self, trainer: Trainer) -> None: ...


class Hooks:
    """A run's callbacks as one: `hooks.on_log(trainer, record)` calls each callback's on_log, in order."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)

    def __getattr__(self, hook: str) -> Callable[..., None]:
        def call(*args: Any) -> None:
            for cb in self.callbacks:
                getattr(cb, hook)(*args)

        return call


class Trainer:
    """Owns the model, optimizer, schedule and scaler of one run, and trains them."""

    def __init__(
        self,
        strategy: Strategy,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        train_loader: TrainLoader,
        val_loader: EvalLoader | None,
        schedule: Schedule,
        stop: GracefulStop | None = None,
        mix: StepMix | None = None,
        ema: WeightAverage | None = None,
    ) -> None:
        self.strategy = strategy
        self.model = model  # as the strategy wrapped it: what forward runs through
        self.bare = strategy.unwrap(model)  # parameters, checkpoints and evaluation
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = strategy.precision.grad_scaler()
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.schedule = schedule
        self.stop = stop
        self.mix, self.ema = mix, ema  # mixup/CutMix before the forward; the weights' EMA after each step
        self.position = Position()
        self.clock = PhaseClock(strategy.ctx.device)
        self.meter = TrainMeter(strategy, self.clock)  # the steps' statistics and records
        self._gradients = GradientWatch(self.clock, self.bare) if strategy.reduces_gradients else None

    # ------------------------------------------------------------ state

    @property
    def finished(self) -> bool:
        return self.position.global_step >= self.schedule.total_steps

    @property
    def phase(self) -> str:
        """What this rank is doing now (read by the stall watchdog from another thread)."""
        return self.clock.phase

    def set_phase(self, phase: str) -> None:
        """Callbacks that do long work between steps (checkpoints) say so here."""
        self.clock.set_phase(phase)

    def state_dict(self, whole: bool = False) -> dict[str, Any]:
        """Model, optimizer, scheduler, scaler, position and every rank's random streams.

        A collective: every rank calls it at the same step. Model and optimizer state are keyed
        by parameter name, as the strategy holds them (sharded under fsdp), or with `whole`,
        gathered whole on rank 0.
        """
        self._reduce_statistics()  # the epoch's sums saved must include every step done
        self.strategy.agree_buffers(self.bare)
        model_state, optim_state = self.strategy.state_dicts(self.bare, self.optimizer, whole)
        return {
            "model": model_state,
            "optimizer": optim_state,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "position": asdict(self.position) | self.meter.state_dict(),
            "rng": self.strategy.all_gather_object(rng_state()),
            **({"ema": self.ema.state_dict(self.bare, whole)} if self.ema is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (any strategy and world size that keep this global batch)."""
        load_keeping_kernels(self.strategy, self.bare, self.optimizer, state["model"], state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.position = Position.from_state(state["position"])
        self.meter.load_state_dict(state["position"])
        set_rng_state(own_streams(state["rng"], self.strategy.ctx.rank, self.strategy.ctx.world_size))
        if self.ema is not None and "ema" in state:  # else it starts from these weights
            self.ema.load_state_dict(state["ema"], self.bare)

    # ------------------------------------------------------------ training

    def fit(
        self, callbacks: Sequence[Callback] = (), until: int | None = None, validate: bool = True
    ) -> EvalResult | None:
        """Train to optimizer step `until` (default: the end of the run), evaluating and telling
        the callbacks at each epoch end. Raises Stopped when the ranks agree on a signal."""
        end = min(until, self.schedule.total_steps) if until is not None else self.schedule.total_steps
        result = None
        hooks = Hooks(callbacks)
        hooks.on_fit_start(self)
        try:
            while True:
                pos = self.position
                steps = self.schedule.steps_in_epoch(pos.epoch)
                last = min(steps, end - pos.epoch * self.schedule.steps_per_epoch)
                stopped = self._train_epoch(last, hooks)
                complete = 0 < steps <= self.position.step_in_epoch
                if complete:  # a stop on an epoch's last step still evaluates and saves the epoch first
                    result = self._end_epoch(steps, hooks, validate)
                if stopped is not None:
                    hooks.on_stop(self, stopped)
                    raise stopped
                if not complete or self.position.global_step >= end:
                    break
        finally:
            hooks.on_fit_end(self)
        return result

    def _train_epoch(self, last: int, hooks: Hooks) -> Stopped | None:
        """Steps of the current epoch up to step `last`; the agreed stop, if one came."""
        pos = self.position
        self.meter.start_epoch()
        if pos.step_in_epoch >= last:
            return None
        self.model.train()
        self.train_loader.set_epoch(pos.epoch, pos.step_in_epoch)
        batches = iter(self.train_loader)
        steps = self.schedule.steps_in_epoch(pos.epoch)
        stopped = None
        while pos.step_in_epoch < last and stopped is None:
            self._step(batches, hooks)
            pos.global_step += 1
            pos.step_in_epoch += 1
            if self.ema is not None:
                self.ema.update(self.bare, pos.global_step)
            times = self.clock.end_step()
            self.meter.add_step(times)
            signum = self._poll_signal()
            ends_epoch = pos.step_in_epoch == steps
            if pos.global_step % self.schedule.log_every == 0 or ends_epoch or signum:
                self._reduce_statistics()
                record = self.meter.step_record(pos.epoch, pos.global_step, self.optimizer.param_groups[0]["lr"])
                hooks.on_log(self, record)
            info = StepEnd(pos.epoch, pos.global_step, pos.step_in_epoch, ends_epoch, times, signum)
            hooks.on_step_end(self, info)
            stopped = Stopped(signum, pos.global_step) if signum else None
        self.meter.end_training()
        return stopped

    def _step(self, batches: Iterator[Batch], hooks: Hooks) -> None:
        """One optimizer step: grad_accum micro-steps, gradients reduced on the last one only."""
        sched, strategy, clock, model, pos = self.schedule, self.strategy, self.clock, self.model, self.position
        accum = sched.grad_accum
        for micro in range(accum):
            clock.enter(DATA)
            x, y = next(batches)
            x, target = self.mix(x, y, pos.epoch, pos.step_in_epoch, micro) if self.mix is not None else (x, y)
            x = prepare_input(x, strategy.precision, strategy.setup.channels_last)
            sync = micro == accum - 1
            clock.enter(FORWARD)
            with nullcontext() if sync else strategy.no_sync(model):
                logits = logits_for_loss(model(x))
                loss = F.cross_entropy(logits, target, label_smoothing=sched.label_smoothing)
                clock.enter(BACKWARD)
                if self._gradients is not None:
                    self._gradients.expect(sync)
                self.scaler.scale(loss / accum).backward()
            self.meter.add(loss, logits, target)  # under mixing: scored against the mixed targets
        clock.enter(OPTIMIZER)
        hooks.on_gradients(self)
        if sched.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), sched.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _poll_signal(self) -> int:
        """The signal every rank agreed to stop on after this step (0: none)."""
        if self.stop is None:
            return 0
        self.clock.set_phase(REDUCING)
        signum = self.stop.poll()
        self.clock.set_phase(IDLE)
        return signum

    def _reduce_statistics(self) -> None:
        """Reduce the steps' statistics over ranks (one host sync). A NaN/inf loss on any rank
        stops every rank, except under the fp16 scaler, which skips those steps."""
        if self.meter.reduce() and not self.scaler.is_enabled():
            raise TrainingDiverged(
                f"loss is NaN/inf at step {self.position.global_step}; lower optim.lr, "
                f"set clip_grad_norm, or use precision=fp32 (the last good checkpoint is kept)"
            )

    def _end_epoch(self, steps: int, hooks: Hooks, validate: bool) -> EvalResult | None:
        """Evaluate, report, advance the position past a complete epoch, tell the callbacks."""
        pos = self.position
        self.set_phase(EVALUATION)
        val, averaged = validation(self) if validate and self.val_loader is not None else (None, None)
        self.set_phase(IDLE)
        lr = self.optimizer.param_groups[0]["lr"]
        record = self.meter.epoch_record(pos.epoch, pos.global_step, lr, val, averaged)
        best = val is not None and val.top1 > pos.best_top1  # reduced metrics: every rank decides alike
        pos.best_top1 = max(pos.best_top1, val.top1) if val is not None else pos.best_top1
        if steps == self.schedule.steps_per_epoch:  # else train.max_steps cut the epoch short
            self.position = Position(pos.epoch + 1, 0, pos.global_step, pos.best_top1)
            self.meter.new_epoch()
        hooks.on_epoch_end(self, record, val, best)
        return val

def validation(trainer: Trainer) -> tuple[EvalResult, EvalResult | None]:
    """The epoch's validation of the model, and of its weights' EMA where the run keeps one (with
    the average swapped in, and rank 0's BatchNorm statistics of it, as checkpoints keep them)."""
    assert trainer.val_loader is not None

    def run() -> EvalResult:
        trainer.strategy.agree_buffers(trainer.bare)  # the statistics the epoch's checkpoint holds
        loader, strategy, flip = trainer.val_loader, trainer.strategy, trainer.schedule.eval_flip
        return evaluate(trainer.bare, loader, strategy, trainer.clock.tick, flip)  # type: ignore[arg-type]

    if trainer.ema is None:
        return run(), None
    own = run()
    with trainer.ema.swapped_in(trainer.bare):
        return own, run()
