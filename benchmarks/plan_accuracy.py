"""How close `multicard plan` comes on this machine: predicted vs measured peak tensor memory per
process and step time, for several models × micro-batch sizes × strategies, from one run.

Each (model, micro-batch) is planned and measured by what `multicard plan --gpu cpu --gpus 2 --measure`
runs (plan/measure.py's measure_here): single at that micro-batch; ddp, ZeRO-1 (ddp + shard_optimizer),
fsdp ZeRO-2 and ZeRO-3 with 2 processes at that micro-batch each, so the measured steps are multicard's
own loop. Memory: the profiler's allocation peak (CPU). Time: wall time of a step, the fastest of
--steps and their median (other work on a shared machine slows some steps); calibrate first
(--calibrate) for meaningful times.

    python benchmarks/plan_accuracy.py [--calibrate] [--quick] [--strategies single,ddp,zero1,zero2,zero3]
                                  [--model NAME --image-size PX --micro-batches 8,16] [--out runs/plan-accuracy]
    python benchmarks/plan_accuracy.py --rescore runs/plan-accuracy/accuracy.json

--model (with --image-size and --micro-batches) measures that model instead of CASES; KEY=VALUE
arguments are added to every case's config (e.g. model.kwargs.width=2048).

--rescore predicts the measured rows of an earlier run again with the planner as it is now and
this machine's calibration (the measurements are kept; only the predictions change).

Prints one row per case and the worst ratios; targets: memory within ±10%, time within ±30%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

CASES = [  # (model, image size, two micro-batch sizes)
    ("resnet18", 224, (8, 16)),
    ("resnet50", 224, (8, 16)),
    ("vit_b_16", 224, (4, 8)),
    ("torchvision.models:efficientnet_b0", 224, (8, 16)),
]
QUICK = [("resnet18", 64, (8, 16))]
RUNS = [("single", 1), ("ddp,zero1,zero2,zero3", 2)]  # (strategies, processes): every process at one micro-batch


def print_row(r: dict) -> None:
    print(f"{r['model']:<36} {r['micro_batch']:>5} {r['strategy']:<6} {r['predicted_tensor_bytes'] / 2**20:>9.1f} "
          f"{r['peak_bytes'] / 2**20:>9.1f} {r['memory_ratio']:>6.3f} {r['predicted_step_s']:>7.2f} "
          f"{r['step_min_s']:>7.2f} {r['time_ratio']:>6.2f} {r['step_s']:>7.2f} {r['time_ratio_median']:>6.2f}",
          flush=True)  # fmt: skip


def overrides_of(model: str, size: int, micro: int, processes: int, more: list[str]) -> list[str]:
    return [f"model.name={model}", f"data.image_size={size}", f"train.global_batch_size={micro * processes}",
            "optim.name=adamw", *more]  # fmt: skip


def measure_case(model: str, size: int, micro: int, strategies: str, processes: int, steps: int,
                 more: list[str]) -> dict:  # fmt: skip
    """What `multicard plan --gpu cpu --gpus P --measure --strategies S` measures, by strategy key."""
    from multicard.base.config import load_config
    from multicard.tools.plan.measure import measure_here

    overrides = overrides_of(model, size, micro, processes, more)
    return measure_here(load_config(None, overrides), None, overrides, gpus=processes, steps=steps,
                        strategies=strategies.split(","))  # fmt: skip


def predict(row: dict, steps: int) -> tuple[float, float]:
    """(tensor bytes, step seconds) the planner now predicts for a measured row."""
    import shutil

    from multicard.base.config import load_config
    from multicard.tools.plan.measure import local_target, measurement_config
    from multicard.tools.plan.planner import make_plan

    overrides = overrides_of(row["model"], row["image_size"], row["micro_batch"], row["processes"],
                             row.get("overrides", []))  # fmt: skip
    cfg = measurement_config(load_config(None, overrides), steps)
    try:
        target = local_target(row["processes"])
        planned = next(r for r in make_plan(cfg, None, overrides, target).rows if r.candidate.key == row["strategy"])
        return planned.fit_memory.tensors, planned.time.total_s
    finally:
        shutil.rmtree(cfg.out_dir, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibrate", action="store_true", help="run multicard plan --calibrate first")
    p.add_argument("--quick", action="store_true", help="one small case (a smoke test of this script)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--strategies", default="single,ddp,zero1,zero2,zero3", help="measure only these (e.g. zero2)")
    p.add_argument("--model", help="measure this model (model.name) instead of the listed cases")
    p.add_argument("--image-size", type=int, default=64, help="--model: data.image_size")
    p.add_argument("--micro-batches", default="8,16", help="--model: micro-batch sizes, comma-separated")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more config overrides for every case")
    p.add_argument("--out", type=Path, default=Path("runs/plan-accuracy"))
    p.add_argument("--rescore", type=Path, help="accuracy.json of an earlier run: predict its rows again")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.calibrate:
        from rich.console import Console

        from multicard.tools.plan.command import calibrate_here

        calibrate_here(Console(stderr=True))
    rows = []
    started = time.time()
    print(f"{'model':<36} {'micro':>5} {'strategy':<6} {'pred MiB':>9} {'meas MiB':>9} {'ratio':>6} "
          f"{'pred s':>7} {'min s':>7} {'ratio':>6} {'median':>7} {'ratio':>6}", flush=True)  # fmt: skip
    if args.rescore:
        stored = json.loads(args.rescore.read_text())["rows"]
    own = [(args.model, args.image_size, tuple(int(m) for m in args.micro_batches.split(",")))] if args.model else None
    for model, size, micros in [] if args.rescore else QUICK if args.quick else own or CASES:
        for micro in micros:
            for run_strategies, processes in RUNS:
                strategies = ",".join(k for k in run_strategies.split(",") if k in args.strategies.split(","))
                if not strategies:
                    continue
                measured = measure_case(model, size, micro, strategies, processes, args.steps, args.overrides)
                for key, m in measured.items():
                    if key not in strategies.split(","):
                        continue
                    row = {"model": model, "image_size": size, "micro_batch": micro, "strategy": key,
                           "overrides": args.overrides,
                           "processes": processes, **m}  # fmt: skip
                    if m.get("ok"):
                        row["memory_ratio"] = m["predicted_tensor_bytes"] / m["peak_bytes"]
                        row["time_ratio"] = m["predicted_step_s"] / m["step_min_s"]
                        row["time_ratio_median"] = m["predicted_step_s"] / m["step_s"]
                        print_row(row)
                    else:
                        print(f"{model:<36} {micro:>5} {key:<6} failed: {m.get('reason')}", flush=True)
                    rows.append(row)
    for row in stored if args.rescore else []:
        if row.get("ok"):
            row["predicted_tensor_bytes"], row["predicted_step_s"] = predict(row, args.steps)
            row["memory_ratio"] = row["predicted_tensor_bytes"] / row["peak_bytes"]
            row["time_ratio"] = row["predicted_step_s"] / row["step_min_s"]
            row["time_ratio_median"] = row["predicted_step_s"] / row["step_s"]
            print_row(row)
        rows.append(row)
    ok = [r for r in rows if r.get("ok")]
    mem = [abs(r["memory_ratio"] - 1) for r in ok]
    tim = [abs(r["time_ratio"] - 1) for r in ok]
    tim_median = [abs(r["time_ratio_median"] - 1) for r in ok]
    summary = {
        "cases": len(rows),
        "measured": len(ok),
        "worst_memory_error": max(mem) if mem else None,
        "worst_time_error": max(tim) if tim else None,
        "worst_time_error_median": max(tim_median) if tim_median else None,
        "time_within_30pct": sum(e <= 0.30 for e in tim),
        "seconds": time.time() - started,
        "load_average": os.getloadavg(),
    }
    (args.out / "accuracy.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    print(json.dumps(summary))
    return 0 if ok and len(ok) == len(rows) and max(mem) <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
