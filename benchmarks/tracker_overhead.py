"""What MLflow and Weights & Biases logging cost a training run: img/s with both trackers on over
img/s with both off, the same `multicard train` job, alternating (off, on, on, off, ...) so a
drifting machine favours neither.

`multicard bench` drives the training loop without the run's logging callbacks (no metrics.jsonl,
TensorBoard or trackers), so the trackers' cost is measured here, on whole `multicard train` runs:
steady img/s over the step records after the first epoch's first window (start-up, the trackers'
own start included in neither), from metrics.jsonl.

    python benchmarks/tracker_overhead.py [--repeats 3] [--nproc 1] [KEY=VALUE ...]

Prints one line per run and the ratio (on / off: 1.00 = free; the target is >= 1/1.02).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

JOB = ["--config", "configs/demo.yaml", "data.train_size=12800", "data.val_size=1000", "train.epochs=1",
       "log_every=10", "train.resume=never"]  # fmt: skip
TRACKERS = ["log.mlflow=true", "log.wandb=true"]


def steady_img_per_s(metrics: Path) -> float:
    """Images per second over the step windows after the first (weighted by steps: the batch cancels)."""
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    windows, previous = [], None
    for r in (r for r in steps if r.get("kind") == "step"):
        if previous is not None:
            windows.append((r["step"] - previous, r["img_per_s"]))
        previous = r["step"]
    return sum(k for k, _ in windows) / sum(k / rate for k, rate in windows)


def run(out: Path, trackers: bool, nproc: int, extra: list[str]) -> float:
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    cmd = [sys.executable, "-m", "multicard", "train", *launch, *JOB, *extra, f"out_dir={out}"]
    done = subprocess.run([*cmd, *(TRACKERS if trackers else [])], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return steady_img_per_s(out / "metrics.jsonl")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=1, help="processes (ddp under multicard's launcher when > 1)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    rates: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for trackers in ((False, True) if i % 2 == 0 else (True, False)):
                rate = run(Path(tmp) / f"run-{i}-{int(trackers)}", trackers, args.nproc, args.overrides)
                rates[trackers].append(rate)
                print(f"repeat {i} trackers={'on ' if trackers else 'off'} {rate:8.1f} img/s", flush=True)
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    pairs = [a / b for a, b in zip(rates[True], rates[False], strict=True)]
    print(f"nproc {args.nproc}: trackers on / off = {on / off:.3f} (median img/s {on:.1f} vs {off:.1f}; "
          f"per repeat {', '.join(f'{r:.3f}' for r in pairs)})")  # fmt: skip


if __name__ == "__main__":
    main()
