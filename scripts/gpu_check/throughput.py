"""Single-GPU training throughput, model FLOP utilisation, and the device loader's share of a step.

The workload: resnet18_cifar on 32×32 synthetic images, batch 512, bf16 autocast,
channels_last, torch.compile, cuDNN autotuning, the device loader. It is trained by
`multicard train` itself (see train_run.py for how its windows are timed); the first epoch is
warm-up (compilation, autotuning), the second is timed.

- FLOPs per image: torch.utils.flop_counter.FlopCounterMode over one forward and backward of
  the same model (matmuls and convolutions, as MFU conventionally counts).
- MFU: achieved FLOP/s over the GPU's dense bf16 tensor-core peak (from the one table of
  GPUs, multicard/tools/plan/gpus.yaml); null, with the reason, on a GPU the table does not know.
- Loader share: the device loader alone makes `--loader-batches` batches (gather, crop/flip,
  normalise), timed between two CUDA synchronisations, over the timed step time.

    python scripts/gpu_check/throughput.py [--out runs/gpu-throughput] [KEY=VALUE ...]

Targets on an H100/H200-class GPU: MFU >= 30%, loader share <= 3%.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from train_run import train

from multicard.base.config import load_config
from multicard.data import build_data
from multicard.data.loading.sampling import BatchSplit
from multicard.runtime.process_group import ProcessContext
from multicard.strategy.models import build_model
from multicard.tools.plan.hardware import peak_bf16

STEPS_PER_EPOCH = 40
WORKLOAD = [
    "model.name=resnet18_cifar",
    "data.name=synthetic",
    "data.image_size=32",
    f"data.train_size={STEPS_PER_EPOCH * 512}",
    "data.val_size=512",
    "data.eval_batch_size=512",
    "data.loader=device",
    "train.global_batch_size=512",
    "train.epochs=2",
    "sched.warmup_epochs=1",
    "precision=bf16",
    "model.channels_last=true",
    "compile=true",
    "cudnn_benchmark=true",
    "log_every=20",
    "strategy=single",
    "devices=[0]",
]


def flops_per_image(cfg, device: torch.device, batch: int = 8) -> float:
    """Forward + backward FLOPs of one training image, counted, not estimated by hand."""
    model = build_model(cfg.model.name, cfg.data.num_classes, dict(cfg.model.kwargs)).to(device)
    x = torch.randn(batch, 3, cfg.data.image_size, cfg.data.image_size, device=device)
    y = torch.randint(0, cfg.data.num_classes, (batch,), device=device)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    return counter.get_total_flops() / batch


def loader_ms_per_batch(cfg, device: torch.device, batches: int) -> float:
    """Time the device loader alone: `batches` training batches between two synchronisations."""
    ctx = ProcessContext(0, 0, 1, 1, device, distributed=False)
    data = build_data(cfg.data, cfg.seed, BatchSplit(cfg.train.global_batch_size, 1, 1), ctx)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    try:
        data.train.set_epoch(0)
        it = iter(data.train)
        next(it)  # first batch: allocations
        sync()
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        sync()
        return 1000 * (time.perf_counter() - start) / batches
    finally:
        data.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/gpu-throughput"))
    p.add_argument("--loader-batches", type=int, default=30)
    p.add_argument("--timeout-s", type=float, default=360)
    p.add_argument("overrides", nargs="*", help="KEY=VALUE changes to the workload (e.g. devices=cpu to check it)")
    args = p.parse_args()
    cfg = load_config(None, [*WORKLOAD, *args.overrides])
    cuda = cfg.devices != "cpu" and torch.cuda.is_available()
    result: dict = {"workload": [*WORKLOAD, *args.overrides], "torch": torch.__version__}
    if cfg.devices != "cpu" and not cuda:
        result.update(status="skipped", reason="no CUDA device (torch.cuda.is_available() is False)")
    else:
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        result["device"] = torch.cuda.get_device_name(device) if cuda else "cpu"
        run = train([*WORKLOAD, *args.overrides], args.out / "train", warmup_steps=STEPS_PER_EPOCH,
                    timeout_s=args.timeout_s)  # fmt: skip
        result.update(run.as_dict())
        if run.status == "passed" and run.img_per_s:
            batch = cfg.train.global_batch_size
            step_ms = 1000 * batch / run.img_per_s
            flops = flops_per_image(cfg, device)
            loader_ms = loader_ms_per_batch(cfg, device, args.loader_batches)
            peak = peak_bf16(result["device"]) if cuda else None
            result.update(
                step_ms=round(step_ms, 2),
                gflop_per_image=round(flops / 1e9, 3),
                achieved_tflops=round(run.img_per_s * flops / 1e12, 1),
                peak_bf16_tflops=peak / 1e12 if peak else None,
                mfu=round(run.img_per_s * flops / peak, 3) if peak else None,
                loader_ms=round(loader_ms, 3),
                loader_share=round(loader_ms / step_ms, 4),
            )
            if not cuda:
                result["mfu_reason"] = "not a CUDA device"
            elif peak is None:
                device = result["device"]
                result["mfu_reason"] = f"no bf16 peak known for {device!r}; add it to multicard/tools/plan/gpus.yaml"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "throughput.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "workload"}))


if __name__ == "__main__":
    main()
