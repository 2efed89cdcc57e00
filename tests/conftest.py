"""Shared helpers: small, fast training settings and a runner for the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Tiny runs: 16×16 images, a few hundred steps at most; enough to exercise every path.
TINY = [
    "model.name=smallcnn",
    "data.image_size=16",
    "data.train_size=1024",
    "data.val_size=301",
    "data.crop_padding=2",
    "train.epochs=1",
    "train.global_batch_size=32",
    "log_every=4",
]

# Learnable in tens of seconds on 2 CPU cores: reaches >90% validation top-1.
LEARN = [
    "model.name=smallcnn",
    "data.image_size=16",
    "data.train_size=8000",
    "data.val_size=2000",
    "data.crop_padding=2",
    "train.epochs=10",
    "train.global_batch_size=128",
    "sched.warmup_epochs=1",
    "log_every=20",
]


def cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m multicard ARGS` in a fresh process; capture its output."""
    full_env = {**os.environ, **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        full_env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "multicard", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
requires_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
