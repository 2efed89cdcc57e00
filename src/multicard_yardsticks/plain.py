"""The yardstick: the same workload as a hand-written PyTorch loop, as a user would write it.

No multicard code runs in the loop: plain torch.distributed + DistributedDataParallel, the
model from the same registry, the same optimizer settings, images resident on the device.
Whatever multicard adds per step shows up as the ratio of its step time to this one's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from multicard.base.config import Config
from multicard.data.sources.synthetic import make_synthetic
from multicard.runtime.clock import StepClock, summary_ms
from multicard.runtime.environment import detect_env
from multicard.runtime.process_group import threads_per_process
from multicard.strategy.models import build_model


def device_for(cfg: Config, local_rank: int) -> torch.device:
    on_gpu = cfg.devices != "cpu" and torch.cuda.is_available()
    return torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")


def set_threads(cfg: Config, processes: int) -> None:
    torch.set_num_threads(threads_per_process(cfg.threads, processes))  # as multicard sets them


def model_for(cfg: Config, device: torch.device) -> nn.Module:
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model.name, cfg.data.num_classes, dict(cfg.model.kwargs)).to(device)
    return model.to(memory_format=torch.channels_last) if cfg.model.channels_last else model


def optimizer_for(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    o = cfg.optim
    extra = {"fused": True} if o.fused else {}
    return torch.optim.SGD(
        model.parameters(), lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay, **extra
    )


def device_batches(
    cfg: Config, device: torch.device, batch: int, rank: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (x, y) batches gathered from the embedded dataset's images, resident on the device."""
    n, size = cfg.data.train_size, cfg.data.image_size
    images, labels = make_synthetic(n, size, cfg.seed, cfg.data.num_classes)  # the embedded dataset's images
    images, labels = images.to(device), labels.to(device)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + rank)).to(device)
    step = 0
    while True:
        idx = order[(step * batch) % (n - batch + 1) :][:batch]
        x = (images.index_select(0, idx).float() - 127.5) / 64.0
        if cfg.model.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        yield x, labels.index_select(0, idx)
        step += 1


def run_plain(cfg: Config, strategy: str, world_size: int, warmup: int, steps: int) -> dict[str, Any] | None:
    """Train warmup + steps steps; rank 0 returns the step-time summary (others None)."""
    distributed = strategy == "ddp"
    env = detect_env()
    rank, local_rank = (env.rank, env.local_rank) if distributed else (0, 0)
    device = device_for(cfg, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    set_threads(cfg, world_size if distributed else 1)
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        model = model_for(cfg, device)
        if distributed:
            ids = [local_rank] if device.type == "cuda" else None
            model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        elif strategy == "dp":
            model = nn.DataParallel(model, device_ids=list(range(world_size)))
        optimizer = optimizer_for(cfg, model)
        batch = cfg.train.global_batch_size // (world_size if distributed else 1)
        batches = device_batches(cfg, device, batch, rank)
        autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
        clock = StepClock(device, warmup)
        for _ in range(warmup + steps):
            x, y = next(batches)
            with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                loss = F.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            clock()
        return {"step_ms": summary_ms(clock.times), "times": clock.times} if rank == 0 else None
    finally:
        if distributed:
            dist.destroy_process_group()
