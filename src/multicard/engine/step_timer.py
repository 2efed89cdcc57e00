"""The one step-timing callback of the tools that measure the loop (bench cells, plan's --measure):
wall time of every optimizer step after `warmup` steps, and that step's phase split."""

from __future__ import annotations

import statistics

import torch

from multicard.engine.loop import Callback, Loop, StepEnd
from multicard.engine.phases import StepClock, split


class StepTimer(Callback):
    def __init__(self, device: torch.device, warmup: int = 0) -> None:
        self.clock = StepClock(device, warmup)
        self.splits: list[dict[str, float]] = []  # of the timed steps, from the trainer's phase times

    @property
    def times(self) -> list[float]:
        """Seconds of each timed step."""
        return self.clock.times

    def on_fit_start(self, loop: Loop) -> None:
        self.clock.restart()

    def on_step_end(self, loop: Loop, step: StepEnd) -> None:
        timed = self.clock.seen >= self.clock.warmup
        self.clock()
        if timed:
            self.splits.append(split(step.times.seconds()))

    def breakdown(self) -> dict[str, float]:
        """Median of each part of the split over the timed steps (ms)."""
        return {k: statistics.median(s[k] for s in self.splits) for k in self.splits[0]} if self.splits else {}

    def fastest_split(self) -> dict[str, float]:
        """The split of the fastest timed step (the one least disturbed by other work)."""
        if not self.times:
            return {}
        return self.splits[min(range(len(self.times)), key=self.times.__getitem__)]
