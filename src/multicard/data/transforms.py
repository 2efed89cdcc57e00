"""Per-image transforms run inside loader workers; randomness keyed by (seed, epoch, index).

Small images are only brought to a fixed size here (their crop/flip runs batched on the
device, the same code as the device loader). Large images follow the usual recipe: random
resized crop + flip for training, resize + centre crop for evaluation.
"""

from __future__ import annotations

import torch
from torchvision.transforms import v2

from multicard.data.augment import sample_random
from multicard.data.decode import fit_square

SMALL_IMAGE_MAX = 64  # images up to this side use the small-image recipe (crop with padding)


def is_small(image_size: int) -> bool:
    return image_size <= SMALL_IMAGE_MAX


class FitSquare:
    """Resize the shorter side and centre-crop: small images (any split), large evaluation images."""

    def __init__(self, size: int, resize: int | None = None) -> None:
        self.size = size
        self.resize = resize or size

    def __call__(self, image: torch.Tensor, epoch: int, index: int) -> torch.Tensor:
        if self.resize == self.size:
            return fit_square(image, self.size)
        return v2.functional.center_crop(v2.functional.resize(image, [self.resize], antialias=True), [self.size])


class RandomResizedCropFlip:
    """Training transform for large images, reproducible per (seed, epoch, index)."""

    def __init__(self, size: int, scale: tuple[float, float], flip: bool, seed: int) -> None:
        self.crop = v2.RandomResizedCrop(size, scale=scale, antialias=True)
        self.flip = flip
        self.seed = seed

    def __call__(self, image: torch.Tensor, epoch: int, index: int) -> torch.Tensor:
        key = int(sample_random(self.seed, epoch, torch.tensor([index]), stream=4)[0])
        with torch.random.fork_rng(devices=[]):  # leaves the process's own stream untouched
            torch.manual_seed(key)
            image = self.crop(image)
        if self.flip and key >> 63:
            image = image.flip(-1)
        return image
