"""Crop geometry of the large-image recipe, computed on the image's full size before decoding.

Training: torchvision's RandomResizedCrop semantics (area fraction uniform in `scale`, aspect
ratio log-uniform in `ratio`, 10 attempts, then a centre crop clamped to `ratio`), drawn from
numbers keyed by (seed, epoch, index). Evaluation: torchvision's Resize(shorter side) +
CenterCrop geometry. Knowing the box before decoding lets a JPEG be decoded at reduced scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from multicard.data.augmentation.augment import sample_random

RATIO = (3 / 4, 4 / 3)
ATTEMPTS = 10
DRAWS = ATTEMPTS * 4 + 1  # four numbers per attempt, then the flip
CROP_STREAM = 4  # sample_random stream of the large-image crop and flip


@dataclass(frozen=True)
class Box:
    """A crop in pixels of the full image: columns left..left+width, rows top..top+height."""

    left: int
    top: int
    width: int
    height: int

    @property
    def corners(self) -> tuple[int, int, int, int]:
        """(left, top, right, bottom), as Pillow's crop and resize take a box."""
        return self.left, self.top, self.left + self.width, self.top + self.height


def crop_uniforms(seed: int, epoch: int, index: int) -> np.ndarray:
    """DRAWS uniforms in [0, 1) for sample `index`: number j hashes (seed, epoch, DRAWS·index + j)."""
    counters = torch.arange(DRAWS * index, DRAWS * (index + 1))
    bits = sample_random(seed, epoch, counters, stream=CROP_STREAM) >> np.uint64(11)
    return bits.astype(np.float64) * 2.0**-53  # the top 53 bits: a double in [0, 1)


def random_resized_box(
    width: int, height: int, scale: tuple[float, float], uniforms: np.ndarray, ratio: tuple[float, float] = RATIO
) -> Box:
    """The crop RandomResizedCrop would take, with its random draws replaced by `uniforms`.

    Each attempt uses four numbers: area fraction, log aspect ratio, then row and column offset.
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for attempt in range(ATTEMPTS):
        u_area, u_ratio, u_top, u_left = (float(u) for u in uniforms[4 * attempt : 4 * attempt + 4])
        target = area * (scale[0] + (scale[1] - scale[0]) * u_area)
        aspect = math.exp(log_lo + (log_hi - log_lo) * u_ratio)
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return Box(int(u_left * (width - w + 1)), int(u_top * (height - h + 1)), w, h)
    # No attempt fitted: the largest centred crop whose aspect ratio lies within `ratio`.
    w, h = width, height
    if width / height < ratio[0]:
        h = round(width / ratio[0])
    elif width / height > ratio[1]:
        w = round(height * ratio[1])
    return Box((width - w) // 2, (height - h) // 2, w, h)


def resized_size(width: int, height: int, shorter: int) -> tuple[int, int]:
    """(width, height) after torchvision's Resize(shorter): the shorter side becomes `shorter`."""
    if width <= height:
        return shorter, int(shorter * height / width)
    return int(shorter * width / height), shorter


def centre_region(width: int, height: int, shorter: int, size: int) -> tuple[float, float, float, float]:
    """The part of the full image that Resize(shorter) + CenterCrop(size) keeps, in its own pixels.

    Resampling this region straight to size × size samples the same points with the same
    filter width as resizing the whole image and then cropping.
    """
    new_width, new_height = resized_size(width, height, shorter)
    left, top = int(round((new_width - size) / 2)), int(round((new_height - size) / 2))
    sx, sy = width / new_width, height / new_height
    return left * sx, top * sy, (left + size) * sx, (top + size) * sy


def flips(uniforms: np.ndarray) -> bool:
    """The horizontal flip of a sample: its last draw (after the crop's) below one half."""
    return uniforms[-1] < 0.5
