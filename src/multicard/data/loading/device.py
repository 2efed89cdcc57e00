"""The device loader: uint8 images kept on the training device, batches made there.

Training batches follow `ShardedBatchSampler`; evaluation reads this rank's `eval_shard`.
Gathering, crop/flip and normalisation run batched on the device, so the input pipeline costs
a few kernels per batch and never decodes an image twice.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from multicard.data.augmentation.device_transform import Finish
from multicard.data.loading.loaders import SampledTrainLoader
from multicard.data.loading.sampling import ShardedBatchSampler, eval_batches
from multicard.data.loading.transfer import to_device
from multicard.data.sources.folders import InMemory


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


class DeviceTrainLoader(SampledTrainLoader):
    """Yields (x, y) micro-batches of this rank for one epoch; call set_epoch first."""

    def __init__(self, data: TensorImages, sampler: ShardedBatchSampler, finish: Finish):
        super().__init__(sampler)
        self.data = data
        self.finish = finish

    def close(self) -> None:
        pass

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for indices in self.sampler:  # a repeated copy (data.repeats) reads its sample, keys its own draws
            yield self.finish(*self.data.gather(indices % self.sampler.num_samples), indices, self.sampler.epoch)


class DeviceEvalLoader:
    """Yields (x, y) batches of this rank's share of the evaluation set, each sample once."""

    def __init__(self, data: TensorImages, batch_size: int, rank: int, world_size: int, finish: Finish):
        self.data = data
        self.batches = eval_batches(len(data), rank, world_size, batch_size)
        self.finish = finish

    def close(self) -> None:
        pass

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self.batches:
            indices = torch.arange(batch.start, batch.stop)
            yield self.finish(*self.data.gather(indices), indices, 0)
