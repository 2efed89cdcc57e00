"""Where each optimizer step spends its time, measured from the loop's phase changes.

The loop says which phase it enters (data, forward, backward, communication, optimizer);
a phase lasts until the next one starts. On the CPU the marks are wall-clock times. On CUDA
they are events recorded on the current stream, read only when someone asks for the seconds
(at a log interval, after the host has synced anyway), so timing costs no extra sync.

`communication` is the exposed part of gradient reduction: from the moment the last gradient
of the step is computed until backward returns (DDP waits there for its last all-reduce).
(Wall-clock timing of whole steps: runtime/clock.py.)
"""

from __future__ import annotations

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

    def split_ms(self) -> dict[str, float]:
        """This step's split as people read it (`split`)."""
        return split(self.seconds())


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
