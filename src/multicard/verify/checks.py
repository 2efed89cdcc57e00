"""The checks `multicard verify` makes, as pure functions of what the runs recorded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

FAULTS = ("no-set-epoch", "rank-seed")  # setups broken on purpose (`multicard verify --break`)
PARAM_RTOL = 1e-9  # float64: reduction order alone moves parameters by ~1e-15 relative
LOSS_RTOL = 1e-12


@dataclass(frozen=True)
class Outcome:
    name: str
    status: str  # pass | fail | skip
    detail: str

    @property
    def failed(self) -> bool:
        return self.status == "fail"


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """max over tensors of max|a − b| / max|b| (floating tensors only), and where it is largest."""
    worst, where = 0.0, ""
    for name, ref in b.items():
        if not ref.is_floating_point():
            continue
        scale = ref.abs().max().item() or 1.0
        diff = (a[name].double() - ref.double()).abs().max().item() / scale
        if diff > worst or not where:
            worst, where = diff, name
    return worst, where


def compare_parameters(
    multi: dict[str, torch.Tensor], single: dict[str, torch.Tensor], label: str, steps: int
) -> Outcome:
    diff, where = max_relative_difference(multi, single)
    name = f"{label} equals single after {steps} steps (float64)"
    detail = f"max relative difference {diff:.2e} (largest in {where}; tolerance {PARAM_RTOL:.0e})"
    return Outcome(name, "pass" if diff <= PARAM_RTOL else "fail", detail)


def compare_eval(multi: dict[str, Any], single: dict[str, Any], world: int) -> Outcome:
    """The same parameters evaluated by 1 and by `world` processes must give the same sums."""
    name = f"evaluation identical with 1 and {world} processes"
    same_count = multi["samples"] == single["samples"]
    same_top1 = multi["top1"] == single["top1"] and multi["top5"] == single["top5"]
    loss_diff = abs(multi["loss"] - single["loss"]) / max(abs(single["loss"]), 1e-300)
    detail = (
        f"samples {multi['samples']} vs {single['samples']}, top-1 {multi['top1']:.4f}% vs {single['top1']:.4f}%, "
        f"loss relative difference {loss_diff:.1e}"
    )
    ok = same_count and same_top1 and loss_diff <= LOSS_RTOL
    return Outcome(name, "pass" if ok else "fail", detail)


def check_coverage(epochs: list[list[list[int]]], num_samples: int, global_batch: int) -> Outcome:
    """`epochs[e][r]`: the sample indices rank r trains on in epoch e.

    Each epoch must use every sample at most once across ranks and all but fewer than one
    global batch, and consecutive epochs must not repeat one order (set_epoch reached the sampler).
    """
    name = "every sample seen once per epoch, a new order each epoch"
    expected = num_samples // global_batch * global_batch
    for e, ranks in enumerate(epochs):
        seen = [i for rank in ranks for i in rank]
        unique = set(seen)
        if len(seen) != len(unique):
            dupes = len(seen) - len(unique)
            detail = f"epoch {e}: {dupes} sample(s) used twice across ranks (the ranks disagree on the order)"
            return Outcome(name, "fail", detail)
        if len(unique) != expected:
            return Outcome(name, "fail", f"epoch {e}: {len(unique)} samples used, expected {expected}")
    for e in range(1, len(epochs)):
        if epochs[e] == epochs[e - 1]:
            detail = f"epoch {e} repeats epoch {e - 1}'s order: the sampler's epoch is not advancing"
            return Outcome(name, "fail", detail)
    return Outcome(name, "pass", f"{len(epochs)} epochs × {expected} samples, each once, order reshuffled")


def has_dropout(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
