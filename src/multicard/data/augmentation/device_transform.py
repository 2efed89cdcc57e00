"""The last step of every loader, on the training device: crop/flip (small images), the
per-sample policies (policies.py), normalise, the epoch's size (progressive.py), random erasing.

Both loaders hand over uint8 batches with their dataset indices; the indices, not the batch,
key the randomness, so a sample is augmented alike whichever rank or loader reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from multicard.data.augmentation.augment import crop_flip
from multicard.data.augmentation.policies import SamplePolicy
from multicard.data.augmentation.progressive import ProgressiveSize


@dataclass(frozen=True)
class Augment:
    """The small-image recipe: random crop after zero padding, horizontal flip."""

    padding: int
    flip: bool


class Finish(Protocol):
    """What a loader hands each batch to on the training device: a DeviceTransform (uint8 pixels), or
    data.decode=gpu's GpuDecode (the workers' encoded batches)."""

    device: torch.device

    def __call__(
        self, x: Any, y: torch.Tensor, indices: torch.Tensor, epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class DeviceTransform:
    """Turns uint8 batches into float training input on the device: crop/flip, policies, normalise."""

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        device: torch.device,
        augment: Augment | None,
        seed: int,
        policy: SamplePolicy | None = None,
        sizes: ProgressiveSize | None = None,
    ) -> None:
        self.device = device
        self.augment = augment
        self.seed = seed
        self.policy = policy
        self.sizes = sizes
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1) * 255
        self.inv_std = 1 / (torch.tensor(std, device=device).view(1, -1, 1, 1) * 255)

    def __call__(
        self, x: torch.Tensor, y: torch.Tensor, indices: torch.Tensor, epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`indices` (CPU) are the samples' dataset indices."""
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        if self.augment is not None:
            x = crop_flip(x, indices, self.seed, epoch, self.augment.padding, self.augment.flip)
        if self.policy is not None:
            x = self.policy.pixels(x.to(torch.uint8), indices, epoch)  # GPU decoding hands over whole floats
        x = (x.float() - self.mean) * self.inv_std
        if self.sizes is not None and x.shape[-1] != self.sizes(epoch):  # small images, or GPU-decoded crops
            x = F.interpolate(x, size=(self.sizes(epoch),) * 2, mode="bilinear", antialias=True, align_corners=False)
        return (self.policy.erase(x, indices, epoch) if self.policy is not None else x), y
