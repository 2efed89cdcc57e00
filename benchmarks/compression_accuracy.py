"""Accuracy and wall time of DDP's opt-in gradient compression, against plain all-reduce.

Trains one recipe (default configs/cifar10_fast.yaml) with --nproc-per-node 2 once per
ddp.comm_hook and prints final validation top-1, its difference to `none`, and wall time;
writes summary.json. Speed per step is `multicard bench --ddp-variant ...`'s job; this answers
what the compression costs in accuracy.

    python benchmarks/compression_accuracy.py --root ../shared/data/cifar10 --out runs/bench-compression
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def train(config: str, root: str, hook: str, epochs: int, seed: int, out_dir: Path) -> dict:
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "multicard", "train", "--config", str(CONFIGS / config), "--nproc-per-node", "2",
        f"data.root={root}", f"out_dir={out_dir}", f"ddp.comm_hook={hook}", f"train.epochs={epochs}", f"seed={seed}",
    ]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    epochs_done = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in epochs_done if r["kind"] == "epoch"][-1]
    return {"hook": hook, "val_top1": last["val_top1"], "val_loss": last["val_loss"], "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="cifar10_fast.yaml")
    p.add_argument("--root", default="../shared/data/cifar10")
    p.add_argument("--hooks", default="none,fp16,bf16", help="add powersgd on GPUs")
    p.add_argument("--epochs", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench-compression")
    args = p.parse_args()
    out = Path(args.out)
    rows = []
    for hook in args.hooks.split(","):
        row = train(args.config, args.root, hook, args.epochs, args.seed, out / hook)
        rows.append(row)
        print(f"{hook:>9}: val top-1 {row['val_top1']:.2f}%  wall {row['wall_s']:.0f} s", flush=True)
    base = next((r for r in rows if r["hook"] == "none"), None)
    if base is not None:
        for r in rows:
            r["delta_top1"] = r["val_top1"] - base["val_top1"]
            r["wall_ratio"] = r["wall_s"] / base["wall_s"]
            print(f"{r['hook']:>9}: Δ top-1 {r['delta_top1']:+.2f} points, wall ×{r['wall_ratio']:.3f}")
    summary = {"config": args.config, "epochs": args.epochs, "seed": args.seed, "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
