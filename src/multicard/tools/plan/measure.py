"""Real steps of multicard's own loop on this machine, in worker processes started through
torchrun's API (launch.run_spec), for `--measure` and `--calibrate`: `run_steps` and `run_alone`
measure one config; `measure_here` measures every strategy the plan for this machine can run,
beside what the plan predicted for it (`multicard plan --measure`, benchmarks/plan_accuracy.py)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from multicard.base.config import Config, to_dict, with_overrides
from multicard.base.errors import UserError
from multicard.runtime.launch import run_spec
from multicard.runtime.process_group import cpu_cores, cuda_count
from multicard.tools.plan.calibration import Calibration, calibration_path
from multicard.tools.plan.candidates import DEFAULT_HEADROOM
from multicard.tools.plan.cgroup_cap import MemoryCap
from multicard.tools.plan.hardware import gpu_for_device
from multicard.tools.plan.planner import Plan, Row, make_plan
from multicard.tools.plan.target import Target, make_target

MEMORY_STEPS = 2  # the first step makes the optimizer state; the second is a steady one


@dataclass
class Measured:
    ok: bool
    reason: str = ""
    peak_bytes: float = 0.0  # the largest rank's peak of live tensor bytes (CUDA: max_memory_allocated)
    step_s: float = 0.0  # median over ranks of each rank's median step time
    step_min_s: float = 0.0  # the fastest step (the largest rank's), least disturbed by other work
    split_ms: dict[str, float] = field(default_factory=dict)  # rank 0's phase split (median per phase)
    split_min_ms: dict[str, float] = field(default_factory=dict)  # rank 0's fastest step's split
    rss_peak_bytes: float = 0.0  # the largest rank's peak resident memory
    threads: int = 0
    allreduce_ms: dict[int, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Its fields but the all-reduce times (calibrate's, not a row's of the plan)."""
        return {key: value for key, value in asdict(self).items() if key != "allreduce_ms"}


def run_steps(cfg: Config, processes: int, steps: int, workdir: Path | None = None,
              allreduce_bytes: list[int] | None = None, profile_memory: bool = True) -> Measured:  # fmt: skip
    """MEMORY_STEPS steps with memory measured, one warm-up step and `steps` timed steps of `cfg`
    in `processes` workers (each runs multicard train's recipe: plan/worker.py)."""
    spec = {"config": to_dict(cfg), "memory_steps": MEMORY_STEPS, "warmup": 1, "steps": steps,
            "allreduce_bytes": allreduce_bytes or [], "profile_memory": profile_memory}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="multicard-plan-") as tmp:
        code, result = run_spec("multicard.tools.plan.worker", spec, processes, workdir or Path(tmp))
    if code != 0 or result is None:
        return Measured(False, f"workers exited with code {int(code)}")
    return _summary(result)


def run_alone(cfg: Config, steps: int, cap: MemoryCap | None = None, profile_memory: bool = False) -> Measured:
    """The same steps in one plain process (strategy single, no launcher), inside `cap` if given,
    whose peak charge (cap.max_usage) then says what the process needed under a memory cap."""
    with tempfile.TemporaryDirectory(prefix="multicard-plan-") as tmp:
        spec_path, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps({"config": to_dict(cfg), "memory_steps": MEMORY_STEPS, "warmup": 1,
                                         "steps": steps, "profile_memory": profile_memory,
                                         "result": str(result)}))  # fmt: skip
        argv = [sys.executable, "-m", "multicard.tools.plan.worker", str(spec_path)]
        done = cap.run(argv, timeout=3600) if cap else subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0 or not result.exists():
            return Measured(False, f"the run exited with code {done.returncode}")
        return _summary(json.loads(result.read_text()))


def _summary(result: dict[str, Any]) -> Measured:
    ranks = result["ranks"]
    return Measured(
        True,
        peak_bytes=max(r["peak_bytes"] for r in ranks),
        step_s=statistics.median(r["step_s"] for r in ranks if r["step_s"] is not None),
        split_ms=ranks[0]["split_ms"],
        step_min_s=max(min(r["step_s_all"]) for r in ranks),
        split_min_ms=ranks[0]["split_min_ms"],
        rss_peak_bytes=max(r["rss_peak_bytes"] for r in ranks),
        threads=ranks[0]["threads"],
        allreduce_ms={int(k): v for k, v in result.get("allreduce_ms", {}).items()},
    )


# ------------------------------------------------------------------ every strategy, against the plan


