"""This machine's calibration record: the rates `--calibrate` measured here (calibrate.py, the
procedure), stored as JSON in the cache folder and used when planning for this machine."""

from __future__ import annotations

import contextlib
import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from multicard.data import default_cache_dir
from multicard.runtime.process_group import cpu_cores

RATE_KEYS = ("flops", "matmul_flops", "grouped_flops", "grouped_backward_flops", "transcendental", "bandwidth",
             "norm_bandwidth", "fresh_bandwidth")  # fmt: skip


def calibration_path() -> Path:
    return default_cache_dir() / "calibration.json"


def machine_id() -> str:
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {cpu_cores()} cores, torch {torch.__version__}"


@dataclass
class Calibration:
    DEFAULT_RUNTIME: ClassVar[int] = 600 * 2**20  # uncalibrated guess: interpreter, torch, allocator slack

    machine: str
    rates: dict[int, dict[str, float]]  # threads per process -> RATE_KEYS
    allreduce_bus_bandwidth: float  # gloo between this machine's processes, bytes/s
    allreduce_latency: float
    runtime_bytes: int  # a training process besides tensors (batches made on the device)
    runtime_workers_bytes: int = 0  # the same with the workers loader (PIL, transforms, DataLoader)
    fsdp_unit_s: float = 0.0
    date: str = ""
    calibrated: bool = True
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def default(cls) -> Calibration:
        """Rough rates of a recent x86 core, used until `--calibrate` has run here."""
        rates = {1: {"flops": 40e9, "matmul_flops": 40e9, "grouped_flops": 4e9, "grouped_backward_flops": 2e9,
                     "transcendental": 1e9, "bandwidth": 10e9, "norm_bandwidth": 4e9,
                     "fresh_bandwidth": 3e9}}  # fmt: skip
        return cls("uncalibrated", rates, 1e9, 100e-6, cls.DEFAULT_RUNTIME, cls.DEFAULT_RUNTIME, 0.02, calibrated=False)

    def rates_for(self, threads: int) -> dict[str, float]:
        """The rates at `threads`, linear in threads between (and beyond) the measured counts."""
        if threads in self.rates:
            return self.rates[threads]
        known = sorted(self.rates)
        lo = max([t for t in known if t <= threads], default=known[0])
        hi = min([t for t in known if t >= threads], default=known[-1])
        if lo == hi:
            return {k: v * threads / lo for k, v in self.rates[lo].items()}
        w = (threads - lo) / (hi - lo)
        return {k: self.rates[lo][k] + w * (self.rates[hi][k] - self.rates[lo][k]) for k in RATE_KEYS}

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Calibration | None:
        """The stored calibration if it was made on this machine (same CPU, cores and torch)."""
        try:
            data = json.loads(path.read_text())
            data["rates"] = {int(k): {r: float(v.get(r, 0.0)) for r in RATE_KEYS}  # older files lack some (0: unused)
                             for k, v in data["rates"].items()}  # fmt: skip
            cal = cls(**data)
        except (OSError, ValueError, TypeError, KeyError):
            return None
        return cal if cal.machine == machine_id() else None
