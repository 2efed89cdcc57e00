"""What the run's records are made of, beside the values its loop logs (run/logbook.py, the one
meter): the split of a step's time, the devices' peak memory, and the classifier's evaluation
result as the callbacks see it (`EvalResult`, read back from an epoch record)."""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from multicard.engine.phases import COMMUNICATION, DATA, StepTimes, split

if TYPE_CHECKING:  # annotations only: the strategies import torch's sharding stack
    from multicard.strategy.base import Strategy


@dataclass(frozen=True)
class EvalResult:
    loss: float
    top1: float  # percent
    top5: float  # percent
    samples: int

    def as_dict(self) -> dict[str, Any]:
        return {"top1": self.top1, "top5": self.top5, "loss": self.loss, "samples": self.samples}

    @classmethod
    def in_record(cls, record: dict[str, Any]) -> EvalResult | None:
        """The validation an epoch record holds (val_loss, val_top1, val_top5, val_samples: what the
        classifier recipe logs after evaluating), or None."""
        keys = ("val_loss", "val_top1", "val_top5", "val_samples")
        if any(k not in record for k in keys):
            return None
        loss, top1, top5, samples = (record[k] for k in keys)
        return cls(loss=loss, top1=top1, top5=top5, samples=int(samples))


def peak_memory_mb(devices: list[torch.device]) -> list[float]:
    """Peak memory of each device this process uses (CPU: the process's peak RSS)."""
    out = []
    for device in devices:
        if device.type == "cuda":
            out.append(torch.cuda.max_memory_allocated(device) / 2**20)
        else:
            out.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return [round(v, 1) for v in out]


def every_peak_memory_mb(strategy: Strategy) -> list[float]:
    """Peak memory of every device of every rank, in rank order. A collective."""
    per_rank = strategy.all_gather_object(peak_memory_mb(strategy.devices))
    return [mb for rank_peaks in per_rank for mb in rank_peaks]


def step_split(step_times: list[StepTimes], strategy: Strategy) -> tuple[dict[str, float], dict[str, float]]:
    """The mean step of `step_times`: its split (data / compute / exposed communication / optimizer
    ms), and this rank's step, busy (not waiting for the others) and data ms."""
    seconds = [t.seconds() for t in step_times]
    mean = {k: sum(s[k] for s in seconds) / len(seconds) for k in seconds[0]} if seconds else {}
    parts = split(mean) if mean else {}
    if not strategy.reduces_gradients and strategy.ctx.world_size > 1:
        parts.pop("comm_exposed_ms", None)  # fsdp's gathers and scatters run inside forward and backward
    step_ms = 1000 * sum(mean.values()) if mean else 0.0
    mine = {
        "step_ms": round(step_ms, 3),
        "busy_ms": round(step_ms - 1000 * mean.get(COMMUNICATION, 0.0), 3),
        "data_ms": round(1000 * mean.get(DATA, 0.0), 3),
    }
    return parts, mine
