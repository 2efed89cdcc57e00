"""Clocks for one bench cell: step times and all-reduce bandwidth (the split of a step comes
from the trainer's own phase times).

Every timing waits for the device first (CUDA kernels are asynchronous), so a time is what
the step cost, not when it was queued.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


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


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the tensors this rank holds — its local shard of a sharded (DTensor) one — each
    storage counted once."""
    storages: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer state tensors this rank keeps (ZeRO-1: those of its own parameters)."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    return [v for state in local.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def gradient_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


RAW_REPEATS = 8  # timed all-reduces of a raw tensor the size of the gradients


def raw_allreduce_ms(nbytes: int, device: torch.device, repeats: int = RAW_REPEATS) -> float:
    """Median time of torch.distributed.all_reduce on one fp32 tensor of `nbytes`."""
    tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(tensor)  # warm-up: connections, buffers
    return statistics.median(_timed(lambda: dist.all_reduce(tensor), device) for _ in range(repeats)) * 1000


class CommTimer:
    """A DDP comm hook that all-reduces like DDP's own and notes when each bucket's reduction
    starts and ends, giving the span of gradient communication within a step."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.spans: list[float] = []

    def hook(self, state, bucket):  # noqa: ANN001, ANN201 -- DDP checks real (not string) annotations
        self.starts.append(time.perf_counter())
        tensor = bucket.buffer().div_(dist.get_world_size())
        future = dist.all_reduce(tensor, async_op=True).get_future()

        def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
            self.ends.append(time.perf_counter())
            return fut.value()[0]

        return future.then(done)

    def end_step(self) -> None:
        if self.starts and self.ends:
            self.spans.append(max(self.ends) - min(self.starts))
        self.starts.clear()
        self.ends.clear()
