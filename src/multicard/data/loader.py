"""In-memory loaders: uint8 images kept on the training device, batches made there.

Training batches follow `ShardedBatchSampler`; evaluation reads this rank's `eval_shard`.
Augmentation and normalisation run batched on the device, so the input pipeline stays cheap.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from multicard.data.augment import crop_flip
from multicard.data.sampling import ShardedBatchSampler, eval_shard


@dataclass(frozen=True)
class Augment:
    padding: int
    flip: bool


class TensorImages:
    """Images (uint8, N×C×H×W) and labels on one device, normalised on the way out."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        mean: Sequence[float],
        std: Sequence[float],
        device: torch.device,
    ) -> None:
        self.images = images.to(device)
        self.labels = labels.to(device)
        self.device = device
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1) * 255
        self.inv_std = 1 / (torch.tensor(std, device=device).view(1, -1, 1, 1) * 255)

    def __len__(self) -> int:
        return self.labels.numel()

    def batch(
        self, indices: torch.Tensor, augment: Augment | None = None, seed: int = 0, epoch: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        on_device = indices.to(self.device, non_blocking=True)
        x = self.images.index_select(0, on_device)
        if augment is not None:
            x = crop_flip(x, indices, seed, epoch, augment.padding, augment.flip)
        x = (x.float() - self.mean) * self.inv_std
        return x, self.labels.index_select(0, on_device)


class TrainLoader:
    """Yields (x, y) micro-batches of this rank for one epoch; call set_epoch first."""

    def __init__(self, data: TensorImages, sampler: ShardedBatchSampler, augment: Augment | None, seed: int):
        self.data = data
        self.sampler = sampler
        self.augment = augment
        self.seed = seed

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_step)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for indices in self.sampler:
            yield self.data.batch(indices, self.augment, self.seed, self.sampler.epoch)


class EvalLoader:
    """Yields (x, y) batches of this rank's share of the evaluation set, each sample once."""

    def __init__(self, data: TensorImages, batch_size: int, rank: int, world_size: int):
        self.data = data
        self.batch_size = batch_size
        self.shard = eval_shard(len(data), rank, world_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(self.shard.start, self.shard.stop, self.batch_size):
            stop = min(start + self.batch_size, self.shard.stop)
            yield self.data.batch(torch.arange(start, stop))
