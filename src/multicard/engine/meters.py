"""The training loop's statistics, kept apart from the loop (after pycls's meters).

`TrainMeter` sums what each micro-step measures on the device (no host sync per step), reduces
the sums over ranks when the loop asks (one all-reduce: at log steps, epoch ends and saves) and
writes the step and epoch records the callbacks receive. Its epoch sums are part of a checkpoint
(`state_dict`), so a resumed epoch reports the whole epoch.

A new statistic is a field of `Sums` (a slot of the device window comes with it), a line in
`TrainMeter.add` and its entries in the records.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import astuple, dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from multicard.engine.phases import COMMUNICATION, DATA, IDLE, REDUCING, PhaseClock, StepTimes, split

if TYPE_CHECKING:  # annotations only: the strategies import torch's sharding stack
    from multicard.strategy.base import Strategy


@dataclass(frozen=True)
class EvalResult:
    loss: float
    top1: float  # percent
    top5: float  # percent
    samples: int

    def as_dict(self) -> dict[str, Any]:
        return {"top1": self.top1, "top5": self.top5, "loss": self.loss, "samples": self.samples}


def peak_memory_mb(devices: list[torch.device]) -> list[float]:
    """Peak memory of each device this process uses (CPU: the process's peak RSS)."""
    out = []
    for device in devices:
        if device.type == "cuda":
            out.append(torch.cuda.max_memory_allocated(device) / 2**20)
        else:
            out.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return [round(v, 1) for v in out]


@dataclass
class Sums:
    """Statistics of training samples, summed over ranks."""

    loss_sum: float = 0.0  # finite losses, each × its micro-batch's samples
    correct: float = 0.0  # top-1 hits (under mixing: the mixed targets' weight on each predicted class)
    count: float = 0.0  # samples

    def __add__(self, other: Sums) -> Sums:
        return Sums(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else math.nan

    @property
    def top1(self) -> float:
        return 100 * self.correct / self.count if self.count else 0.0


def every_peak_memory_mb(strategy: Strategy) -> list[float]:
    """Peak memory of every device of every rank, in rank order. A collective."""
    per_rank = strategy.all_gather_object(peak_memory_mb(strategy.devices))
    return [mb for rank_peaks in per_rank for mb in rank_peaks]


def step_split(step_times: list[StepTimes], strategy: Strategy) -> tuple[dict[str, float], dict[str, float]]:
    """The mean step of `step_times`: its split (data / compute / exposed communication / optimizer
    ms), and this rank's step, busy (not waiting for the others) and data ms."""
    seconds = [t.seconds() for t in step_times]
    mean = {k: sum(s[k] for s in seconds) / len(seconds) for k in seconds[0]} if seconds else {}
    parts = split(mean) if mean else {}
    if not strategy.reduces_gradients and strategy.ctx.world_size > 1:
        parts.pop("comm_exposed_ms", None)  # fsdp's gathers and scatters run inside forward and backward
    step_ms = 1000 * sum(mean.values()) if mean else 0.0
    mine = {
        "step_ms": round(step_ms, 3),
        "busy_ms": round(step_ms - 1000 * mean.get(COMMUNICATION, 0.0), 3),
        "data_ms": round(1000 * mean.get(DATA, 0.0), 3),
    }
    return parts, mine


# The device window: the slots of Sums' fields, then micro-steps whose loss was NaN/inf.
SUMS = len(fields(Sums))
LOSS_SUM, CORRECT, COUNT, NONFINITE = range(SUMS + 1)


class TrainMeter:
    """The statistics of one run's training steps: on the device until reduced, then in `epoch`
    (this epoch's so far) and `since_log` (since the last step record)."""

    def __init__(self, strategy: Strategy, clock: PhaseClock) -> None:
        self.strategy = strategy
        self.clock = clock
        self.window = torch.zeros(SUMS + 1, dtype=torch.float64, device=strategy.ctx.device)
        self.epoch = Sums()
        self.since_log = Sums()
        self.skipped = 0  # fp16 micro-steps with a NaN/inf loss, in the last reduction
        self.step_times: list[StepTimes] = []  # since the last step record
        self.log_started = time.perf_counter()
        self.epoch_started = self.trained_until = time.perf_counter()
        self.samples_before = 0.0  # of this epoch, trained before this epoch's training started (a resume)

    # ------------------------------------------------------------ measuring (no host sync)

    @torch.no_grad()
    def add(self, loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """One micro-step's statistics, added on the device. `targets`: class indices, or the soft
        targets of mixup/CutMix (samples × classes), which score a prediction by their weight on its
        class: λ for the sample's own, 1 − λ for its partner's, 0 for another (the mixup paper's code)."""
        loss = loss.detach()
        finite = torch.isfinite(loss)
        w, samples, predicted = self.window, len(targets), logits.argmax(dim=1)
        w[LOSS_SUM] += torch.where(finite, loss, 0.0) * samples
        if targets.is_floating_point():
            w[CORRECT] += targets.gather(1, predicted.view(-1, 1)).to(w.dtype).sum()
        else:
            w[CORRECT] += (predicted == targets).sum()
        w[COUNT] += samples
        w[NONFINITE] += ~finite

    def add_step(self, times: StepTimes) -> None:
        self.step_times.append(times)

    def start_epoch(self) -> None:
        """The loop starts (or continues) training the epoch in progress."""
        self.epoch_started = self.trained_until = time.perf_counter()
        self.samples_before = self.epoch.count

    def end_training(self) -> None:
        """The loop has ended this epoch's steps (evaluation may follow)."""
        self.trained_until = time.perf_counter()

    def new_epoch(self) -> None:
        self.epoch = Sums()

    # ------------------------------------------------------------ reducing and recording

    def reduce(self) -> int:
        """Sum the window over ranks (one host sync) into the epoch's and the log's sums; returns
        the micro-steps whose loss was NaN/inf on any rank."""
        phase = self.clock.phase
        self.clock.set_phase(REDUCING)
        reduced = self.strategy.all_reduce_sum(self.window.clone())
        self.clock.set_phase(phase)
        self.window.zero_()
        values = reduced.tolist()
        sums = Sums(*values[:SUMS])
        self.epoch, self.since_log = self.epoch + sums, self.since_log + sums
        self.skipped = int(values[NONFINITE])
        return self.skipped

    def step_record(self, epoch: int, step: int, lr: float) -> dict[str, Any]:
        """The record of a log step (after `reduce`): loss and top-1 since the last record, lr, img/s,
        this rank's step-time split, and every rank's step, busy and data times (busy: not waiting
        for the others). A collective when there are several ranks."""
        sums, elapsed = self.since_log, time.perf_counter() - self.log_started
        parts, mine = step_split(self.step_times, self.strategy)
        record: dict[str, Any] = {
            "epoch": epoch,
            "step": step,
            "loss": sums.loss,
            "top1": sums.top1,
            "lr": lr,
            "img_per_s": sums.count / elapsed if elapsed > 0 else 0.0,
            **{k: round(v, 3) for k, v in parts.items()},
            "step_ms": mine["step_ms"],
        }
        if self.strategy.ctx.world_size > 1:
            self.clock.set_phase(REDUCING)
            record["ranks"] = self.strategy.all_gather_object(mine)
            self.clock.set_phase(IDLE)
        if self.skipped:
            record["fp16_skipped"] = self.skipped
        self.since_log, self.log_started, self.step_times = Sums(), time.perf_counter(), []
        return record

    def epoch_record(
        self, epoch: int, step: int, lr: float, val: EvalResult | None, averaged: EvalResult | None = None
    ) -> dict[str, Any]:
        """The record of an epoch end (after `reduce`): its training loss and top-1, lr, img/s,
        duration, every device's peak memory and the validation metrics (of the weights' EMA too,
        `averaged`, when the run keeps one). A collective."""
        sums, train_s = self.epoch, self.trained_until - self.epoch_started
        record: dict[str, Any] = {
            "epoch": epoch,
            "step": step,
            "train_loss": sums.loss,
            "train_top1": sums.top1,
            "lr": lr,
            "img_per_s": (sums.count - self.samples_before) / train_s if train_s > 0 else 0.0,
            "epoch_s": time.perf_counter() - self.epoch_started,
            "peak_mem_mb": every_peak_memory_mb(self.strategy),
        }
        if val is not None:
            record.update(val_loss=val.loss, val_top1=val.top1, val_top5=val.top5, val_samples=val.samples)
        if averaged is not None:
            record.update(ema_val_loss=averaged.loss, ema_val_top1=averaged.top1, ema_val_top5=averaged.top5)
        return record

    # ------------------------------------------------------------ state (in the trainer's position)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch_totals": list(astuple(self.epoch))}  # loss sum, correct, count

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = Sums(*state.get("epoch_totals", ()))
