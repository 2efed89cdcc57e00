"""Planned vs measured on this GPU: `multicard plan`'s memory, step time and largest micro-batch
against multicard's own steps here.

The workload: vit_b_16 at 224×224, bf16 autocast, one GPU (strategy single). Three checks:

- memory: torch.cuda.max_memory_allocated over the first steps against the plan's tensor bytes
  (its total less the CUDA context) at micro-batch 128;
- time: the median step time against the plan's;
- largest micro-batch: the plan's (no headroom, the GPU's memory as torch reports it) against
  the real one, found by probing micro-batches around it from the smallest up: two training
  steps each (the model, its optimizer, bf16 autocast; inputs drawn on the GPU, so a probe costs
  the CPU nothing), until one raises torch.cuda.OutOfMemoryError or the time budget is spent.
  Only that error counts as out of memory; any other is reported as the probe's error.

    python scripts/gpu_check/plan_check.py [--out runs/gpu-plan] [--budget-s 170] [KEY=VALUE ...]

Without CUDA it reports itself skipped, with the reason (`--cpu` runs the memory and time checks
on the CPU with a small model instead, to check this script; it probes no batch sizes there).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from multicard.base.config import load_config, with_overrides
from multicard.strategy.models import build_model
from multicard.strategy.optim import optimizer_recipe
from multicard.tools.plan.hardware import gpu_for_device
from multicard.tools.plan.measure import MEMORY_STEPS, run_alone
from multicard.tools.plan.planner import make_plan
from multicard.tools.plan.target import make_target

WORKLOAD = [
    "model.name=vit_b_16",
    "data.image_size=224",
    "precision=bf16",
    "train.global_batch_size=128",
    "data.val_size=16",
    "strategy=single",
    "devices=[0]",
]
CPU_WORKLOAD = ["model.name=resnet18", "data.image_size=64", "train.global_batch_size=32", "data.val_size=16",
                "strategy=single", "devices=cpu"]  # fmt: skip
PROBES = (0.85, 0.95, 1.05, 1.15)  # × the predicted largest micro-batch, tried in this order
TIMED_STEPS = 5


def runnable(cfg, batch: int):  # noqa: ANN001, ANN201
    """The workload at micro-batch `batch` with just enough images for the steps."""
    steps = MEMORY_STEPS + 1 + TIMED_STEPS
    return with_overrides(cfg, [f"train.global_batch_size={batch}", f"data.train_size={batch * steps}"])


def probe(cfg, batch: int, device: torch.device) -> dict:  # noqa: ANN001
    """Two training steps at micro-batch `batch`: outcome ran (with the peak), oom, or error."""
    size, classes = cfg.data.image_size, cfg.data.num_classes
    torch.cuda.reset_peak_memory_stats(device)
    try:
        model = build_model(cfg.model.name, classes, dict(cfg.model.kwargs)).to(device)
        optimizer = optimizer_recipe(model, cfg.optim, batch).build()
        for _ in range(2):  # the first step makes the optimizer state; the second is a steady one
            x = torch.randn(batch, 3, size, size, device=device)
            y = torch.randint(0, classes, (batch,), device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        return {"micro_batch": batch, "outcome": "ran", "peak_bytes": torch.cuda.max_memory_allocated(device)}
    except torch.cuda.OutOfMemoryError as exc:
        return {"micro_batch": batch, "outcome": "oom", "reason": str(exc).strip().splitlines()[0][:200]}
    except Exception as exc:  # not memory: say what it was, never call it out of memory
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return {"micro_batch": batch, "outcome": "error", "reason": f"{type(exc).__name__}: {first}"}


def probe_upwards(cfg, predicted: int, device: torch.device, started: float, budget_s: float) -> list[dict]:  # noqa: ANN001
    probes: list[dict] = []
    for factor in PROBES:
        if time.monotonic() - started > budget_s:
            break
        probes.append(probe(cfg, max(1, round(predicted * factor)), device))
        gc.collect()
        torch.cuda.empty_cache()  # the next probe starts from an empty cache, as a fresh process would
        if probes[-1]["outcome"] != "ran":
            break
    return probes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/gpu-plan"))
    p.add_argument("--budget-s", type=float, default=170, help="stop probing batch sizes after this long")
    p.add_argument("--cpu", action="store_true", help="check this script on the CPU with a small model")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE changes to the workload")
    args = p.parse_args()
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "workload": [*(CPU_WORKLOAD if args.cpu else WORKLOAD), *args.overrides],
        "torch": torch.__version__,
    }
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu:
        result.update(status="skipped", reason="no CUDA device (torch.cuda.is_available() is False)")
        return _finish(result, args.out)
    cfg = load_config(None, result["workload"])
    cfg = runnable(cfg, cfg.train.global_batch_size)  # planned with the images the runs hold
    if args.cpu:
        target = make_target("cpu", None, 1, 1, None, None)
        result["device"] = "cpu"
    else:
        name = torch.cuda.get_device_name(0)
        result["device"] = name
        gpu = gpu_for_device(name)
        if gpu is None:
            result.update(status="skipped", reason=f"{name!r} is not in multicard plan's GPU table (plan/gpus.yaml)")
            return _finish(result, args.out)
        total = torch.cuda.get_device_properties(0).total_memory
        target = dataclasses.replace(make_target(gpu.name, None, 1, 1, None, None), memory_per_process=total)
    plan = make_plan(cfg, None, result["workload"], target, headroom=0.0)
    row = next(r for r in plan.rows if r.candidate.key == "single")
    assert row.memory is not None and row.time is not None
    predicted = {
        "tensor_bytes": row.memory.tensors,
        "step_s": row.time.total_s,
        "largest_micro_batch": row.max_micro_batch,
    }
    measured = run_alone(cfg, TIMED_STEPS, profile_memory=args.cpu)
    result.update(status="passed" if measured.ok else "failed", predicted=predicted, measured=measured.as_dict())
    if measured.ok:
        result["memory_ratio"] = round(predicted["tensor_bytes"] / measured.peak_bytes, 3)
        result["time_ratio"] = round(predicted["step_s"] / measured.step_s, 3)
    _finish(result, args.out, quiet=True)  # the memory and time checks, before the probes
    device = torch.device("cuda", 0)
    probes = [] if args.cpu else probe_upwards(cfg, row.max_micro_batch, device, started, args.budget_s)
    ran = [p["micro_batch"] for p in probes if p["outcome"] == "ran"]
    oom = [p["micro_batch"] for p in probes if p["outcome"] == "oom"]
    errors = [f"{p['micro_batch']}: {p['reason']}" for p in probes if p["outcome"] == "error"]
    result.update(probes=probes, largest_ran=max(ran) if ran else None, smallest_failed=min(oom) if oom else None)
    if errors:
        result.update(status="failed", reason=f"a probe failed with an error that is not out of memory ({errors[0]})")
    _finish(result, args.out)


def _finish(result: dict, out: Path, quiet: bool = False) -> None:
    (out / "plan_check.json").write_text(json.dumps(result, indent=1))
    if not quiet:
        print(json.dumps({k: v for k, v in result.items() if k not in ("workload", "probes")}))


if __name__ == "__main__":
    main()
