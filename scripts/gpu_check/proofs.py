"""What one GPU proves beyond the matrix: each a row, passed / failed / skipped with the reason.

- fsdp1_bf16_sharded: fsdp with one process (bf16 mixed-precision policy) writes a sharded
  checkpoint; a second run resumes from it for one more epoch; `multicard eval` reads it.
- sigterm_resume_fp32: SIGTERM mid-run on CUDA, the same command resumes; the final model is
  bitwise equal to an uninterrupted run's (deterministic settings: see determinism/).
- sigterm_resume_fp16: the same under fp16, and the GradScaler state (scale, growth tracker)
  of the resumed run equals the uninterrupted run's: it was restored, not restarted.
- eval: `multicard eval` of the fp32 run's checkpoint gives its last epoch's top-1 exactly.
- compile_reduce_overhead: compile_mode=reduce-overhead (CUDA graphs) trains smallcnn, with its img/s.
- workers_jpeg_pinned: the workers loader on JPEG photos (generated when none are at hand)
  delivers CUDA batches through pinned host memory, and trains.
- nvjpeg_train: training with data.decode=gpu; failed if nvjpeg fell back to Pillow.

Rows run in this order (most valuable first) and results.json is written after each; a row
that would start with too little time left is skipped. Without CUDA every row is skipped.

    python scripts/gpu_check/proofs.py --out DIR [--cpu]

--cpu runs the rows that have a CPU form on the CPU (a check of this script, not of CUDA; the
others are skipped): a few minutes on 2 cores, so not part of the test suite's rehearsal.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from jpegs import linked_folder, photos
from train_run import TrainRun, cuda_or_reason, seconds_left, train

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.name=smallcnn", "data.image_size=16", "data.train_size=1024", "data.val_size=256",
         "data.crop_padding=2", "train.global_batch_size=32", "log_every=4", "devices=[0]"]  # fmt: skip
EXACT = [*SMALL, "train.epochs=2", "sched.name=constant", "checkpoint.every_steps=5", "data.loader=device"]
JPEG = ["model.name=resnet18", "data.name=imagefolder", "data.image_size=64", "data.loader=workers",
        "data.num_workers=4", "train.global_batch_size=64", "train.epochs=1", "log_every=2", "devices=[0]"]  # fmt: skip
MIN_ROW_S = 20  # a row needs at least this long to say anything
CUDA_ONLY = {"sigterm_resume_fp16", "compile_reduce_overhead", "nvjpeg_train"}  # no CPU form (--cpu skips them)
DEVICE = {"devices=[0]": "devices=[0]"}  # --cpu maps it to devices=cpu


def on_device(args: list[str] | tuple[str, ...]) -> list[str]:
    return [DEVICE.get(a, a) for a in args]


def train_on_device(overrides: list[str], out_dir: Path, **kwargs) -> TrainRun:  # noqa: ANN003
    return train(on_device(overrides), out_dir, **kwargs)


def multicard(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m multicard ARGS`, stopped at `timeout` or the step's deadline."""
    timeout = max(1.0, min(timeout, seconds_left() - 3))
    return subprocess.run([sys.executable, "-m", "multicard", *on_device(args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})  # fmt: skip


def ok(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()] or ["no output"]
        raise AssertionError(f"{what} exited {proc.returncode}: {lines[-1][:200]}")


def final_model(out_dir: Path) -> dict:
    from multicard.checkpoint import read_checkpoint

    folder = out_dir / "checkpoints"
    return read_checkpoint(folder / "last" if (folder / "last").is_dir() else folder / "last.pt")


def last_top1(out_dir: Path) -> float | None:
    epochs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in epochs if r["kind"] == "epoch"]
    return epochs[-1]["val_top1"] if epochs else None


