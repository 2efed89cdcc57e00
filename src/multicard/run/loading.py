"""`run.loader(dataset)`: this rank's micro-batches of a user's dataset, on the device.

The sampler is the command line's (data.sampling.ShardedBatchSampler): an epoch's order is a
function of (seed, epoch), each optimizer step takes the same global batch at any world size,
a micro-step a contiguous slice of it and each rank its part of that slice; a resumed epoch
starts at the step it stopped at. Iterating the loader also tells the run which micro-step
each batch belongs to, so a micro-step whose gradients are not reduced runs its forward and
backward inside the strategy's no_sync (DDP decides at the forward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import default_collate

from multicard.data.loading.keyed import KeyedSamples, Transform, move_to
from multicard.data.loading.sampling import BatchSplit, ShardedBatchSampler, eval_batches
from multicard.data.loading.workers import EpochKeys, EvalKeys, data_loader
from multicard.engine.phases import DATA, FORWARD
from multicard.runtime.process_group import ProcessContext


class MicroSteps(Protocol):
    """What a loader tells its run while it is iterated."""

    def begin_micro(self, micro: int) -> None: ...

    def end_micro(self) -> None: ...

    def enter(self, phase: str) -> None: ...

    def settle(self) -> None:
        """The user's code for the previous step has run (its checkpoint, an agreed stop)."""


class Loader:
    """This rank's micro-batches of the run's current epoch, from `run.loader(dataset)`; iterate it
    inside `for epoch in run.epochs(N)`."""

    def __init__(
        self, dataset: Any, transform: Transform | None, collate_fn: Callable | None, num_workers: int,
        split: BatchSplit, ctx: ProcessContext, seed: int, steps: MicroSteps, floats: torch.dtype,
    ) -> None:  # fmt: skip
        self.split, self.ctx, self.steps, self.floats = split, ctx, steps, floats
        self.sampler = ShardedBatchSampler(len(dataset), split, ctx.rank, seed)
        samples = KeyedSamples(dataset, transform, seed)
        collate = collate_fn or default_collate
        self.loader = data_loader(samples, EpochKeys(self.sampler), num_workers, ctx.device, seed, ctx.rank, collate)
        self.last_step = self.steps_per_epoch  # where this epoch's steps end (a run's max_steps may cut one)

    @property
    def num_samples(self) -> int:
        return self.sampler.num_samples

    @property
    def steps_per_epoch(self) -> int:
        return self.split.steps_per_epoch(self.sampler.num_samples)

    def set_epoch(self, epoch: int, start_step: int, last_step: int) -> None:
        self.sampler.set_epoch(epoch, start_step)
        self.last_step = last_step

    def __len__(self) -> int:
        """Micro-batches left in this epoch on this rank."""
        return max(0, self.last_step - self.sampler.start_step) * self.split.grad_accum

    def __iter__(self) -> Iterator[Any]:
        accum, left = self.split.grad_accum, len(self)
        if left == 0:
            return
        batches = iter(self.loader)
        try:
            for n in range(left):
                self.steps.end_micro()
                self.steps.settle()
                self.steps.enter(DATA)
                batch = move_to(next(batches), self.ctx.device, self.floats)
                self.steps.begin_micro(n % accum)
                self.steps.enter(FORWARD)
                yield batch
        finally:
            self.steps.end_micro()

    def close(self) -> None:
        from multicard.data.loading.workers import shutdown_workers

        shutdown_workers(self.loader)


def eval_loader(
    dataset: Any, batch_size: int, transform: Transform | None, collate_fn: Callable | None, num_workers: int,
    ctx: ProcessContext, seed: int,
) -> Any:  # fmt: skip
    """This rank's share of `dataset` in batches, each sample once over all ranks, as many batches
    on every rank (a DataLoader; batches stay on the CPU until moved)."""
    keys = EvalKeys(eval_batches(len(dataset), ctx.rank, ctx.world_size, batch_size))
    samples = KeyedSamples(dataset, transform, seed)
    return data_loader(samples, keys, num_workers, ctx.device, seed, ctx.rank, collate_fn or default_collate)
