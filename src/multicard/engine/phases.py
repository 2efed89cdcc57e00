"""Where each optimizer step spends its time, measured from the trainer's phase changes.

The trainer says which phase it enters (data, forward, backward, communication, optimizer);
a phase lasts until the next one starts. On the CPU the marks are wall-clock times. On CUDA
they are events recorded on the current stream, read only when someone asks for the seconds
(at a log interval, after the host has synced anyway), so timing costs no extra sync.

`communication` is the exposed part of gradient reduction: from the moment the last gradient
of the step is computed until backward returns (DDP waits there for its last all-reduce).

Wall-clock timing of whole steps lives here too (`StepClock`), below every tool that measures
(bench, plan, the yardsticks): each timing waits for the device first (CUDA kernels are
asynchronous), so a time is what the work cost, not when it was queued.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

DATA, FORWARD, BACKWARD, COMMUNICATION, OPTIMIZER = "data", "forward", "backward", "communication", "optimizer"
PHASES = (DATA, FORWARD, BACKWARD, COMMUNICATION, OPTIMIZER)
# Outside the step (the stall report names a rank stuck in one of these too).
IDLE, EVALUATION, CHECKPOINT, REDUCING = "idle", "evaluation", "checkpoint", "reducing"


@dataclass
class StepTimes:
    """The marks of one optimizer step: (phase entered, time or CUDA event), then ("end", ...)."""

    marks: list[tuple[str, Any]]

    def seconds(self) -> dict[str, float]:
        """Seconds spent in each phase of PHASES (waits for the device on CUDA)."""
        out = dict.fromkeys(PHASES, 0.0)
        if not self.marks:
            return out
        if isinstance(self.marks[-1][1], torch.cuda.Event):
            self.marks[-1][1].synchronize()
            gaps = [a.elapsed_time(b) / 1000 for (_, a), (_, b) in zip(self.marks, self.marks[1:], strict=False)]
        else:
            gaps = [b - a for (_, a), (_, b) in zip(self.marks, self.marks[1:], strict=False)]
        for (phase, _), gap in zip(self.marks, gaps, strict=False):
            if phase in out:
                out[phase] += gap
        return out


class PhaseClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.phase = IDLE
        self.ticks = 0  # progress: phase changes and evaluation batches (read by the stall watchdog)
        self._marks: list[tuple[str, Any]] = []

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.ticks += 1
        self._marks.append((phase, self._now()))

    def set_phase(self, phase: str) -> None:
        """Name what the process is doing outside a step (no timing)."""
        self.phase = phase
        self.ticks += 1

    def tick(self) -> None:
        """Progress within a long phase (an evaluation batch)."""
        self.ticks += 1

    def end_step(self) -> StepTimes:
        self._marks.append(("end", self._now()))
        marks, self._marks = self._marks, []
        self.phase = IDLE
        return StepTimes(marks)


def split(seconds: dict[str, float]) -> dict[str, float]:
    """The step-time split people read: data / compute / exposed communication / optimizer (ms)."""
    return {
        "data_ms": 1000 * seconds[DATA],
        "compute_ms": 1000 * (seconds[FORWARD] + seconds[BACKWARD]),
        "comm_exposed_ms": 1000 * seconds[COMMUNICATION],
        "optimizer_ms": 1000 * seconds[OPTIMIZER],
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Called once per optimizer step; keeps the step times after `warmup` steps."""

    def __init__(self, device: torch.device, warmup: int) -> None:
        self.device = device
        self.warmup = warmup
        self.seen = 0
        self.times: list[float] = []
        self._last = time.perf_counter()

    def restart(self) -> None:
        """The next step's time starts now (not at the last tick): a run's start-up is not a step."""
        sync(self.device)
        self._last = time.perf_counter()

    def __call__(self) -> None:
        sync(self.device)
        now = time.perf_counter()
        if self.seen >= self.warmup:
            self.times.append(now - self._last)
        self.seen += 1
        self._last = now


def summary_ms(times: list[float]) -> dict[str, float]:
    """Median and the 10th/90th percentiles of step times, in milliseconds."""
    ms = sorted(t * 1000 for t in times)
    if len(ms) == 1:
        return {"median": ms[0], "p10": ms[0], "p90": ms[0]}
    deciles = statistics.quantiles(ms, n=10, method="inclusive")
    return {"median": statistics.median(ms), "p10": deciles[0], "p90": deciles[-1]}
