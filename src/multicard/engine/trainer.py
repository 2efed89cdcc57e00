"""The command line's training loop for classifiers, and exact evaluation.

`Trainer.fit` runs optimizer steps until a given step, evaluates at epoch ends and tells its
callbacks what happened (step end with the step's phase times, log records, epoch ends, a
stop). Checkpointing, telemetry, benchmarks and checks are callbacks; none of them steps the
model itself. Each step goes through the run's `Loop` (multicard.engine.loop), the one implementation
of a training step that a user's own loop (multicard.Run) uses too; the loop is stateful and
is what callbacks receive.

Host syncs happen only at log intervals, epoch ends and saves: per-step statistics stay on the
device until then, in the trainer's meter (multicard.engine.meters), which also writes the step and
epoch records. Every control-flow decision (NaN stop, best epoch, graceful stop) is taken
from values reduced across ranks, so all ranks decide alike.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from multicard.base.errors import Stopped, TrainingDiverged
from multicard.data.augmentation.mixing import StepMix
from multicard.data.loading.loaders import Batch, EvalLoader, TrainLoader
from multicard.engine.ema import WeightAverage
from multicard.engine.loop import (
    OPTIMIZER_KERNEL_KEYS as OPTIMIZER_KERNEL_KEYS,  # re-exported: its users import it from here
)
from multicard.engine.loop import Callback, Hooks, Loop, Position, Schedule, StepEnd, rng_state
from multicard.engine.meters import EvalResult, TrainMeter
from multicard.engine.meters import peak_memory_mb as peak_memory_mb  # re-exported: its users import it from here
from multicard.engine.phases import DATA, EVALUATION, FORWARD, IDLE
from multicard.runtime.stopping import GracefulStop
from multicard.strategy.precision import Precision

if TYPE_CHECKING:  # annotations only: the strategies import torch's sharding stack
    from multicard.strategy.base import Strategy

__all__ = ["Callback", "EvalResult", "Position", "Schedule", "StepEnd", "Trainer", "evaluate", "rng_state"]


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


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(label_smoothing: float) -> LossFn:
    """The classifier's default loss."""

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target, label_smoothing=label_smoothing)

    return loss


class _MeterState:
    """The meter's epoch sums, saved inside the checkpoint's position (a resumed epoch reports the
    whole epoch); reduced first, so the sums saved include every step done."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self, whole: bool = False) -> dict[str, Any]:
        self.trainer.reduce_statistics()
        return self.trainer.meter.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.meter.load_state_dict(state)


class _AverageState:
    """The weights' EMA as a checkpoint part (ema.decay)."""

    def __init__(self, ema: WeightAverage, bare: nn.Module) -> None:
        self.ema, self.bare = ema, bare

    def state_dict(self, whole: bool = False) -> dict[str, Any]:
        return self.ema.state_dict(self.bare, whole)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema.load_state_dict(state, self.bare)


