"""`run.log(**values)`: the run's one meter. A user's values (and `multicard train`'s loss, top-1
and validation scores) as step and epoch records, reduced over ranks.

Tensor values stay on the device until a record is due (every log_every steps, at an epoch's
last step and at a stop); numbers stay on the host. Then one all-reduce of the tensors' sums and
counts, and one gather (which also tells the names each rank logged) of the numbers', give each
value's mean over the calls since the last record and over every rank; a number that every call
on every rank logged alike (a score run.evaluate reduced) is recorded as it was, exactly. A step
record also holds the learning rate, img/s and the step-time split; an epoch record each value's
mean over the epoch (under the name `epoch_names` gives it, if any; values logged after the
epoch's last step, such as validation scores, appear there only), img/s over its training time,
duration and every device's peak memory. A NaN/inf loss given to run.backward on any rank stops
every rank at the next record; under the fp16 scaler, which skips those steps, the record counts
them (fp16_skipped).
"""

from __future__ import annotations

import math
import time
from numbers import Number
from typing import TYPE_CHECKING, Any, SupportsFloat, cast

import torch

from multicard.base.errors import TrainingDiverged, UserError
from multicard.engine.meters import every_peak_memory_mb, step_split
from multicard.engine.phases import IDLE, REDUCING, StepTimes

if TYPE_CHECKING:
    from multicard.engine.loop import Loop

RESERVED = ("epoch", "step", "lr", "img_per_s", "step_ms", "ranks", "kind")  # keys the records own
UNKNOWN = (-math.inf, math.inf)  # the range of values a tensor's sum hides
LOWER_OPTIM_LR, LOWER_THE_LR = "lower optim.lr", "lower the learning rate"  # what a NaN/inf loss asks


