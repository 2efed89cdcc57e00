"""Small-image loaders (device, workers) without the model, beside the model's own training throughput.

For each loader (device, workers) it iterates full training epochs of the configured dataset
and reports img/s of the second epoch (the first pays decoding or worker start-up); then it
times training steps of the configured model on data already in memory. The device loader must
be far faster than the model (target: ≥ 20×) so it is never the bottleneck.

    python benchmarks/small_loader_throughput.py --config configs/seed_cifar10.yaml [KEY=VALUE ...]

The large-image pipeline (random resized crop, ImageNet photos) is benchmarks/loader_throughput.py.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from multicard.base.config import load_config, with_overrides
from multicard.data import build_data
from multicard.data.loading.sampling import BatchSplit
from multicard.runtime.process_group import ProcessContext, cpu_cores
from multicard.strategy.models import build_model


def loader_img_per_s(cfg, loader: str) -> tuple[float, float]:
    """(img/s of a warm epoch, seconds to build and run the first one)."""
    cfg = with_overrides(cfg, [f"data.loader={loader}"])
    plan = BatchSplit(cfg.train.global_batch_size, 1, 1)
    start = time.perf_counter()
    data = build_data(cfg.data, cfg.seed, plan, ProcessContext(0, 0, 1, 1, torch.device("cpu"), distributed=False))
    rates = []
    for epoch in range(2):
        data.train.set_epoch(epoch)
        t0, n = time.perf_counter(), 0
        for x, _ in data.train:
            n += x.shape[0]
        rates.append(n / (time.perf_counter() - t0))
        if epoch == 0:
            first = time.perf_counter() - start
    return rates[1], first


def model_img_per_s(cfg, steps: int = 20, warmup: int = 3) -> float:
    batch = cfg.train.global_batch_size
    model = build_model(cfg.model.name, 10, dict(cfg.model.kwargs))
    if cfg.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, cfg.data.image_size, cfg.data.image_size)
    if cfg.model.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(x).float(), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return steps * batch / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/seed_cifar10.yaml")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(cpu_cores())
    result = {"config": args.config, "overrides": args.overrides, "cores": cpu_cores()}
    for loader in ("device", "workers"):
        rate, first = loader_img_per_s(cfg, loader)
        result[f"{loader}_img_per_s"] = round(rate)
        result[f"{loader}_first_epoch_s"] = round(first, 1)
        print(f"{loader:8s} loader: {rate:9.0f} img/s (first epoch incl. set-up {first:.1f} s)", flush=True)
    model = model_img_per_s(cfg)
    result["model_train_img_per_s"] = round(model)
    result["device_over_model"] = round(result["device_img_per_s"] / model, 1)
    print(f"model {cfg.model.name} training: {model:.0f} img/s; device loader / model = {result['device_over_model']}×")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