def deterministic_env(faults: dict | None = None) -> dict:
    """CUDA runs whose results repeat bitwise: determinism/sitecustomize.py sets torch's switches
    (multicard has none: cuDNN autotuning off is its default, but not deterministic kernels)."""
    path = os.pathsep.join([str(Path(__file__).parent / "determinism"), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", **(faults or {})}


def interrupted_and_resumed(out: Path, precision: str) -> tuple[dict, dict, dict]:
    """(uninterrupted, resumed, stopped) checkpoints of EXACT at `precision`: SIGTERM once the first
    checkpoint is written (steps slowed by tests/faults so the signal lands mid-run)."""
    args = [*EXACT, f"precision={precision}"]
    reference, resumed = out / f"reference-{precision}", out / f"resumed-{precision}"
    ok(multicard("train", *args, f"out_dir={reference}", "train.resume=never", env=deterministic_env()), "reference")
    slow = {"MULTICARD_FAULT": "slow-steps", "MULTICARD_FAULT_MS": "100", "MULTICARD_FAULT_RANK": "0"}
    env = {**os.environ, **deterministic_env(slow)}
    cmd = [sys.executable, "-m", "multicard", "train", *on_device(args), f"out_dir={resumed}", "train.resume=never"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        while not list((resumed / "checkpoints").glob("step-*")) and proc.poll() is None:
            if seconds_left() < 10:
                raise AssertionError("no checkpoint before the deadline")
            time.sleep(0.05)  # polling the file system: the checkpoint is the event
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=max(1, min(60, seconds_left() - 3)))
    finally:
        proc.kill()
    if proc.returncode != 143:
        raise AssertionError(f"SIGTERM: exit {proc.returncode}, not 143: {err.strip().splitlines()[-1:]}")
    stopped = final_model(resumed)
    ok(multicard("train", *args, f"out_dir={resumed}", "train.resume=auto", env=deterministic_env()), "resume")
    return final_model(reference), final_model(resumed), stopped


def differing(a: dict, b: dict) -> list[str]:
    import torch

    return [k for k in b if not torch.equal(a[k], b[k])]


def fsdp1_bf16_sharded(out: Path) -> dict:
    run = out / "fsdp1"
    args = ["--nproc-per-node", "1", *SMALL, "strategy=fsdp", "precision=bf16", "checkpoint.format=sharded"]
    ok(multicard("train", *args, "train.epochs=1", f"out_dir={run}", "train.resume=never"), "fsdp×1 training")
    last = run / "checkpoints" / "last"
    if not last.is_dir():
        raise AssertionError(f"no sharded checkpoint at {last}")
    step = final_model(run)["step"]
    ok(multicard("train", *args, "train.epochs=2", f"out_dir={run}", "train.resume=auto"), "fsdp×1 resume")
    resumed_step = final_model(run)["step"]
    if resumed_step != 2 * step:
        raise AssertionError(f"resumed to step {resumed_step}, expected {2 * step}")
    evaluated = multicard("eval", "--checkpoint", str(last), "--json")
    ok(evaluated, "multicard eval of the sharded checkpoint")
    top1 = json.loads(evaluated.stdout.strip().splitlines()[-1])["top1"]
    return {"steps": [step, resumed_step], "eval_top1": top1, "train_top1": last_top1(run)}


def sigterm_resume_fp32(out: Path) -> dict:
    reference, resumed, stopped = interrupted_and_resumed(out, "fp32")
    if bad := differing(resumed["model"], reference["model"]):
        raise AssertionError(f"resumed model differs from uninterrupted in {len(bad)} tensors, e.g. {bad[0]}")
    return {"stopped_at_step": stopped["step"], "final_step": resumed["step"], "bitwise_equal": True}


def sigterm_resume_fp16(out: Path) -> dict:
    reference, resumed, stopped = interrupted_and_resumed(out, "fp16")
    scaler = stopped.get("scaler") or {}
    if not scaler:
        raise AssertionError("the stopped checkpoint holds no GradScaler state")
    if resumed.get("scaler") != reference.get("scaler"):
        scalers = f"{resumed.get('scaler')} != uninterrupted {reference.get('scaler')}"
        raise AssertionError(f"GradScaler state after resume {scalers}")
    bad = differing(resumed["model"], reference["model"])
    if bad:
        raise AssertionError(f"resumed model differs from uninterrupted in {len(bad)} tensors, e.g. {bad[0]}")
    return {"stopped_at_step": stopped["step"], "scaler": resumed["scaler"], "bitwise_equal": True}


def eval_row(out: Path) -> dict:
    run = out / "reference-fp32"
    if not (run / "checkpoints" / "last.pt").exists():
        run = out / "eval-run"
        ok(multicard("train", *SMALL, "train.epochs=1", f"out_dir={run}", "train.resume=never"), "training")
    evaluated = multicard("eval", "--checkpoint", str(run / "checkpoints" / "last.pt"), "--json")
    ok(evaluated, "multicard eval")
    top1, trained = json.loads(evaluated.stdout.strip().splitlines()[-1])["top1"], last_top1(run)
    if trained is None or abs(top1 - trained) > 1e-9:
        raise AssertionError(f"eval top-1 {top1} != the run's last epoch's {trained}")
    return {"top1": top1}


def _trained(run: TrainRun, **extra) -> dict:  # noqa: ANN003
    if run.status != "passed":
        raise AssertionError(run.reason)
    return {"img_per_s": run.img_per_s, "wall_s": run.wall_s, "val_top1": run.val_top1, **extra}


def compile_reduce_overhead(out: Path) -> dict:
    """smallcnn, not resnet18: the row proves CUDA graphs train under multicard; throughput is
    measured in the throughput step, and a small graph compiles in a fraction of the time."""
    overrides = ["model.name=smallcnn", "data.train_size=10240", "data.val_size=512", "data.loader=device",
                 "train.global_batch_size=512", "train.epochs=2", "precision=bf16", "compile=true",
                 "compile_mode=reduce-overhead", "log_every=10", "strategy=single", "devices=[0]"]  # fmt: skip
    return _trained(train_on_device(overrides, out / "reduce-overhead", warmup_steps=20, timeout_s=120))


PHOTOS: dict[str, Path] = {}  # --photos: where generated photos go (shared with gpu_decode.py)


def jpeg_folder(out: Path) -> Path:
    root, _ = photos(None, PHOTOS.get("dir", out / "photos"))
    return linked_folder(root, out / "imagefolder")


def workers_jpeg_pinned(out: Path) -> dict:
    import torch

    from multicard.base.config import load_config
    from multicard.data import build_data
    from multicard.data.loading.sampling import BatchSplit
    from multicard.runtime.process_group import ProcessContext

    folder = jpeg_folder(out)
    run = train_on_device([*JPEG, f"data.root={folder}", "strategy=single"], out / "workers-jpeg", warmup_steps=0,
                          timeout_s=90)  # fmt: skip
    if DEVICE["devices=[0]"] == "devices=cpu":
        return _trained(run)
    cfg = load_config(None, [*JPEG, f"data.root={folder}"])
    device = torch.device("cuda", 0)
    data = build_data(cfg.data, cfg.seed, BatchSplit(64, 1, 1), ProcessContext(0, 0, 1, 1, device, distributed=False))
    try:
        data.train.set_epoch(0)
        x, _ = next(iter(data.train))
    finally:
        data.close()
    if x.device.type != "cuda":
        raise AssertionError(f"the batch arrived on {x.device}")
    pinned = torch.cuda.host_memory_stats().get("allocated_bytes.allocated", 0)  # the pinned (host) allocator's
    if not pinned:
        raise AssertionError("no pinned host memory was allocated: the loader did not pin its batches")
    return _trained(run, batch_device=str(x.device), pinned_bytes=pinned)


def nvjpeg_train(out: Path) -> dict:
    folder = jpeg_folder(out)
    overrides = [*JPEG, f"data.root={folder}", "data.decode=gpu", "strategy=single"]
    run = train_on_device(overrides, out / "nvjpeg", warmup_steps=0,
                timeout_s=90)  # fmt: skip
    stderr = (out / "nvjpeg" / "stderr.txt").read_text() if (out / "nvjpeg" / "stderr.txt").exists() else ""
    if "nvjpeg could not decode" in stderr:
        raise AssertionError("nvjpeg fell back to Pillow: " + stderr.split("nvjpeg could not decode", 1)[1][:150])
    return _trained(run)


ROWS: list[tuple[str, Callable[[Path], dict]]] = [
    ("fsdp1_bf16_sharded", fsdp1_bf16_sharded),
    ("sigterm_resume_fp32", sigterm_resume_fp32),
    ("sigterm_resume_fp16", sigterm_resume_fp16),
    ("eval", eval_row),
    ("compile_reduce_overhead", compile_reduce_overhead),
    ("workers_jpeg_pinned", workers_jpeg_pinned),
    ("nvjpeg_train", nvjpeg_train),
]


def run_row(name: str, fn: Callable[[Path], dict], out: Path, skip: str | None) -> dict:
    if skip is None and seconds_left() < MIN_ROW_S:
        skip = "time budget spent"
    if skip is not None:
        return {"name": name, "status": "skipped", "reason": skip}
    start = time.perf_counter()
    try:
        row = {"name": name, "status": "passed", **fn(out)}
    except subprocess.TimeoutExpired as exc:
        row = {"name": name, "status": "failed", "reason": f"timed out after {exc.timeout:.0f} s"}
    except Exception as exc:  # a row's failure is its result; the next row still runs
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        row = {"name": name, "status": "failed", "reason": f"{type(exc).__name__}: {first}"}
    return {**row, "wall_s": round(time.perf_counter() - start, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/gpu-proofs"))
    p.add_argument("--cpu", action="store_true", help="run the rows that have a CPU form on the CPU")
    p.add_argument("--photos", type=Path, help="where to write JPEGs when none are at hand (default OUT/photos)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.photos:
        PHOTOS["dir"] = args.photos
    if args.cpu:
        DEVICE["devices=[0]"] = "devices=cpu"
    skip = None if args.cpu else cuda_or_reason()
    rows: list[dict] = []
    for name, fn in ROWS:
        rows.append(run_row(name, fn, args.out, "needs CUDA" if args.cpu and name in CUDA_ONLY else skip))
        print(f"{name:26s} {rows[-1]['status']:7s} {rows[-1].get('wall_s', 0):6.1f} s  {rows[-1].get('reason', '')}")
        (args.out / "proofs.json").write_text(json.dumps({"rows": rows}, indent=1))  # after every row
    sys.exit(1 if any(r["status"] == "failed" for r in rows) else 0)


if __name__ == "__main__":
    main()
