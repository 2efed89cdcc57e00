"""The yardstick: the same workload as a hand-written PyTorch loop, as a user would write it.

No multicard code runs in the loop: plain torch.distributed + DistributedDataParallel, the
model from the same registry, the same optimizer settings, images resident on the device.
Whatever multicard adds per step shows up as the ratio of its step time to this one's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig

from multicard.bench.measure import StepClock, summary_ms
from multicard.dist import cpu_cores, detect_env
from multicard.models import build_model


def _device(cfg: DictConfig, local_rank: int) -> torch.device:
    on_gpu = cfg.devices != "cpu" and torch.cuda.is_available()
    return torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")


def run_plain(cfg: DictConfig, strategy: str, world_size: int, warmup: int, steps: int) -> dict[str, Any] | None:
    """Train warmup + steps steps; rank 0 returns the step-time summary (others None)."""
    distributed = strategy == "ddp"
    env = detect_env()
    rank, local_rank = (env.rank, env.local_rank) if distributed else (0, 0)
    device = _device(cfg, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(cfg.threads or max(1, cpu_cores() // (world_size if distributed else 1)))
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        torch.manual_seed(cfg.seed)
        model: nn.Module = build_model(cfg.model.name, cfg.data.num_classes, dict(cfg.model.kwargs)).to(device)
        if cfg.model.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if distributed:
            ids = [local_rank] if device.type == "cuda" else None
            model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        elif strategy == "dp":
            model = nn.DataParallel(model, device_ids=list(range(world_size)))
        o = cfg.optim
        extra = {"fused": True} if o.fused else {}
        optimizer = torch.optim.SGD(
            model.parameters(), lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay, **extra
        )
        batch = cfg.train.global_batch_size // (world_size if distributed else 1)
        n = cfg.data.train_size
        g = torch.Generator().manual_seed(cfg.seed + rank)
        images = torch.randint(0, 256, (n, 3, cfg.data.image_size, cfg.data.image_size), generator=g, dtype=torch.uint8)
        images, labels = images.to(device), torch.randint(0, cfg.data.num_classes, (n,), generator=g).to(device)
        autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
        clock = StepClock(device, warmup)
        order = torch.randperm(n, generator=g).to(device)
        for step in range(warmup + steps):
            idx = order[(step * batch) % (n - batch + 1) :][:batch]
            x = (images.index_select(0, idx).float() - 127.5) / 64.0
            if cfg.model.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                loss = F.cross_entropy(model(x).float(), labels.index_select(0, idx))
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            clock()
        return {"step_ms": summary_ms(clock.times), "times": clock.times} if rank == 0 else None
    finally:
        if distributed:
            dist.destroy_process_group()