def local_target(gpus: int, memory_gb: float | None = None) -> Target:
    """This machine as a plan target: up to `gpus` of its GPUs if it has CUDA, else as many CPU
    processes (with `memory_gb` per process, if given)."""
    cal = Calibration.load(calibration_path())
    here = cuda_count()
    if here:
        name = torch.cuda.get_device_name(0)
        entry = gpu_for_device(name)
        if entry is None:
            raise UserError(f"--measure: this machine's GPU ({name}) is not in multicard plan's table")
        return make_target(entry.name, None, min(gpus, here), 1, None, None)
    processes = max(1, min(gpus, cpu_cores()))
    if memory_gb is not None:
        return make_target(None, memory_gb, processes, 1, None, cal)
    return make_target("cpu", None, processes, 1, None, cal)


def measurement_config(cfg: Config, steps: int) -> Config:
    """The config as measured: few samples (enough for the steps), a throwaway out_dir."""
    total = MEMORY_STEPS + 1 + steps
    changes = [f"out_dir={tempfile.mkdtemp(prefix='multicard-plan-')}", "train.resume=never"]
    if cfg.data.name == "synthetic":
        changes += [f"data.train_size={cfg.train.global_batch_size * total}",
                    f"data.val_size={min(cfg.data.val_size, 64)}"]  # fmt: skip
    return with_overrides(cfg, changes)


def measure_here(
    cfg: Config, cfg_path: str | None, overrides: list[str], *, gpus: int, memory_gb: float | None = None,
    steps: int = 3, strategies: Sequence[str] | None = None, headroom: float = DEFAULT_HEADROOM,
    console: Console | None = None,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """`steps` real steps of every strategy (of `strategies`, if given) that fits on this machine,
    beside the plan's prediction for it (the plan for this machine and the measured config), by
    strategy key; a table of both on `console`."""
    console = console or Console(stderr=True)
    target = local_target(gpus, memory_gb)
    mcfg = measurement_config(cfg, steps)
    try:
        plan = make_plan(mcfg, cfg_path, overrides, target, headroom)
        results = {r.candidate.key: _measure_row(r, mcfg, target, steps, console) for r in plan.rows
                   if strategies is None or r.candidate.key in strategies}  # fmt: skip
    finally:
        shutil.rmtree(mcfg.out_dir, ignore_errors=True)
    console.print(measured_table(plan, results))
    return results


def _measure_row(row: Row, mcfg: Config, target: Target, steps: int, console: Console) -> dict[str, Any]:
    if not row.fits or row.fit_memory is None or row.time is None:
        return {"ok": False, "reason": row.reason or row.status}
    run_cfg = with_overrides(mcfg, [*row.candidate.overrides, f"train.grad_accum={row.accum}",
                                    *([] if target.cuda else ["devices=cpu"])])  # fmt: skip
    console.print(f"measure: {row.candidate.label}, {row.processes} process(es), micro-batch "
                  f"{row.fit_micro_batch} × {row.accum} accum", highlight=False)  # fmt: skip
    return {
        **run_steps(run_cfg, row.processes, steps).as_dict(),
        "micro_batch": row.fit_micro_batch,
        "grad_accum": row.accum,
        "predicted_tensor_bytes": row.fit_memory.tensors,
        "predicted_step_s": row.time.total_s,
    }


def measured_table(plan: Plan, results: dict[str, dict[str, Any]]) -> Table:
    t = Table(title=f"measured on {plan.target.label} vs predicted (tensor memory per process, step time)")
    for name in ("strategy", "micro × accum", "predicted MiB", "measured MiB", "ratio", "predicted ms",
                 "measured ms", "ratio"):  # fmt: skip
        t.add_column(name, justify="left" if name == "strategy" else "right")
    for row in plan.rows:
        r = results.get(row.candidate.key, {})
        if not r.get("ok"):
            t.add_row(row.candidate.label, f"[dim]{r.get('reason', '')}[/dim]")
            continue
        pm, mm = r["predicted_tensor_bytes"], r["peak_bytes"]
        pt, mt = r["predicted_step_s"], r["step_s"]
        t.add_row(
            row.candidate.label,
            f"{r['micro_batch']} × {r['grad_accum']}",
            *(f"{pm / 2**20:,.1f}", f"{mm / 2**20:,.1f}", f"{pm / mm:.3f}"),
            *(f"{pt * 1000:,.0f}", f"{mt * 1000:,.0f}", f"{pt / mt:.2f}"),
        )
    return t
