"""Batched augmentation whose randomness is a function of (seed, epoch, sample index) only.

That makes a sample's augmented pixels independent of which rank or batch reads it, so
runs with different world sizes see identical global batches.
"""

from __future__ import annotations

import numpy as np
import torch

from multicard.data.loading.transfer import to_device

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser: a well-spread 64-bit hash of each element."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (x ^ (x >> np.uint64(31))) & _MASK


def sample_random(seed: int, epoch: int, indices: torch.Tensor, stream: int) -> np.ndarray:
    """Uniform uint64 per index, reproducible from (seed, epoch, index, stream)."""
    key = _mix(np.array([seed, epoch, stream], dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    with np.errstate(over="ignore"):
        base = _mix(key[0] ^ _mix(key[1] ^ _mix(key[2])))
        return _mix(indices.numpy().astype(np.uint64) + base)


def crop_flip(
    images: torch.Tensor, indices: torch.Tensor, seed: int, epoch: int, padding: int, flip: bool
) -> torch.Tensor:
    """Random crop after zero padding, and a horizontal flip with probability 1/2.

    `images` is uint8 (N, C, H, W) on any device; `indices` (on CPU) are the dataset indices.
    The crop and the flip are one pair of gathers (rows, then columns read in either order),
    which is several times faster than advanced indexing.
    """
    if not padding and not flip:
        return images
    n, c, h, w = images.shape
    device = images.device
    span = 2 * padding + 1
    oy = torch.from_numpy((sample_random(seed, epoch, indices, 1) % span).astype(np.int64))
    ox = torch.from_numpy((sample_random(seed, epoch, indices, 2) % span).astype(np.int64))
    cols = torch.arange(w).view(1, w).expand(n, w)
    if flip:
        flips = torch.from_numpy((sample_random(seed, epoch, indices, 3) & np.uint64(1)).astype(bool))
        cols = torch.where(flips.view(n, 1), w - 1 - cols, cols)
    cols = to_device(cols + ox.view(n, 1), device)
    rows = to_device(oy.view(n, 1) + torch.arange(h), device)
    padded = torch.nn.functional.pad(images, (padding,) * 4) if padding else images
    out = padded.gather(2, rows.view(n, 1, h, 1).expand(n, c, h, w + 2 * padding))
    return out.gather(3, cols.view(n, 1, 1, w).expand(n, c, h, w))
