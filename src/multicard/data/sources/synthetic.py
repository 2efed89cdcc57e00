"""The embedded dataset: procedurally drawn shapes, learnable, deterministic, no download.

Each image shows one of ten left-right symmetric shapes (so horizontal flips keep the label)
at a random position and scale, with random foreground and background colours whose contrast
sign is random, over a smooth gradient and pixel noise. Random placement and contrast polarity
defeat a linear classifier on pixels; a small CNN with pooling learns it quickly.
"""

from __future__ import annotations

import torch

CLASSES = (
    "disk", "ring", "square", "frame", "plus", "cross", "hbar", "vbar", "triangle", "checker",
)


def _shape_masks(labels: torch.Tensor, size: int, g: torch.Generator) -> torch.Tensor:
    """Float masks in [0, 1] of shape (N, H, W), one shape per label."""
    n = labels.numel()
    radius = size * (0.18 + 0.17 * torch.rand(n, generator=g))  # half-extent in pixels
    margin = radius * 0.6
    cx = margin + (size - 2 * margin) * torch.rand(n, generator=g)
    cy = margin + (size - 2 * margin) * torch.rand(n, generator=g)
    coords = torch.arange(size, dtype=torch.float32) + 0.5
    dx = (coords.view(1, 1, size) - cx.view(n, 1, 1)) / radius.view(n, 1, 1)
    dy = (coords.view(1, size, 1) - cy.view(n, 1, 1)) / radius.view(n, 1, 1)
    r = torch.sqrt(dx**2 + dy**2)
    adx, ady = dx.abs(), dy.abs()
    box = torch.maximum(adx, ady)
    thick = 0.3
    inside = (box <= 1)
    shapes = torch.stack(
        [
            r <= 1,                                              # disk
            (r <= 1) & (r >= 1 - 1.6 * thick),                   # ring
            (box <= 0.85),                                       # square
            (box <= 1) & (box >= 1 - 1.4 * thick),               # frame
            inside & ((adx <= thick) | (ady <= thick)),          # plus
            inside & ((dx - dy).abs() <= 1.4 * thick) | inside & ((dx + dy).abs() <= 1.4 * thick),
            (adx <= 1) & (ady <= 0.8 * thick),                   # hbar
            (ady <= 1) & (adx <= 0.8 * thick),                   # vbar
            (dy <= 0.8) & (dy >= -1) & (adx <= (dy + 1) / 1.8 * 1.0),  # upright triangle
            inside & ((dx > 0) == (dy > 0)),                     # 2x2 checker
        ],
        dim=0,
    ).float()  # (10, N, H, W)
    return shapes[labels, torch.arange(n)]


def make_synthetic(
    num_samples: int, image_size: int, seed: int, num_classes: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (images uint8 [N, 3, H, W], labels int64 [N]), a pure function of the arguments."""
    if not 2 <= num_classes <= len(CLASSES):
        raise ValueError(f"num_classes must be in [2, {len(CLASSES)}]")
    g = torch.Generator().manual_seed(seed)
    labels = torch.randperm(num_samples, generator=g) % num_classes
    images = torch.empty(num_samples, 3, image_size, image_size, dtype=torch.uint8)
    chunk = 2048  # bounds peak memory for large sets
    for start in range(0, num_samples, chunk):
        y = labels[start : start + chunk]
        n = y.numel()
        mask = _shape_masks(y, image_size, g).unsqueeze(1)  # (n, 1, H, W)
        background = 0.2 + 0.6 * torch.rand(n, 3, 1, 1, generator=g)
        sign = torch.where(torch.rand(n, 1, 1, 1, generator=g) < 0.5, -1.0, 1.0)
        contrast = sign * (0.12 + 0.3 * torch.rand(n, 3, 1, 1, generator=g))
        ramp = torch.linspace(-1, 1, image_size)
        tilt = 0.15 * torch.randn(n, 3, 2, generator=g)
        gradient = tilt[..., 0, None, None] * ramp.view(1, 1, 1, -1) + tilt[
            ..., 1, None, None
        ] * ramp.view(1, 1, -1, 1)
        noise = 0.15 * torch.randn(n, 3, image_size, image_size, generator=g)
        img = background + gradient + contrast * mask + noise
        images[start : start + n] = (img.clamp(0, 1) * 255).round().to(torch.uint8)
    return images, labels
