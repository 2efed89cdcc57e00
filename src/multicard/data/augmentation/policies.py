"""Per-sample augmentation policies from torchvision.transforms.v2, drawn per (seed, epoch, index).

TrivialAugmentWide, RandAugment, AutoAugment (ImageNet policy), colour jitter and random erasing
are torchvision's own; what multicard adds is where their random draws come from. torchvision
draws an op's parameters from torch's CPU generator, so each sample's call runs with that
generator seeded from the sample's key: the same image gets the same ops whichever rank, batch,
worker or loader holds it. They run on the training device after the crop and flip, on each
sample of a uint8 batch (random erasing: on the normalised floats, as torchvision's recipes do),
so both loaders share them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from multicard.base.config import DataConfig
from multicard.data.augmentation.augment import sample_random

POLICY_STREAM, JITTER_STREAM, ERASING_STREAM = 4, 5, 6  # apart from crop (1, 2) and flip (3)


def _policy(d: DataConfig) -> Any:
    from torchvision.transforms import v2  # here: the command line starts without torchvision

    if d.policy == "trivialaugment":
        return v2.TrivialAugmentWide()
    if d.policy == "randaugment":
        return v2.RandAugment(num_ops=d.policy_ops, magnitude=d.policy_magnitude)
    if d.policy == "autoaugment":
        return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET)
    return None


def each_keyed(
    batch: torch.Tensor, keys: np.ndarray, transform: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`transform` of every sample, torch's CPU generator seeded with the sample's key for its call
    (and restored after: the loop's own draws are not disturbed)."""
    threads = torch.get_num_threads()
    if batch.device.type == "cpu":
        torch.set_num_threads(1)  # ops on one small image: threads would only wait for each other (~10×)
    try:
        with torch.random.fork_rng(devices=[]):
            out = []
            for image, key in zip(batch, keys.tolist(), strict=True):
                torch.default_generator.manual_seed(key)
                out.append(transform(image))
    finally:
        torch.set_num_threads(threads)
    return torch.stack(out)


def sample_policy(d: DataConfig, seed: int) -> SamplePolicy | None:
    """The training batches' per-sample ops the data section asks for; None for none."""
    wanted = d.policy != "none" or d.color_jitter > 0 or d.random_erasing > 0
    return SamplePolicy(d, seed) if d.augment and wanted else None


class SamplePolicy:
    """The per-sample ops of a training batch: `pixels` on uint8 images, `erase` on the floats."""

    def __init__(self, d: DataConfig, seed: int) -> None:
        from torchvision.transforms import v2

        self.seed = seed
        self.policy = _policy(d)
        j = d.color_jitter
        self.jitter = v2.ColorJitter(brightness=j, contrast=j, saturation=j) if j > 0 else None
        self.erasing = v2.RandomErasing(p=d.random_erasing) if d.random_erasing > 0 else None

    def pixels(self, images: torch.Tensor, indices: torch.Tensor, epoch: int) -> torch.Tensor:
        for stream, op in ((POLICY_STREAM, self.policy), (JITTER_STREAM, self.jitter)):
            if op is not None:
                images = each_keyed(images, sample_random(self.seed, epoch, indices, stream), op)
        return images

    def erase(self, images: torch.Tensor, indices: torch.Tensor, epoch: int) -> torch.Tensor:
        if self.erasing is None:
            return images
        return each_keyed(images, sample_random(self.seed, epoch, indices, ERASING_STREAM), self.erasing)
