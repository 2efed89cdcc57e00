"""What a run asks of the data layer's loaders, whichever kind they are (device or workers)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from multicard.data.loading.sampling import ShardedBatchSampler

Batch = tuple[torch.Tensor, torch.Tensor]  # (input on the device, labels on the device)


class TrainLoader(Protocol):
    """This rank's micro-batches of one epoch, from a given optimizer step on."""

    @property
    def num_samples(self) -> int: ...

    def set_epoch(self, epoch: int, start_step: int = 0) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Batch]: ...

    def close(self) -> None: ...


class EvalLoader(Protocol):
    """This rank's share of the evaluation set, each sample once."""

    def __iter__(self) -> Iterator[Batch]: ...

    def close(self) -> None: ...


class GeneratedBatches:
    """A training loader of `steps` micro-batches of `batch` samples that `make()` returns, with no
    source or sampler behind them: the data of a tool's run that traces or times the model's step."""

    def __init__(self, make: Callable[[], Batch], batch: int, steps: int) -> None:
        self.make, self.num_samples, self.steps = make, batch * steps, steps

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        pass  # every batch is made anew

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Batch]:
        return (self.make() for _ in range(self.steps))

    def close(self) -> None:
        pass


class SampledTrainLoader:
    """Base of both training loaders: the epoch, its start step and the sample count live in
    the sampler, which decides the batches."""

    def __init__(self, sampler: ShardedBatchSampler) -> None:
        self.sampler = sampler

    @property
    def num_samples(self) -> int:
        return self.sampler.num_samples

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_step)

    def __len__(self) -> int:
        return len(self.sampler)
