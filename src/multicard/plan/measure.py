"""Real steps of multicard's own loop on this machine, in worker processes started through
torchrun's API (launch.run_spec), for `--measure` and `--calibrate`."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multicard.config import Config, to_dict
from multicard.launch import run_spec
from multicard.plan.memcap import MemoryCap

MEMORY_STEPS = 2  # the first step makes the optimizer state; the second is a steady one


@dataclass
class Measured:
    ok: bool
    reason: str = ""
    peak_bytes: float = 0.0  # the largest rank's peak of live tensor bytes (CUDA: max_memory_allocated)
    step_s: float = 0.0  # median over ranks of each rank's median step time
    split_ms: dict[str, float] = field(default_factory=dict)  # rank 0's phase split (median per phase)
    step_min_s: float = 0.0  # the fastest step (the largest rank's), least disturbed by other work
    split_min_ms: dict[str, float] = field(default_factory=dict)  # rank 0's fastest step's split
    rss_peak_bytes: float = 0.0  # the largest rank's peak resident memory
    threads: int = 0
    allreduce_ms: dict[int, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "reason": self.reason,
            "peak_bytes": self.peak_bytes,
            "step_s": self.step_s,
            "step_min_s": self.step_min_s,
            "split_ms": self.split_ms,
            "split_min_ms": self.split_min_ms,
            "rss_peak_bytes": self.rss_peak_bytes,
            "threads": self.threads,
        }


def run_steps(cfg: Config, processes: int, steps: int, workdir: Path | None = None,
              allreduce_bytes: list[int] | None = None, profile_memory: bool = True) -> Measured:  # fmt: skip
    """MEMORY_STEPS steps with memory measured, one warm-up step and `steps` timed steps of `cfg`
    in `processes` workers (each builds its run with session.open_session)."""
    spec = {"config": to_dict(cfg), "memory_steps": MEMORY_STEPS, "warmup": 1, "steps": steps,
            "allreduce_bytes": allreduce_bytes or [], "profile_memory": profile_memory}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="multicard-plan-") as tmp:
        code, result = run_spec("multicard.plan.worker", spec, processes, workdir or Path(tmp))
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
        argv = [sys.executable, "-m", "multicard.plan.worker", str(spec_path)]
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
