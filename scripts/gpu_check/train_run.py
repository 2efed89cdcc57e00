"""Run `multicard train` in a fresh process and read its throughput back from metrics.jsonl.

Step records cover windows of `log_every` optimizer steps, and each window ends in a host sync
(the engine reduces its statistics to the CPU there), so a window's img/s is timed over work
the device has finished. Windows that end within the first `warmup_steps` steps (cuDNN
autotuning, torch.compile) are left out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


def seconds_left(default: float = float("inf")) -> float:
    """Seconds until this step's deadline (GPU_CHECK_DEADLINE, Unix time, set by gpu_check.sh)."""
    deadline = os.environ.get("GPU_CHECK_DEADLINE")
    return float(deadline) - time.time() if deadline else default


def cuda_or_reason() -> str | None:
    """None where a CUDA device is usable, else why not (every CUDA row's skip reason)."""
    import torch

    return None if torch.cuda.is_available() else "no CUDA device (torch.cuda.is_available() is False)"


@dataclass
class TrainRun:
    status: str  # passed | failed | skipped
    reason: str = ""  # why it failed or was skipped: the run's last error line
    wall_s: float = 0.0
    img_per_s: float | None = None  # timed windows: total images / total time
    window_img_per_s: list[float] = field(default_factory=list)
    timed_steps: int = 0
    peak_mem_mb: list[float] = field(default_factory=list)  # per device, last epoch
    val_top1: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def steady_throughput(records: list[dict], warmup_steps: int) -> tuple[float | None, list[float], int]:
    """(img/s over the windows after warm-up, each window's img/s, steps timed).

    A window of k steps at r img/s took k·batch/r seconds: weighting by steps, the batch cancels.
    """
    windows, previous = [], 0
    for r in records:
        if r["kind"] != "step":
            continue
        steps = r["step"] - previous
        if previous >= warmup_steps and steps > 0:
            windows.append((steps, r["img_per_s"]))
        previous = r["step"]
    if not windows:
        return None, [], 0
    steps = sum(k for k, _ in windows)
    return steps / sum(k / rate for k, rate in windows), [round(rate, 1) for _, rate in windows], steps


def _last_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no output"])[-1][:300]


def train(
    overrides: list[str],
    out_dir: Path,
    launch: list[str] | None = None,
    warmup_steps: int = 10,
    timeout_s: float = 300,
) -> TrainRun:
    """Train with `overrides` (plus out_dir and train.resume=never) and summarise the run; the run
    is stopped at `timeout_s` or at the step's deadline, whichever comes first."""
    timeout_s = min(timeout_s, seconds_left() - 5)
    if timeout_s < 10:
        return TrainRun("skipped", "time budget spent")
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "multicard", "train", *(launch or []), *overrides, f"out_dir={out_dir}",
           "train.resume=never"]  # fmt: skip
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return TrainRun("failed", f"timed out after {timeout_s:.0f} s", wall_s=round(time.perf_counter() - start, 1))
    wall = round(time.perf_counter() - start, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "stdout.txt").write_text(proc.stdout)
    (out_dir / "stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0:
        return TrainRun("failed", f"exit {proc.returncode}: {_last_error(proc.stderr)}", wall_s=wall)
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rate, windows, timed = steady_throughput(records, warmup_steps)
    epochs = [r for r in records if r["kind"] == "epoch"]
    return TrainRun(
        "passed",
        wall_s=wall,
        img_per_s=round(rate, 1) if rate else None,
        window_img_per_s=windows,
        timed_steps=timed,
        peak_mem_mb=epochs[-1]["peak_mem_mb"] if epochs else [],
        val_top1=epochs[-1]["val_top1"] if epochs else None,
    )
