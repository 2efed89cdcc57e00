"""A user's map-style dataset read by (epoch, index), with per-sample randomness keyed by them.

`KeyedSamples` serves `multicard.Run`'s loaders: `dataset[index]`, then the user's
`transform(sample, generator)`, whose generator is seeded from (seed, epoch, index) alone — so
an augmented sample is the same whichever rank, worker or world size reads it, and a resumed
epoch draws exactly what the uninterrupted one drew.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from multicard.base.errors import UserError
from multicard.data.augmentation.augment import sample_random
from multicard.data.loading.transfer import to_device

USER_STREAM = 0x75736572  # "user": apart from the streams of multicard's own augmentations
Transform = Callable[[Any, torch.Generator], Any]


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """The generator a transform draws sample `index`'s randomness from in `epoch`."""
    key = int(sample_random(seed, epoch, torch.tensor([index]), USER_STREAM)[0]) >> 1  # manual_seed: < 2**63
    return torch.Generator().manual_seed(key)


def check_map_style(dataset: Any, what: str) -> int:
    """The dataset's length, or a one-line error for what a sampler cannot index."""
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise UserError(
            f"{what} needs a map-style dataset (len(dataset) and dataset[i]); got {type(dataset).__name__}, "
            f"which multicard cannot split by sample index into the same global batches at any world size — "
            f"wrap its items in a list or a torch.utils.data.Dataset"
        )
    return len(dataset)


class KeyedSamples(Dataset):
    """(epoch, index) → transform(dataset[index], generator keyed by (seed, epoch, index))."""

    def __init__(self, dataset: Any, transform: Transform | None, seed: int) -> None:
        self.dataset = dataset
        self.transform = transform
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        sample = self.dataset[index]
        if self.transform is None:
            return sample
        return self.transform(sample, sample_generator(self.seed, epoch, index))


def move_to(batch: Any, device: torch.device, floats: torch.dtype = torch.float32) -> Any:
    """Every tensor of a batch (tensors, tuples, lists, dicts of them) on `device`; floating ones in
    `floats` where that is not float32 (a float64 run computes in float64 from its inputs on)."""
    if isinstance(batch, torch.Tensor):
        moved = to_device(batch, device)
        return moved.to(floats) if floats != torch.float32 and moved.is_floating_point() else moved
    if isinstance(batch, dict):
        return {k: move_to(v, device, floats) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [move_to(v, device, floats) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)  # namedtuples too
    return batch
