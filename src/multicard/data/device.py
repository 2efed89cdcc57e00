"""The device loader: uint8 images kept on the training device, batches made there.

Training batches follow `ShardedBatchSampler`; evaluation reads this rank's `eval_shard`.
Gathering, crop/flip and normalisation run batched on the device, so the input pipeline costs
a few kernels per batch and never decodes an image twice.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from multicard.data.augment import crop_flip
from multicard.data.sampling import ShardedBatchSampler, eval_shard
from multicard.data.sources import InMemory
from multicard.data.transfer import to_device


@dataclass(frozen=True)
class Augment:
    """The small-image recipe: random crop after zero padding, horizontal flip."""

    padding: int
    flip: bool


class DeviceBatches:
    """Turns uint8 batches into float training input on the device: crop/flip, then normalise."""

    def __init__(
        self, mean: Sequence[float], std: Sequence[float], device: torch.device, augment: Augment | None, seed: int
    ) -> None:
        self.device = device
        self.augment = augment
        self.seed = seed
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1) * 255
        self.inv_std = 1 / (torch.tensor(std, device=device).view(1, -1, 1, 1) * 255)

    def __call__(
        self, x: torch.Tensor, y: torch.Tensor, indices: torch.Tensor, epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`indices` (CPU) are the samples' dataset indices: they, not the batch, key the randomness."""
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        if self.augment is not None:
            x = crop_flip(x, indices, self.seed, epoch, self.augment.padding, self.augment.flip)
        return (x.float() - self.mean) * self.inv_std, y


class TensorImages:
    """A decoded dataset resident on one device."""

    def __init__(self, source: InMemory, device: torch.device) -> None:
        self.images = source.images.to(device)
        self.labels = source.labels.to(device)
        self.device = device

    def __len__(self) -> int:
        return self.labels.numel()

    def gather(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        on_device = to_device(indices, self.device)
        return self.images.index_select(0, on_device), self.labels.index_select(0, on_device)


class DeviceTrainLoader:
    """Yields (x, y) micro-batches of this rank for one epoch; call set_epoch first."""

    def __init__(self, data: TensorImages, sampler: ShardedBatchSampler, finish: DeviceBatches):
        self.data = data
        self.sampler = sampler
        self.finish = finish

    @property
    def num_samples(self) -> int:
        return len(self.data)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_step)

    def __len__(self) -> int:
        return len(self.sampler)

    def close(self) -> None:
        pass

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for indices in self.sampler:
            yield self.finish(*self.data.gather(indices), indices, self.sampler.epoch)


class DeviceEvalLoader:
    """Yields (x, y) batches of this rank's share of the evaluation set, each sample once."""

    def __init__(self, data: TensorImages, batch_size: int, rank: int, world_size: int, finish: DeviceBatches):
        self.data = data
        self.batch_size = batch_size
        self.shard = eval_shard(len(data), rank, world_size)
        self.finish = finish

    def close(self) -> None:
        pass

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(self.shard.start, self.shard.stop, self.batch_size):
            indices = torch.arange(start, min(start + self.batch_size, self.shard.stop))
            yield self.finish(*self.data.gather(indices), indices, 0)