class Trainer:
    """Trains one run's classifier: data, mixing, forward and loss, statistics and evaluation around
    the run's loop, which steps it."""

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
        loss: LossFn | None = None,
    ) -> None:
        """`loss(logits, target)` → the micro-batch's mean loss (default: cross-entropy with the
        schedule's label smoothing); target is class indices, or class weights under mixing."""
        self.strategy = strategy
        self.loss = loss or cross_entropy(schedule.label_smoothing)
        self.loop = Loop(strategy, schedule, stop)
        self.loop.attach(model, optimizer, scheduler)
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.mix, self.ema = mix, ema  # mixup/CutMix before the forward; the weights' EMA after each step
        self.meter = TrainMeter(strategy, self.loop.clock)  # the steps' statistics and records
        self.loop.position_state.append(_MeterState(self))
        if ema is not None:
            self.loop.components["ema"] = _AverageState(ema, self.bare)

    # ------------------------------------------------------------ the loop's parts, by name

    model = property(lambda self: self.loop.model)  # as the strategy wrapped it: what forward runs through
    bare = property(lambda self: self.loop.bare)  # parameters, checkpoints and evaluation
    optimizer = property(lambda self: self.loop.optimizer)
    scheduler = property(lambda self: self.loop.scheduler)
    scaler = property(lambda self: self.loop.scaler)
    schedule = property(lambda self: self.loop.schedule)
    clock = property(lambda self: self.loop.clock)
    finished = property(lambda self: self.loop.finished)
    phase = property(lambda self: self.loop.phase)

    @property
    def position(self) -> Position:
        return self.loop.position

    def set_phase(self, phase: str) -> None:
        self.loop.set_phase(phase)

    def state_dict(self, whole: bool = False) -> dict[str, Any]:
        """Everything a checkpoint holds (multicard.engine.loop.Loop.state_dict). A collective."""
        return self.loop.state_dict(whole)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (any strategy and world size that keep this global batch)."""
        self.loop.load_state_dict(state)

    # ------------------------------------------------------------ training

    def fit(
        self, callbacks: Sequence[Callback] = (), until: int | None = None, validate: bool = True
    ) -> EvalResult | None:
        """Train to optimizer step `until` (default: the end of the run), evaluating and telling
        the callbacks at each epoch end. Raises Stopped when the ranks agree on a signal."""
        end = min(until, self.schedule.total_steps) if until is not None else self.schedule.total_steps
        result = None
        hooks = self.loop.hooks = Hooks(callbacks)
        hooks.on_fit_start(self.loop)
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
                    hooks.on_stop(self.loop, stopped)
                    raise stopped
                if not complete or self.position.global_step >= end:
                    break
        finally:
            self.loop.ending = sys.exc_info()[1]
            hooks.on_fit_end(self.loop)
            self.loop.hooks = Hooks([])
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
            self._step(batches)
            self.loop.count_step()
            if self.ema is not None:
                self.ema.update(self.bare, pos.global_step)
            times, signum = self.loop.end_step()
            self.meter.add_step(times)
            ends_epoch = pos.step_in_epoch == steps
            if pos.global_step % self.schedule.log_every == 0 or ends_epoch or signum:
                self.reduce_statistics()
                record = self.meter.step_record(pos.epoch, pos.global_step, self.optimizer.param_groups[0]["lr"])
                hooks.on_log(self.loop, record)
            info = StepEnd(pos.epoch, pos.global_step, pos.step_in_epoch, ends_epoch, times, signum)
            hooks.on_step_end(self.loop, info)
            stopped = Stopped(signum, pos.global_step) if signum else None
        self.meter.end_training()
        return stopped

    def _step(self, batches: Iterator[Batch]) -> None:
        """One optimizer step: grad_accum micro-steps through the loop, then its optimizer step."""
        loop, strategy, clock, pos = self.loop, self.strategy, self.loop.clock, self.position
        for micro in range(self.schedule.grad_accum):
            clock.enter(DATA)
            x, y = next(batches)
            x, target = self.mix(x, y, pos.epoch, pos.step_in_epoch, micro) if self.mix is not None else (x, y)
            x = prepare_input(x, strategy.precision, strategy.setup.channels_last)
            with loop.micro_step(micro):
                clock.enter(FORWARD)
                logits = logits_for_loss(self.model(x))
                loss = self.loss(logits, target)
                loop.backpropagate(loss)
            self.meter.add(loss, logits, target)  # under mixing: scored against the mixed targets
        loop.optimizer_step()

    def reduce_statistics(self) -> None:
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
            self.loop.position = Position(pos.epoch + 1, 0, pos.global_step, pos.best_top1)
            self.meter.new_epoch()
        hooks.on_epoch_end(self.loop, record, val, best)
        return val


def validation(trainer: Trainer) -> tuple[EvalResult, EvalResult | None]:
    """The epoch's validation of the model, and of its weights' EMA where the run keeps one (with
    the average swapped in, and rank 0's BatchNorm statistics of it, as checkpoints keep them)."""
    loader = trainer.val_loader
    assert loader is not None

    def run() -> EvalResult:
        trainer.strategy.agree_buffers(trainer.bare)  # the statistics the epoch's checkpoint holds
        strategy, flip = trainer.strategy, trainer.schedule.eval_flip
        return evaluate(trainer.bare, loader, strategy, trainer.clock.tick, flip)

    if trainer.ema is None:
        return run(), None
    own = run()
    with trainer.ema.swapped_in(trainer.bare):
        return own, run()
