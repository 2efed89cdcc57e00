"""The training loop and exact evaluation: the one place a training step is written.

`Trainer.fit` runs optimizer steps until a given step, evaluates at epoch ends and tells its
callbacks what happened (step end with the step's phase times, log records, epoch ends, a
stop). Checkpointing, telemetry, benchmarks and checks are callbacks; none of them steps the
model itself. The trainer is stateful: `state_dict()` / `load_state_dict()` carry the model,
optimizer, scheduler, scaler, position and every rank's random streams.

Host syncs happen only at log intervals, epoch ends and saves: per-step statistics stay on the
device until then. Every control-flow decision (NaN stop, best epoch, graceful stop) is taken
from values reduced across ranks, so all ranks decide alike.
"""

from __future__ import annotations

import random
import resource
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from multicard.data.loaders import Batch, EvalLoader, TrainLoader
from multicard.errors import Stopped, TrainingDiverged
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
    split,
)
from multicard.precision import Precision
from multicard.stopping import GracefulStop

if TYPE_CHECKING:  # annotations only: the strategies import torch's sharding stack
    from multicard.strategy import Strategy

OPTIMIZER_KERNEL_KEYS = ("fused", "foreach")  # param-group entries that choose kernels, not maths


@dataclass(frozen=True)
class EvalResult:
    loss: float
    top1: float  # percent
    top5: float  # percent
    samples: int

    def as_dict(self) -> dict[str, Any]:
        return {"top1": self.top1, "top5": self.top5, "loss": self.loss, "samples": self.samples}


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
    model: nn.Module, batches: Iterable[Batch], strategy: Strategy, progress: Callable[[], None] = lambda: None
) -> EvalResult:
    """Exact metrics: each rank sums (loss, correct@1, correct@5, count) over its own share,
    then the sums are reduced. No sample is padded or counted twice. `progress` is told of each batch."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=strategy.ctx.device)
    for x, y in batches:
        x = prepare_input(x, strategy.precision, strategy.setup.channels_last)
        with strategy.precision.autocast():
            out = model(x)
        logits = logits_for_loss(out)
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


def peak_memory_mb(devices: list[torch.device]) -> list[float]:
    """Peak memory of each device this process uses (CPU: the process's peak RSS)."""
    out = []
    for device in devices:
        if device.type == "cuda":
            out.append(torch.cuda.max_memory_allocated(device) / 2**20)
        else:
            out.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return [round(v, 1) for v in out]


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


# ---------------------------------------------------------------- the loop's state and settings


@dataclass
class Position:
    """Where a run stands; saved in every checkpoint so a resumed run continues exactly."""

    epoch: int = 0  # the epoch in progress (or the next one, at an epoch boundary)
    step_in_epoch: int = 0  # optimizer steps of `epoch` already done
    global_step: int = 0
    best_top1: float = -1.0
    epoch_totals: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # loss sum, correct, count


@dataclass(frozen=True)
class Schedule:
    """The loop's fixed settings, derived once from the config and the data."""

    steps_per_epoch: int
    total_steps: int  # optimizer steps of the whole run (train.epochs, cut by train.max_steps)
    grad_accum: int = 1
    log_every: int = 50
    label_smoothing: float = 0.0
    clip_grad_norm: float = 0.0

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
        self.position = Position()
        self.clock = PhaseClock(strategy.ctx.device)
        device = strategy.ctx.device
        # Statistics of the steps since the last reduction, on the device:
        # loss sum (finite losses), correct, count, micro-steps whose loss was NaN/inf.
        self._window = torch.zeros(4, dtype=torch.float64, device=device)
        self._since_log = [0.0, 0.0, 0.0]  # reduced loss sum, correct, count since the last step record
        self._log_started = time.perf_counter()
        self._step_times: list[StepTimes] = []  # since the last step record
        self._skipped = 0  # fp16 micro-steps with NaN/inf loss in the last reduction
        self._epoch_clock = (time.perf_counter(), 0.0, time.perf_counter())  # start, samples before, training end
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
        self._reduce_window()  # the position's running totals must include every step done
        self.strategy.agree_buffers(self.bare)
        model_state, optim_state = self.strategy.state_dicts(self.bare, self.optimizer, whole)
        return {
            "model": model_state,
            "optimizer": optim_state,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "position": asdict(self.position),
            "rng": self.strategy.all_gather_object(rng_state()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (any strategy and world size that keep this global batch)."""
        # How this run computes the update (fused kernels or not) is its own choice, not the
        # checkpoint's: a fused kernel saved by one strategy may not exist for another's tensors.
        kernels = [{k: g[k] for k in OPTIMIZER_KERNEL_KEYS if k in g} for g in self.optimizer.param_groups]
        self.strategy.load_state_dicts(self.bare, self.optimizer, state["model"], state["optimizer"])
        for group, keep in zip(self.optimizer.param_groups, kernels, strict=True):
            group.update(keep)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.position = Position(**state["position"])
        rngs, ctx = state["rng"], self.strategy.ctx
        # Same world size: each rank continues its own streams; otherwise rank 0's seed them all.
        set_rng_state(rngs[ctx.rank] if len(rngs) == ctx.world_size else rngs[0])

    # ------------------------------------------------------------ training

    def fit(
        self, callbacks: Sequence[Callback] = (), until: int | None = None, validate: bool = True
    ) -> EvalResult | None:
        """Train to optimizer step `until` (default: the end of the run), evaluating and telling
        the callbacks at each epoch end. Raises Stopped when the ranks agree on a signal."""
        end = min(until, self.schedule.total_steps) if until is not None else self.schedule.total_steps
        result = None
        for cb in callbacks:
            cb.on_fit_start(self)
        try:
            while True:
                pos = self.position
                steps = self.schedule.steps_in_epoch(pos.epoch)
                stop_at = min(steps, end - pos.epoch * self.schedule.steps_per_epoch)
                stop = self._train_epoch(stop_at, callbacks)
                complete = 0 < steps <= self.position.step_in_epoch
                if complete:  # a stop on an epoch's last step still evaluates and saves the epoch first
                    result = self._end_epoch(steps, callbacks, validate)
                if stop is not None:
                    for cb in callbacks:
                        cb.on_stop(self, stop)
                    raise stop
                if not complete or self.position.global_step >= end:
                    break
        finally:
            for cb in callbacks:
                cb.on_fit_end(self)
        return result

    def _train_epoch(self, stop_at: int, callbacks: Sequence[Callback]) -> Stopped | None:
        """Steps of the current epoch up to `stop_at`; the agreed stop, if one came."""
        pos = self.position
        self._epoch_clock = (time.perf_counter(), pos.epoch_totals[2], time.perf_counter())
        if pos.step_in_epoch >= stop_at:
            return None
        self.model.train()
        self.train_loader.set_epoch(pos.epoch, pos.step_in_epoch)
        batches = iter(self.train_loader)
        steps = self.schedule.steps_in_epoch(pos.epoch)
        stop = None
        while pos.step_in_epoch < stop_at and stop is None:
            self._step(batches, callbacks)
            pos.global_step += 1
            pos.step_in_epoch += 1
            times = self.clock.end_step()
            self._step_times.append(times)
            signum = self._poll_stop()
            last = pos.step_in_epoch == steps
            if pos.global_step % self.schedule.log_every == 0 or last or signum:
                record = self._log_record()
                for cb in callbacks:
                    cb.on_log(self, record)
            info = StepEnd(pos.epoch, pos.global_step, pos.step_in_epoch, last, times, signum)
            for cb in callbacks:
                cb.on_step_end(self, info)
            stop = Stopped(signum, pos.global_step) if signum else None
        started, samples_before, _ = self._epoch_clock
        self._epoch_clock = (started, samples_before, time.perf_counter())
        return stop

    def _step(self, batches: Iterator[Batch], callbacks: Sequence[Callback]) -> None:
        """One optimizer step: grad_accum micro-steps, gradients reduced on the last one only."""
        sched, strategy, clock, model = self.schedule, self.strategy, self.clock, self.model
        accum = sched.grad_accum
        for micro in range(accum):
            clock.enter(DATA)
            x, y = next(batches)
            x = prepare_input(x, strategy.precision, strategy.setup.channels_last)
            sync = micro == accum - 1
            clock.enter(FORWARD)
            with nullcontext() if sync else strategy.no_sync(model):
                logits = logits_for_loss(model(x))
                loss = F.cross_entropy(logits, y, label_smoothing=sched.label_smoothing)
                clock.enter(BACKWARD)
                if self._gradients is not None:
                    self._gradients.expect(sync)
                self.scaler.scale(loss / accum).backward()
            with torch.no_grad():
                finite = torch.isfinite(loss.detach())
                w = self._window
                w[0] += torch.where(finite, loss.detach(), 0.0) * y.numel()
                w[1] += (logits.argmax(dim=1) == y).sum()
                w[2] += y.numel()
                w[3] += ~finite
        clock.enter(OPTIMIZER)
        for cb in callbacks:
            cb.on_gradients(self)
        if sched.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), sched.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _poll_stop(self) -> int:
        if self.stop is None:
            return 0
        self.clock.set_phase(REDUCING)
        signum = self.stop.poll()
        self.clock.set_phase(IDLE)
        return signum

    def _reduce_window(self) -> None:
        """Sum the unreduced statistics over ranks (one host sync); a NaN/inf loss on any rank
        stops every rank, except under the fp16 scaler, which skips those steps."""
        phase = self.clock.phase
        self.clock.set_phase(REDUCING)
        reduced = self.strategy.all_reduce_sum(self._window.clone())
        self.clock.set_phase(phase)
        self._window.zero_()
        loss_sum, correct, count, nonfinite = reduced.tolist()
        if nonfinite and not self.scaler.is_enabled():
            raise TrainingDiverged(
                f"loss is NaN/inf at step {self.position.global_step}; lower optim.lr, "
                f"set clip_grad_norm, or use precision=fp32 (the last good checkpoint is kept)"
            )
        self._skipped = int(nonfinite)
        pos = self.position
        pos.epoch_totals = [a + b for a, b in zip(pos.epoch_totals, (loss_sum, correct, count), strict=True)]
        self._since_log = [a + b for a, b in zip(self._since_log, (loss_sum, correct, count), strict=True)]

    def _log_record(self) -> dict[str, Any]:
        """A step record: reduced loss and accuracy, lr, img/s, this rank's step-time split, and
        every rank's step, busy and data times (busy: not waiting for the others)."""
        self._reduce_window()
        loss_sum, correct, count = self._since_log
        elapsed = time.perf_counter() - self._log_started
        seconds = [t.seconds() for t in self._step_times]
        mean = {k: sum(s[k] for s in seconds) / len(seconds) for k in seconds[0]} if seconds else {}
        parts = split(mean) if mean else {}
        if self._gradients is None and self.strategy.ctx.world_size > 1:
            parts.pop("comm_exposed_ms", None)  # fsdp's gathers and scatters run inside forward and backward
        step_ms = 1000 * sum(mean.values()) if mean else 0.0
        mine = {
            "step_ms": round(step_ms, 3),
            "busy_ms": round(step_ms - 1000 * mean.get(COMMUNICATION, 0.0), 3),
            "data_ms": round(1000 * mean.get(DATA, 0.0), 3),
        }
        record = {
            "epoch": self.position.epoch,
            "step": self.position.global_step,
            "loss": loss_sum / count if count else float("nan"),
            "top1": 100 * correct / count if count else 0.0,
            "lr": self.optimizer.param_groups[0]["lr"],
            "img_per_s": count / elapsed if elapsed > 0 else 0.0,
            **{k: round(v, 3) for k, v in parts.items()},
            "step_ms": mine["step_ms"],
        }
        if self.strategy.ctx.world_size > 1:
            self.clock.set_phase(REDUCING)
            record["ranks"] = self.strategy.all_gather_object(mine)
            self.clock.set_phase(IDLE)
        if self._skipped:
            record["fp16_skipped"] = self._skipped
        self._since_log = [0.0, 0.0, 0.0]
        self._log_started = time.perf_counter()
        self._step_times = []
        return record

    def _end_epoch(self, steps: int, callbacks: Sequence[Callback], validate: bool) -> EvalResult | None:
        """Evaluate, report, advance the position past a complete epoch, tell the callbacks."""
        pos = self.position
        epoch = pos.epoch
        started, samples_before, trained_until = self._epoch_clock
        self.set_phase(EVALUATION)
        val = None
        if validate and self.val_loader is not None:
            self.strategy.agree_buffers(self.bare)  # the statistics the epoch's checkpoint holds
            val = evaluate(self.bare, self.val_loader, self.strategy, self.clock.tick)
        self.set_phase(IDLE)
        per_rank = self.strategy.all_gather_object(peak_memory_mb(self.strategy.devices))
        loss_sum, correct, count = pos.epoch_totals
        train_s = trained_until - started
        record: dict[str, Any] = {
            "epoch": epoch,
            "step": pos.global_step,
            "train_loss": loss_sum / count if count else float("nan"),
            "train_top1": 100 * correct / count if count else 0.0,
            "lr": self.optimizer.param_groups[0]["lr"],
            "img_per_s": (count - samples_before) / train_s if train_s > 0 else 0.0,
            "epoch_s": time.perf_counter() - started,
            "peak_mem_mb": [mb for rank_peaks in per_rank for mb in rank_peaks],
        }
        if val is not None:
            record.update(val_loss=val.loss, val_top1=val.top1, val_top5=val.top5, val_samples=val.samples)
        best = val is not None and val.top1 > pos.best_top1  # reduced metrics: every rank decides alike
        if val is not None:
            pos.best_top1 = max(pos.best_top1, val.top1)
        if steps == self.schedule.steps_per_epoch:  # else train.max_steps cut the epoch short
            self.position = Position(epoch + 1, 0, pos.global_step, pos.best_top1)
        for cb in callbacks:
            cb.on_epoch_end(self, record, val, best)
        return val
