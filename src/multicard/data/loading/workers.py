"""The workers loader: torch DataLoader processes decode and transform images per sample.

For datasets too large for memory or images too large to keep decoded. Batches follow the
same `ShardedBatchSampler` as the device loader, and each sample's randomness is keyed by
(seed, epoch, index), so batches depend neither on the world size nor on the worker count.
Workers hand over uint8 tensors (4× less to copy than floats); normalisation, and the
small-image crop/flip, run on the training device in `DeviceTransform`.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from multicard.base.errors import UserError
from multicard.data.augmentation.augment import sample_random
from multicard.data.augmentation.device_transform import Finish
from multicard.data.augmentation.transforms import Picture
from multicard.data.decoding.decode import read_image
from multicard.data.loading.loaders import SampledTrainLoader
from multicard.data.loading.sampling import ShardedBatchSampler, eval_batches
from multicard.data.sources.folders import Files, Items, Source
from multicard.data.sources.shards import prefetch_items
from multicard.data.sources.user import read_item

# (uint8 (3, H, W) image, or a file read but not decoded, epoch, index) → uint8 image (or, under
# data.decode=gpu, a JPEG's bytes with its crop: jpeg_crop.JpegTransform)
Transform = Callable[[Picture, int, int], Any]


class SourceImages(Dataset):
    """(epoch, index) → (transformed uint8 image, label, index)."""

    def __init__(self, source: Source, transform: Transform) -> None:
        self.source = source
        self.transform = transform

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`index` may name a repeated copy (data.repeats: copy j of sample i is j·N + i): the copy
        keys the augmentation, the sample is read."""
        epoch, index = key
        src = self.source
        sample = index % len(src)
        if isinstance(src, Items):
            image, label = read_item(src, sample)
        elif isinstance(src, Files):
            image, label = read_image(src.root / src.paths[sample]), src.labels[sample]
        else:
            image, label = src.images[sample], src.labels[sample]
        return self.transform(image, epoch, index), label, index

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """A batch (DataLoader asks for one at a time): packed shards first fetch its bytes together."""
        prefetch_items(self.source, [index % len(self.source) for _, index in keys])
        return [self[key] for key in keys]


class Keys:
    """A batch sampler for DataLoader that can be held `idle` (it then yields no batch)."""

    idle = False

    def batches(self) -> Iterator[list[tuple[int, int]]]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        return iter(()) if self.idle else self.batches()


class EpochKeys(Keys):
    """Each index travels with its epoch, which keys its randomness."""

    def __init__(self, sampler: ShardedBatchSampler) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def batches(self) -> Iterator[list[tuple[int, int]]]:
        for indices in self.sampler:
            yield [(self.sampler.epoch, i) for i in indices.tolist()]


class EvalKeys(Keys):
    def __init__(self, ranges: list[range]) -> None:
        self.ranges = ranges

    def __len__(self) -> int:
        return len(self.ranges)

    def batches(self) -> Iterator[list[tuple[int, int]]]:
        for batch in self.ranges:
            yield [(0, i) for i in batch]


def _init_worker(seed: int, rank: int, worker_id: int) -> None:
    """Seed the worker, and keep it out of its training process's group.

    Launchers and terminals signal whole process groups; a worker that died on SIGTERM or
    Ctrl-C would break the step its training process finishes before checkpointing. In a group of its
    own it still ends with the training process (normal shutdown, or DataLoader's watchdog when the
    training process is gone) and can still be terminated directly.
    """
    os.setpgid(0, 0)
    # Distinct, reproducible streams per (seed, rank, worker) for any library-level randomness.
    key = int(sample_random(seed, rank, torch.tensor([worker_id]), stream=5)[0])
    torch.manual_seed(key)
    random.seed(key)
    np.random.seed(key % 2**32)


def data_loader(
    dataset: Dataset, keys: Keys, num_workers: int, device: torch.device, seed: int, rank: int,
    collate: Callable[[list[Any]], Any] | None = None,
) -> DataLoader:
    loader = DataLoader(
        dataset,
        batch_sampler=keys,
        num_workers=num_workers,
        collate_fn=collate,  # None: torch's default; data.decode=gpu: encoded JPEGs (jpeg_crop.collate_encoded)
        pin_memory=device.type == "cuda",
        persistent_workers=num_workers > 0,
        worker_init_fn=partial(_init_worker, seed, rank) if num_workers > 0 else None,
    )
    if num_workers > 0:
        _start_workers(loader, keys)
    return loader


def _start_workers(loader: DataLoader, keys: Keys) -> None:
    """Start the loader processes now, while the run is being built, not at the first batch.

    A process forked while another thread of its parent holds one of the interpreter's locks
    can hang before running any code (seen with CPython 3.11: a loader process stuck in
    PyOS_AfterFork_Child while its training process waited for its first evaluation batch). While the run
    is built, this process runs no thread of ours and no collective is in flight. The persistent
    workers then serve every epoch; idle keys meanwhile, so no batch is prepared for nothing.
    """
    keys.idle = True
    try:
        iter(loader)
    finally:
        keys.idle = False


def shutdown_workers(loader: DataLoader) -> None:
    """Stop persistent workers now rather than whenever the loader is garbage-collected."""
    iterator = getattr(loader, "_iterator", None)  # DataLoader keeps persistent workers here
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        loader._iterator = None


def _batches(loader: DataLoader, finish: Finish, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    try:
        for x, y, indices in loader:
            yield finish(x, y, indices, epoch)
    except UserError as exc:
        # DataLoader re-raises a worker's exception with the worker's traceback in its message.
        raise UserError(str(exc).strip().splitlines()[-1].split("UserError: ", 1)[-1]) from None


class WorkerTrainLoader(SampledTrainLoader):
    """Yields (x, y) micro-batches of this rank for one epoch; call set_epoch first."""

    def __init__(
        self,
        source: Source,
        transform: Transform,
        sampler: ShardedBatchSampler,
        finish: Finish,
        num_workers: int,
        seed: int,
        rank: int,
        collate: Callable | None = None,
    ) -> None:
        super().__init__(sampler)
        self.finish = finish
        dataset = SourceImages(source, transform)
        self.loader = data_loader(dataset, EpochKeys(sampler), num_workers, finish.device, seed, rank, collate)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return _batches(self.loader, self.finish, self.sampler.epoch)

    def close(self) -> None:
        shutdown_workers(self.loader)


class WorkerEvalLoader:
    """Yields (x, y) batches of this rank's share of the evaluation set, each sample once."""

    def __init__(
        self,
        source: Source,
        transform: Transform,
        batch_size: int,
        rank: int,
        world_size: int,
        finish: Finish,
        num_workers: int,
        seed: int,
        collate: Callable | None = None,
    ) -> None:
        self.finish = finish
        keys = EvalKeys(eval_batches(len(source), rank, world_size, batch_size))
        dataset = SourceImages(source, transform)
        self.loader = data_loader(dataset, keys, num_workers, finish.device, seed, rank, collate)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return _batches(self.loader, self.finish, 0)

    def close(self) -> None:
        shutdown_workers(self.loader)
