"""`run.log(**values)`: a user's values as step and epoch records, reduced over ranks.

Values stay on the device until a record is due (every log_every steps, at an epoch's last
step and at a stop): then one all-reduce of their sums and counts gives each value's mean over
the calls since the last record and over every rank. A step record also holds the learning
rate, img/s and the step-time split; an epoch record each value's mean over the epoch (values
logged after the epoch's last step, such as validation scores, appear there only), img/s,
duration and every device's peak memory. A NaN/inf loss given to run.backward on any rank
stops every rank at the next record, as `multicard train` does (not under the fp16 scaler,
which skips those steps).
"""

from __future__ import annotations

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


class Logbook:
    def __init__(self, loop: Loop, global_batch: int) -> None:
        self.loop, self.global_batch = loop, global_batch
        self.device = loop.strategy.ctx.device
        self.window: dict[str, torch.Tensor] = {}  # name → [sum, calls] on the device, since the last record
        self.epoch: dict[str, list[float]] = {}  # name → [sum, calls] of this epoch, reduced
        self.since_record: dict[str, list[float]] = {}  # the same since the last step record
        self.nonfinite = torch.zeros((), dtype=torch.float64, device=self.device)  # losses given to backward
        self.step_times: list[StepTimes] = []
        self.steps_since_record, self.record_started = 0, time.perf_counter()
        self.epoch_steps, self.epoch_started = 0, time.perf_counter()

    def add(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            if name in RESERVED:
                raise UserError(
                    f"run.log({name}=...): {name} is a key of multicard's own records; log it under another name"
                )
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

    def start_epoch(self, fresh: bool) -> None:
        """The loop starts (`fresh`) or continues (a resume) the epoch in progress."""
        if fresh:
            self.epoch = {}
        self.epoch_steps, self.epoch_started = 0, time.perf_counter()

    # A checkpoint part saved inside the position: a resumed epoch's record covers the whole epoch.
    def state_dict(self, whole: bool = False) -> dict[str, Any]:
        self._reduce()
        return {"logged": {n: list(v) for n, v in self.epoch.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = {n: list(v) for n, v in state.get("logged", {}).items()}

    def _reduce(self) -> None:
        """Add the window's [sum, calls] per name, summed over ranks (which may log different names),
        to the epoch's and the next step record's."""
        strategy, clock = self.loop.strategy, self.loop.clock
        phase = clock.phase
        clock.set_phase(REDUCING)
        names = sorted({n for names in strategy.all_gather_object(sorted(self.window)) for n in names})
        zero = torch.zeros(2, dtype=torch.float64, device=self.device)
        packed = torch.cat([*(self.window.get(n, zero) for n in names), self.nonfinite.view(1)])
        values = strategy.all_reduce_sum(packed).tolist()
        clock.set_phase(phase)
        self.window, self.nonfinite = {}, torch.zeros_like(self.nonfinite)
        if values[-1] and not self.loop.scaler.is_enabled():
            raise TrainingDiverged(
                f"loss is NaN/inf at step {self.loop.position.global_step}; lower the learning rate, set "
                f"clip_grad_norm, or use precision=fp32 (the last good checkpoint is kept)"
            )
        for i, n in enumerate(names):
            for kept in (self.epoch.setdefault(n, [0.0, 0.0]), self.since_record.setdefault(n, [0.0, 0.0])):
                kept[0], kept[1] = kept[0] + values[2 * i], kept[1] + values[2 * i + 1]

    def step_record(self, lr: float) -> dict[str, Any]:
        """The record of a log step. A collective."""
        pos, strategy = self.loop.position, self.loop.strategy
        self._reduce()
        means = {n: total / calls for n, (total, calls) in self.since_record.items() if calls}
        elapsed = time.perf_counter() - self.record_started
        parts, mine = step_split(self.step_times, strategy)
        record: dict[str, Any] = {
            "epoch": pos.epoch, "step": pos.global_step, **means, "lr": lr,
            "img_per_s": self.steps_since_record * self.global_batch / elapsed if elapsed > 0 else 0.0,
            **{k: round(v, 3) for k, v in parts.items()}, "step_ms": mine["step_ms"],
        }  # fmt: skip
        if strategy.ctx.world_size > 1:
            self.loop.set_phase(REDUCING)
            record["ranks"] = strategy.all_gather_object(mine)
            self.loop.set_phase(IDLE)
        self.step_times, self.steps_since_record, self.record_started = [], 0, time.perf_counter()
        self.since_record = {}
        return record

    def epoch_record(self, lr: float) -> dict[str, Any]:
        """The record of an epoch end: each value's mean over the epoch. A collective. Values logged
        after the epoch's last step record (validation scores) are in this record only."""
        self._reduce()
        self.since_record = {}
        seconds = time.perf_counter() - self.epoch_started
        return {
            "epoch": self.loop.position.epoch, "step": self.loop.position.global_step,
            **{n: total / calls for n, (total, calls) in self.epoch.items() if calls}, "lr": lr,
            "img_per_s": self.epoch_steps * self.global_batch / seconds if seconds > 0 else 0.0, "epoch_s": seconds,
            "peak_mem_mb": every_peak_memory_mb(self.loop.strategy),
        }  # fmt: skip


def _scalar(name: str, value: Any, device: torch.device) -> torch.Tensor:
    """A logged value as a float64 scalar on the device (no host sync for a tensor)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UserError(
                f"run.log({name}=...) got a tensor of shape {list(value.shape)}; log one number (e.g. .mean())"
            )
        return value.detach().to(device=device, dtype=torch.float64).reshape(())
    if isinstance(value, Number) and not isinstance(value, (bool, complex)):  # int, float, Decimal, numpy's…
        return torch.tensor(float(cast(SupportsFloat, value)), dtype=torch.float64, device=device)
    raise UserError(f"run.log({name}=...) got {type(value).__name__}; log a number or a one-element tensor")
