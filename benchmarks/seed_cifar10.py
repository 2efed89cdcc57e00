"""Reproduce the classic CIFAR-10 table, time multicard against the plain yardstick, and run
the fast recipe against the seed recipe's wall time — all in one run on one machine.

Runs, in order: the plain script (benchmarks/plain_cifar10.py); configs/seed_cifar10.yaml in one
process, again in exact fp32 maths, and with --nproc-per-node 2; configs/cifar10_fast.yaml.
Prints train top-1 per epoch beside the reference table, median epoch times and their ratio
to the plain script, wall times; writes summary.json.

    python benchmarks/seed_cifar10.py --root ../shared/data/cifar10 --out runs/bench-seed
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
CONFIGS = HERE.parent / "configs"
REFERENCE = [38.8, 50.4, 57.1, 61.4, 64.3]  # plain script of this recipe on our 2-core machines

# name → (config, launch flags, overrides); None config = the plain script
RUNS = {
    "plain": (None, [], []),
    "multicard single": ("seed_cifar10.yaml", [], []),
    "multicard single fp32": ("seed_cifar10.yaml", [], ["precision=fp32", "model.channels_last=false"]),
    "multicard ddp×2": ("seed_cifar10.yaml", ["--nproc-per-node", "2"], []),
    "cifar10_fast": ("cifar10_fast.yaml", [], []),
}


def run_plain(root: str, seed: int) -> list[dict]:
    cmd = [sys.executable, str(HERE / "plain_cifar10.py"), "--root", root, "--epochs", "5", "--seed", str(seed)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def run_multicard(root: str, config: str, launch: list[str], overrides: list[str], out_dir: Path) -> list[dict]:
    shutil.rmtree(out_dir, ignore_errors=True)  # a fresh run, not a continuation
    cmd = [
        sys.executable, "-m", "multicard", "train", "--config", str(CONFIGS / config), *launch,
        f"data.root={root}", f"out_dir={out_dir}", *overrides,
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
    p.add_argument("--out", default="runs/bench-seed")
    p.add_argument("--only", nargs="*", choices=list(RUNS), help="a subset of the runs")
    p.add_argument("--seed", type=int, default=0, help="training seed (the validation split stays fixed)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    results: dict[str, dict] = {}
    for name, (config, launch, overrides) in RUNS.items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        if config is None:
            records = run_plain(args.root, args.seed)
        else:
            seeded = [*overrides, f"seed={args.seed}"]
            records = run_multicard(args.root, config, launch, seeded, out / name.replace(" ", "-"))
        results[name] = {"records": records, "wall_s": time.perf_counter() - start}
        print(f"{name}: {results[name]['wall_s']:.0f} s", flush=True)

    print("\ntrain top-1 % per epoch (reference: " + " / ".join(map(str, REFERENCE)) + ")")
    plain = results.get("plain")
    plain_median = statistics.median(r["epoch_s"] for r in plain["records"]) if plain else None
    summary = {"reference_train_top1": REFERENCE, "runs": {}}
    for name, result in results.items():
        records = result["records"]
        top1 = [round(r["train_top1"], 1) for r in records]
        times = [r["epoch_s"] for r in records]
        median = statistics.median(times)
        row = {
            "train_top1": top1,
            "val_top1": [round(r["val_top1"], 2) for r in records],
            "epoch_s": [round(t, 1) for t in times],
            "epoch_s_median": round(median, 1),
            "wall_s": round(result["wall_s"], 1),
        }
        line = f"{name:22s} " + " / ".join(f"{t:.1f}" for t in top1)
        if name != "cifar10_fast":
            worst = max(abs(a - b) for a, b in zip(top1, REFERENCE, strict=True))
            row["max_abs_diff_to_reference"] = round(worst, 2)
            line += f"  (max |Δ| {row['max_abs_diff_to_reference']:.1f})"
        if plain_median:
            row["epoch_ratio_to_plain"] = round(median / plain_median, 3)
            spread = f"[{min(times):.1f}–{max(times):.1f}]"
            line += f"  epoch {median:.1f} s {spread} × plain {row['epoch_ratio_to_plain']:.3f}"
        line += f"  val {records[-1]['val_top1']:.2f}%  wall {result['wall_s']:.0f} s"
        summary["runs"][name] = row
        print(line)
    if "cifar10_fast" in results and "multicard single" in results:
        fast, seed = results["cifar10_fast"], results["multicard single"]
        summary["fast_wall_over_seed_wall"] = round(fast["wall_s"] / seed["wall_s"], 3)
        print(
            f"\ncifar10_fast: val {fast['records'][-1]['val_top1']:.2f}% in {fast['wall_s']:.0f} s; "
            f"seed recipe wall {seed['wall_s']:.0f} s (ratio {summary['fast_wall_over_seed_wall']:.2f})"
        )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
