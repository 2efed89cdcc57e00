"""What a tool reads off a run it drives (bench's cells, plan's --measure, input-split): the time
of each step and its phase split (`StepTimer`, a callback of the run's loop), the bytes each rank
holds (`HeldState`), when DDP's gradient all-reduces run within a step, and what a bare all-reduce
of the gradients' size takes (bench and plan compare communication with it)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from multicard.run import Callback, Loop, StepEnd
from multicard.runtime.clock import StepClock, sync


class StepTimer(Callback):
    """Wall time of every optimizer step after `warmup` steps, and that step's phase split (from the
    loop's phase marks)."""

    def __init__(self, warmup: int = 0, last: int | None = None) -> None:
        self.clock = StepClock(torch.device("cpu"), warmup)  # on the run's device once it starts
        self.last = last  # the last step timed (later steps run untimed: bench's communication probe)
        self.splits: list[dict[str, float]] = []  # of the timed steps

    @property
    def times(self) -> list[float]:
        """Seconds of each timed step."""
        return self.clock.times

    def on_fit_start(self, loop: Loop) -> None:
        self.clock.device = loop.strategy.ctx.device
        self.clock.restart()

    def on_step_end(self, loop: Loop, step: StepEnd) -> None:
        if self.last is not None and step.global_step > self.last:
            return
        timed = self.clock.seen >= self.clock.warmup
        self.clock()
        if timed:
            self.splits.append(step.times.split_ms())

    def breakdown(self) -> dict[str, float]:
        """Median of each part of the split over the timed steps (ms)."""
        return {k: statistics.median(s[k] for s in self.splits) for k in self.splits[0]} if self.splits else {}

    def fastest_split(self) -> dict[str, float]:
        """The split of the fastest timed step (the one least disturbed by other work)."""
        if not self.times:
            return {}
        return self.splits[min(range(len(self.times)), key=self.times.__getitem__)]


class HeldState(Callback):
    """MiB of parameters, gradients and optimizer state this rank holds, read once a step's
    gradients exist (optimizer state is there from the second step on)."""

    def __init__(self) -> None:
        self.mib: dict[str, float] = {}

    def on_gradients(self, loop: Loop) -> None:
        if loop.position.global_step < 1 or self.mib:
            return  # once: not on steps that are timed after it
        params = list(loop.bare.parameters())
        self.mib = {
            "params": held_bytes(params) / 2**20,
            "grads": held_bytes(p.grad for p in params) / 2**20,
            "optimizer": held_bytes(optimizer_tensors(loop.optimizer)) / 2**20,
        }


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


class CommTimer:
    """A DDP comm hook that all-reduces like DDP's own and notes when each bucket's reduction
    starts and ends, giving the span of gradient communication within a step."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.spans: list[float] = []

    def hook(self, state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations; ours are strings
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


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


RAW_REPEATS = 8  # timed all-reduces of a raw tensor the size of the gradients


def raw_allreduce_ms(nbytes: int, device: torch.device, repeats: int = RAW_REPEATS) -> float:
    """Median time of torch.distributed.all_reduce on one fp32 tensor of `nbytes`."""
    tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(tensor)  # warm-up: connections, buffers
    return statistics.median(_timed(lambda: dist.all_reduce(tensor), device) for _ in range(repeats)) * 1000
