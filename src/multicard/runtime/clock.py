"""Wall-clock timing of whole steps, for everything that measures a loop (bench, plan, input-split,
the yardsticks): each timing waits for the device first (CUDA kernels are asynchronous), so a time
is what the work cost, not when it was queued."""

from __future__ import annotations

import statistics
import time

import torch


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