class Logbook:
    def __init__(self, loop: Loop, global_batch: int, epoch_names: dict[str, str], of_config: bool) -> None:
        """`of_config`: a run of a multicard config (its learning rate is optim.lr), not a script's."""
        self.loop, self.global_batch = loop, global_batch
        self.epoch_names = epoch_names
        self.advice = (LOWER_OPTIM_LR if of_config else LOWER_THE_LR) + ", set clip_grad_norm, or use precision=fp32"
        self.device = loop.strategy.ctx.device
        self.window: dict[str, torch.Tensor] = {}  # name → [sum, calls] on the device, since the last record
        self.numbers: dict[str, list[float]] = {}  # name → [sum, calls, lowest, highest] of numbers, likewise
        self.epoch: dict[str, list[float]] = {}  # name → [sum, calls, lowest, highest] of this epoch, reduced
        self.since_record: dict[str, list[float]] = {}  # the same since the last step record
        self.nonfinite = torch.zeros((), dtype=torch.float64, device=self.device)  # losses given to backward
        self.skipped = 0  # fp16 micro-steps with a NaN/inf loss since the last step record
        self.step_times: list[StepTimes] = []
        self.steps_since_record, self.record_started = 0, time.perf_counter()
        self.epoch_steps, self.epoch_started = 0, time.perf_counter()
        self.trained_until = self.epoch_started  # the epoch's last step's end (its evaluation is not training)

    def add(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            if name in RESERVED:
                raise UserError(
                    f"run.log({name}=...): {name} is a key of multicard's own records; log it under another name"
                )
            if isinstance(value, Number) and not isinstance(value, (bool, complex)):
                v = float(cast(SupportsFloat, value))  # int, float, Decimal, numpy's…
                kept = self.numbers.setdefault(name, [0.0, 0.0, v, v])
                kept[0], kept[1], kept[2], kept[3] = kept[0] + v, kept[1] + 1, min(kept[2], v), max(kept[3], v)
                continue
            tensor = _scalar(name, value, self.device)
            slot = self.window.get(name)
            if slot is None:
                slot = self.window[name] = torch.zeros(2, dtype=torch.float64, device=self.device)
            slot[0] += tensor
            slot[1] += 1

    def watch_loss(self, loss: torch.Tensor) -> None:
        self.nonfinite += ~torch.isfinite(loss.detach()).all()

    def add_step(self, times: StepTimes) -> None:
        self.step_times.append(times)
        self.steps_since_record += 1
        self.epoch_steps += 1
        self.trained_until = time.perf_counter()

    def start_epoch(self, fresh: bool) -> None:
        """The loop starts (`fresh`) or continues (a resume) the epoch in progress."""
        if fresh:
            self.epoch = {}
        self.epoch_steps, self.epoch_started = 0, time.perf_counter()
        self.trained_until = self.epoch_started

    # A checkpoint part saved inside the position: a resumed epoch's record covers the whole epoch. Sums
    # and calls are saved per process (every rank logs): the same at any world size, the means unchanged.
    def state_dict(self, whole: bool = False) -> dict[str, Any]:
        self.reduce()
        world = self.loop.strategy.ctx.world_size
        return {"logged": {n: [v[0] / world, v[1] / world, *v[2:]] for n, v in self.epoch.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        world = self.loop.strategy.ctx.world_size
        logged = {n: [*v, *UNKNOWN][:4] for n, v in state.get("logged", {}).items()}
        self.epoch = {n: [v[0] * world, v[1] * world, *v[2:]] for n, v in logged.items()}

    def reduce(self) -> None:
        """Add the values since the last reduction, summed over ranks (which may log different names),
        to the epoch's and the next step record's. A collective (the host sync of the records)."""
        strategy, clock = self.loop.strategy, self.loop.clock
        phase = clock.phase
        clock.set_phase(REDUCING)
        ranks = strategy.all_gather_object((sorted(self.window), self.numbers))
        names = sorted({n for names, _ in ranks for n in names})
        zero = torch.zeros(2, dtype=torch.float64, device=self.device)
        packed = torch.cat([*(self.window.get(n, zero) for n in names), self.nonfinite.view(1)])
        values = strategy.all_reduce_sum(packed).tolist()
        clock.set_phase(phase)
        self.window, self.numbers, self.nonfinite = {}, {}, torch.zeros_like(self.nonfinite)
        if values[-1] and not self.loop.scaler.is_enabled():
            raise TrainingDiverged(
                f"loss is NaN/inf at step {self.loop.position.global_step}; {self.advice} "
                f"(the last good checkpoint is kept)"
            )
        self.skipped += int(values[-1])
        reduced = {n: [values[2 * i], values[2 * i + 1], *UNKNOWN] for i, n in enumerate(names)}
        for _, numbers in ranks:  # in rank order: every rank adds them alike
            for n, kept in numbers.items():
                _merge(reduced.setdefault(n, [0.0, 0.0, kept[2], kept[3]]), kept)
        for n, kept in reduced.items():
            _merge(self.epoch.setdefault(n, [0.0, 0.0, kept[2], kept[3]]), kept)
            _merge(self.since_record.setdefault(n, [0.0, 0.0, kept[2], kept[3]]), kept)

    def step_record(self, lr: float) -> dict[str, Any]:
        """The record of a log step. A collective."""
        pos, strategy = self.loop.position, self.loop.strategy
        self.reduce()
        elapsed = time.perf_counter() - self.record_started
        parts, mine = step_split(self.step_times, strategy)
        record: dict[str, Any] = {
            "epoch": pos.epoch, "step": pos.global_step, **_means(self.since_record), "lr": lr,
            "img_per_s": self.steps_since_record * self.global_batch / elapsed if elapsed > 0 else 0.0,
            **{k: round(v, 3) for k, v in parts.items()}, "step_ms": mine["step_ms"],
        }  # fmt: skip
        if strategy.ctx.world_size > 1:
            self.loop.set_phase(REDUCING)
            record["ranks"] = strategy.all_gather_object(mine)
            self.loop.set_phase(IDLE)
        if self.skipped:
            record["fp16_skipped"] = self.skipped
        self.step_times, self.steps_since_record, self.record_started = [], 0, time.perf_counter()
        self.since_record, self.skipped = {}, 0
        return record

    def epoch_record(self, lr: float) -> dict[str, Any]:
        """The record of an epoch end: each value's mean over the epoch. A collective. Values logged
        after the epoch's last step record (validation scores) are in this record only."""
        self.reduce()
        self.since_record = {}
        means = {self.epoch_names.get(n, n): v for n, v in _means(self.epoch).items()}
        trained = self.trained_until - self.epoch_started
        return {
            "epoch": self.loop.position.epoch, "step": self.loop.position.global_step, **means, "lr": lr,
            "img_per_s": self.epoch_steps * self.global_batch / trained if trained > 0 else 0.0,
            "epoch_s": time.perf_counter() - self.epoch_started,
            "peak_mem_mb": every_peak_memory_mb(self.loop.strategy),
        }  # fmt: skip


def _merge(into: list[float], more: list[float]) -> None:
    into[0], into[1] = into[0] + more[0], into[1] + more[1]
    into[2], into[3] = min(into[2], more[2]), max(into[3], more[3])


def _means(kept: dict[str, list[float]]) -> dict[str, float]:
    """Each value's mean; a value that was the same at every call, as it was."""
    return {n: (lo if lo == hi else total / calls) for n, (total, calls, lo, hi) in kept.items() if calls}


def _scalar(name: str, value: Any, device: torch.device) -> torch.Tensor:
    """A logged tensor as a float64 scalar on the device (no host sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UserError(
                f"run.log({name}=...) got a tensor of shape {list(value.shape)}; log one number (e.g. .mean())"
            )
        return value.detach().to(device=device, dtype=torch.float64).reshape(())
    raise UserError(f"run.log({name}=...) got {type(value).__name__}; log a number or a one-element tensor")
