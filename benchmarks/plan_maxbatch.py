"""The largest micro-batch `multicard plan` predicts for a memory cap, tried for real: under a
per-process cap (a cgroup v1 memory limit), `multicard train` at that micro-batch must finish and
at 1.25× of it must be killed for memory.

    python benchmarks/plan_maxbatch.py [--cap-gb 5] [--models smallcnn,torchvision.models:efficientnet_b0]

Needs root and /sys/fs/cgroup/memory; the caps are removed afterwards whatever happens. Calibrate
first (multicard plan --calibrate): the plan's allowance for what a process needs besides
tensors comes from it. One line per model: the predicted batch, each run's exit code, peak charge
and out-of-memory kills, and whether both held.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from multicard.base.config import load_config
from multicard.tools.plan import cgroup_cap
from multicard.tools.plan.calibration import Calibration, calibration_path
from multicard.tools.plan.planner import make_plan
from multicard.tools.plan.outputs import as_dict
from multicard.tools.plan.target import make_target

# The same data for the plan and the runs (the embedded images are held in memory); one step each.
BASE = ["data.image_size=64", "devices=cpu", "strategy=single", "data.train_size=4000", "data.val_size=8",
        "data.eval_batch_size=8", "train.max_steps=1", "log_every=1", "train.resume=never"]  # fmt: skip
KWARGS = {"smallcnn": ["model.kwargs.width=48"]}


def largest_batch(model: str, cap_gb: float, extra: list[str]) -> tuple[int, dict]:
    """What `multicard plan --memory-gb CAP` says of single: its largest micro-batch, and its row."""
    overrides = [f"model.name={model}", *BASE, *extra]
    target = make_target(None, cap_gb, 1, 1, None, Calibration.load(calibration_path()))
    plan = make_plan(load_config(None, overrides), None, overrides, target)
    row = next(r for r in as_dict(plan, None)["rows"] if r["strategy"] == "single")
    return row["max_micro_batch"], row


def train_capped(model: str, batch: int, cap_gb: float, extra: list[str]) -> dict:
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="plan-maxbatch-") as out, cgroup_cap.MemoryCap(int(cap_gb * 1e9)) as cap:
        overrides = [f"model.name={model}", *BASE, *extra, f"train.global_batch_size={batch}", f"out_dir={out}"]
        done = cap.run([sys.executable, "-m", "multicard", "train", *overrides], timeout=1800)
        result = {"batch": batch, "exit": done.returncode, "oom_kills": cap.oom_kills,
                  "peak_charge_gb": cap.max_usage / 1e9, "seconds": round(time.time() - start, 1)}  # fmt: skip
    if done.returncode not in (0, -9):
        result["stderr"] = done.stderr.strip().splitlines()[-1:]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap-gb", type=float, default=5.0, help="memory cap per process, GB (default 5)")
    p.add_argument("--models", default="smallcnn,torchvision.models:efficientnet_b0")
    p.add_argument("--out", type=Path, default=Path("runs/plan-maxbatch"))
    args = p.parse_args()
    why = cgroup_cap.available()
    if why:
        print(f"plan_maxbatch: cannot cap memory here: {why}", file=sys.stderr)
        return 2
    cgroup_cap.remove_stale()
    rows, ok = [], True
    for model in args.models.split(","):
        extra = KWARGS.get(model, [])
        batch, planned = largest_batch(model, args.cap_gb, extra)  # with the plan's default 10% headroom
        fits = train_capped(model, batch, args.cap_gb, extra)
        over = train_capped(model, round(batch * 1.25), args.cap_gb, extra)
        held = fits["exit"] == 0 and fits["oom_kills"] == 0 and over["exit"] != 0 and over["oom_kills"] >= 1
        ok &= held
        budget = planned["budget_bytes"] / 1e9
        rows.append({"model": model, "cap_gb": args.cap_gb, "predicted_batch": batch, "budget_gb": budget,
                     "at_batch": fits, "at_1.25x": over, "held": held})  # fmt: skip
        print(f"{model}: cap {args.cap_gb:g} GB, predicted largest micro-batch {batch}: "
              f"exit {fits['exit']} (peak {fits['peak_charge_gb']:.2f} GB, {fits['seconds']} s); "
              f"1.25× = {over['batch']}: exit {over['exit']}, {over['oom_kills']} OOM kill(s) "
              f"(peak {over['peak_charge_gb']:.2f} GB) -> {'held' if held else 'FAILED'}", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "maxbatch.json").write_text(json.dumps({"rows": rows, "load_average": os.getloadavg()}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
