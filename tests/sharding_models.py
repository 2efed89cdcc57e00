"""Models for the sharded-training tests, used as `model.name=sharding_models:NAME` with tests/
on PYTHONPATH."""

from __future__ import annotations

import torch.nn as nn


def odd(num_classes: int) -> nn.Module:
    """No BatchNorm, and every parameter's leading size (what FSDP shards) divides by neither
    2 nor 3: uneven shards at 2 and 3 ranks. Each Sequential is a unit of the size rule."""
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 7, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(7, 13, 3, padding=1, stride=2), nn.ReLU()),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Sequential(nn.Linear(13 * 16, 29), nn.ReLU()),
        nn.Linear(29, num_classes),
    )


def wide(num_classes: int, width: int = 4096, depth: int = 6) -> nn.Module:
    """Wide linear layers on 16×16 RGB input: 87 M parameters at the defaults."""
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(3 * 16 * 16, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, num_classes))
