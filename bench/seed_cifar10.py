"""Reproduce the classic CIFAR-10 table and time multicard against the plain yardstick.

One run, same machine: the plain script (bench/plain_cifar10.py), then multicard's
configs/seed_cifar10.yaml in one process and with --nproc-per-node 2. Prints train top-1 per
epoch beside the reference table, median epoch times and their ratio; writes summary.json.

    python bench/seed_cifar10.py --root ../shared/data/cifar10 --out runs/bench-seed
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REFERENCE = [38.8, 50.4, 57.1, 61.4, 64.3]  # plain script of this recipe on our 2-core machines


def run_plain(root: str, epochs: int) -> list[dict]:
    cmd = [sys.executable, str(HERE / "plain_cifar10.py"), "--root", root, "--epochs", str(epochs)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def run_multicard(root: str, epochs: int, out_dir: Path, launch: list[str]) -> list[dict]:
    shutil.rmtree(out_dir, ignore_errors=True)  # a fresh run, not a continuation
    cmd = [
        sys.executable, "-m", "multicard", "train", "--config", str(HERE.parent / "configs/seed_cifar10.yaml"),
        *launch, f"data.root={root}", f"train.epochs={epochs}", f"out_dir={out_dir}",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {"epoch": r["epoch"] + 1, "train_top1": r["train_top1"], "val_top1": r["val_top1"], "epoch_s": r["epoch_s"]}
        for r in records
        if r["kind"] == "epoch"
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="../shared/data/cifar10")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--out", default="runs/bench-seed")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    runs: dict[str, list[dict]] = {}
    walls: dict[str, float] = {}
    for name, launch in [("plain", None), ("multicard single", []), ("multicard ddp×2", ["--nproc-per-node", "2"])]:
        start = time.perf_counter()
        if launch is None:
            runs[name] = run_plain(args.root, args.epochs)
        else:
            runs[name] = run_multicard(args.root, args.epochs, out / name.replace(" ", "-"), launch)
        walls[name] = time.perf_counter() - start
        print(f"{name}: {walls[name]:.0f} s", flush=True)

    print("\ntrain top-1 % per epoch (reference: " + " / ".join(map(str, REFERENCE[: args.epochs])) + ")")
    summary = {"reference_train_top1": REFERENCE[: args.epochs], "runs": {}}
    plain_median = statistics.median(r["epoch_s"] for r in runs["plain"])
    for name, records in runs.items():
        top1 = [round(r["train_top1"], 1) for r in records]
        times = [r["epoch_s"] for r in records]
        worst = max(abs(a - b) for a, b in zip(top1, REFERENCE, strict=False))
        median = statistics.median(times)
        summary["runs"][name] = {
            "train_top1": top1,
            "val_top1": [round(r["val_top1"], 2) for r in records],
            "epoch_s": [round(t, 1) for t in times],
            "epoch_s_median": round(median, 1),
            "epoch_s_range": [round(min(times), 1), round(max(times), 1)],
            "ratio_to_plain": round(median / plain_median, 3),
            "max_abs_diff_to_reference": round(worst, 2),
            "wall_s": round(walls[name], 1),
        }
        print(
            f"{name:18s} {' / '.join(f'{t:.1f}' for t in top1)}  (max |Δ| {worst:.1f})  "
            f"val {records[-1]['val_top1']:.2f}%  epoch {median:.1f} s [{min(times):.1f}–{max(times):.1f}]  "
            f"× plain {median / plain_median:.3f}"
        )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
