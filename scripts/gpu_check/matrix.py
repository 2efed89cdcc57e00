"""Every GPU path, trained briefly: pass/fail and img/s of each.

single, dp (over all GPUs present) and ddp (NCCL, one process per GPU) in fp32, bf16 and fp16,
all with channels_last, cuDNN autotuning and the device loader; then bf16 with torch.compile
under single and ddp (and dp when one GPU is present: DataParallel over several GPUs refuses
compile). The workload is the throughput benchmark's: resnet18_cifar on 32×32 synthetic images,
batch 512 per GPU, two epochs of 20 steps; the second epoch is timed. `vs_single` is img/s per
GPU over single's at the same precision and compile setting (target on one GPU: >= 0.95).

    python scripts/gpu_check/matrix.py --out runs/gpu-matrix [--budget-s 330] [KEY=VALUE ...]

Without CUDA every run is reported as skipped, with the reason; `--cpu` runs the single and
ddp rows on the CPU instead (a check of this script: pass small-model overrides).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from train_run import TrainRun, train

BATCH_PER_GPU = 512
STEPS_PER_EPOCH = 20
LOG_EVERY = 10
PRECISIONS = ("fp32", "bf16", "fp16")
STRATEGIES = ("single", "dp", "ddp")
TIMEOUT_S = {False: 180, True: 360}  # eager, compiled (compilation takes about a minute per graph)


def workload(batch: int) -> list[str]:
    return [
        "model.name=resnet18_cifar",
        "data.name=synthetic",
        "data.image_size=32",
        f"data.train_size={STEPS_PER_EPOCH * batch}",
        "data.val_size=512",
        "data.eval_batch_size=512",
        "data.loader=device",
        f"train.global_batch_size={batch}",
        "train.epochs=2",
        "sched.warmup_epochs=1",
        "model.channels_last=true",
        "cudnn_benchmark=true",
        f"log_every={LOG_EVERY}",
    ]


# (strategy, precision, compile) of every run; the compiled ones last, as the slowest to start
# (the later ones reuse the first one's compiled kernels from torch's on-disk cache).
ROWS = [(s, p, False) for p in PRECISIONS for s in STRATEGIES] + [(s, "bf16", True) for s in ("single", "ddp", "dp")]


def row_name(strategy: str, precision: str, compiled: bool) -> str:
    return f"{strategy}-{precision}{'-compile' if compiled else ''}"


def skip_reason(strategy: str, compiled: bool, gpus: int, cpu: bool) -> str | None:
    if cpu:
        return "needs CUDA GPUs" if strategy == "dp" else None
    if gpus == 0:
        return "no CUDA device (torch.cuda.is_available() is False)"
    if strategy == "dp" and compiled and gpus > 1:
        return f"compile=true is refused for dp over {gpus} GPUs (use ddp)"
    return None


def run_one(strategy: str, precision: str, compiled: bool, gpus: int, cpu: bool, extra: list[str], out: Path) -> dict:
    workers = 1 if strategy == "single" else 2 if cpu else gpus  # dp: GPUs driven; ddp: processes
    batch = BATCH_PER_GPU * (1 if strategy == "single" else workers)
    devices = "cpu" if cpu else f"[{','.join(str(i) for i in range(workers))}]"
    overrides = [*workload(batch), f"strategy={strategy}", f"devices={devices}", f"precision={precision}"]
    if compiled:
        overrides.append("compile=true")
    launch = ["--nproc-per-node", str(workers)] if strategy == "ddp" else []
    name = row_name(strategy, precision, compiled)
    result = train([*overrides, *extra], out / name, launch, warmup_steps=STEPS_PER_EPOCH,
                   timeout_s=TIMEOUT_S[compiled])  # fmt: skip
    return {"name": name, "strategy": strategy, "precision": precision, "compile": compiled, "workers": workers,
            **result.as_dict()}  # fmt: skip


def add_ratios(results: list[dict]) -> None:
    """img/s per worker over single's, at the same precision and compile setting."""
    single = {(r["precision"], r["compile"]): r["img_per_s"] for r in results if r["strategy"] == "single"}
    for r in results:
        base = single.get((r["precision"], r["compile"]))
        if r["img_per_s"] and base:
            r["vs_single"] = round(r["img_per_s"] / r["workers"] / base, 3)
        else:
            r["vs_single"] = None


def write(out: Path, gpus: int, start: float, results: list[dict]) -> None:
    add_ratios(results)
    summary = {
        "gpus": gpus,
        "device": torch.cuda.get_device_name(0) if gpus else "cpu",
        "torch": torch.__version__,
        "wall_s": round(time.perf_counter() - start, 1),
        "runs": results,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.json").write_text(json.dumps(summary, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/gpu-matrix"))
    p.add_argument("--budget-s", type=float, default=330, help="runs that would start after this are skipped")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (checks this script, not the GPU paths)")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE appended to every run")
    args = p.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    start = time.perf_counter()
    results = []
    for strategy, precision, compiled in ROWS:
        reason = skip_reason(strategy, compiled, gpus, args.cpu)
        if reason is None and time.perf_counter() - start > args.budget_s:
            reason = f"time budget of {args.budget_s:.0f} s spent"
        if reason is not None:
            row = {"name": row_name(strategy, precision, compiled), "strategy": strategy, "precision": precision,
                   "compile": compiled, "workers": 0, **TrainRun("skipped", reason).as_dict()}  # fmt: skip
        else:
            row = run_one(strategy, precision, compiled, gpus, args.cpu, args.overrides, args.out)
        results.append(row)
        rate = f"{row['img_per_s']:.0f} img/s" if row["img_per_s"] else row["reason"]
        print(f"{row['name']:20s} {row['status']:7s} {row['wall_s']:6.1f} s  {rate}", flush=True)
        write(args.out, gpus, start, results)  # after every run: a stopped matrix still reports
    print(json.dumps({"passed": sum(r["status"] == "passed" for r in results),
                      "failed": sum(r["status"] == "failed" for r in results),
                      "skipped": sum(r["status"] == "skipped" for r in results)}))  # fmt: skip


if __name__ == "__main__":
    main()
