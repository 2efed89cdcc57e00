"""The checks `multicard verify` makes, as pure functions of what the runs recorded."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from multicard.strategy import OPTIMIZER_KERNEL_KEYS

CHECKS = ("parity", "eval", "coverage", "resume")  # what `multicard verify --checks` may select
RUN_FAULTS = ("no-set-epoch", "rank-seed")  # the job's setup broken on purpose (`multicard verify --break`)
RESUME_FAULTS = ("rng", "data-position")  # the state its checkpoints drop on purpose
FAULTS = (*RUN_FAULTS, *RESUME_FAULTS)
# Why 1e-9 (issue 37; docs/benchmarks.md "verify's parity on the speed recipe" has the numbers): in
# float64 another order of the same sums (N ranks, an all-reduce, another thread count) moves a value
# by ~1e-16 relative, and 4 steps of training carry that to 1e-14 (measured: smallcnn 4.6e-14,
# speednet on synthetic data 2.8e-14); a real difference (a rank reading other samples, an epoch
# that never reaches the sampler) moves parameters by 1e-3 or more (measured: --break rank-seed 1.4,
# no-set-epoch 0.41). 1e-9 is 10^4 above rounding and 10^6 below the smallest such difference.
#
# Where rounding decides a comparison, training carries it further, and no order of sums avoids it:
# speednet on CIFAR-10 passes on saturated GELU outputs (~-1e-14) that BatchNorm maps onto one float64
# value ± 1 ulp, so max-pooling picks its winner among them by rounding (0-4 windows of a 512-image
# batch differ between any two orders of the same sums) and the gradient reaches another pixel: the
# parameters part by 2e-10 to 2.3e-9 after 4 steps. One process differs that much from itself at
# another thread count (seed 1: 1.4e-9). So above 1e-9 verify measures that floor (the one-process
# run again at another thread count) and allows FLOOR_FACTOR times it: a difference of the size one
# process makes with itself is rounding, not a distributed difference. One such sample of rounding
# can lie 10× below another (seed 0: one process 2.4e-10 from itself, ddp×2 2.3e-9 from it; seed 1:
# 1.4e-9 both), as 0-4 windows flip; hence 100×, and never more than ROUNDING_CAP, 10^5 below the
# smallest real difference.
PARAM_RTOL = 1e-9
FLOOR_FACTOR = 100
ROUNDING_CAP = 1e-6
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
        diff = _difference(a[name], ref)
        if diff > worst or not where:
            worst, where = diff, name
    return worst, where


def compare_parameters(
    multi: dict[str, torch.Tensor], single: dict[str, torch.Tensor], label: str, steps: int,
    floor: float | None = None,
) -> Outcome:  # fmt: skip
    """`floor`: how far one process lands from itself at another thread count (see PARAM_RTOL)."""
    diff, where = max_relative_difference(multi, single)
    name = f"{label} equals single after {steps} steps (float64)"
    detail = f"max relative difference {diff:.2e} (largest in {where}; tolerance {PARAM_RTOL:.0e})"
    if diff <= PARAM_RTOL or floor is None:
        return Outcome(name, "pass" if diff <= PARAM_RTOL else "fail", detail)
    scaled = FLOOR_FACTOR * floor
    tolerance = min(ROUNDING_CAP, max(PARAM_RTOL, scaled))
    itself = f"max relative difference {diff:.2e} (largest in {where}); one process differs from itself by {floor:.2e}"
    if scaled <= PARAM_RTOL:
        rule = f"at another thread count, so rounding does not explain more: the tolerance stays {PARAM_RTOL:.0e}"
    else:
        most = f", at most {ROUNDING_CAP:.0e}" if scaled > ROUNDING_CAP else ""
        rule = (
            f"at another thread count (rounding decides comparisons in this model), so the tolerance is "
            f"{FLOOR_FACTOR}× that{most}: {tolerance:.1e}"
        )
    return Outcome(name, "pass" if diff <= tolerance else "fail", f"{itself} {rule}")


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


def check_coverage(epochs: list[list[list[int]]], num_samples: int, global_batch: int, repeats: int = 1) -> Outcome:
    """`epochs[e][r]`: the sample indices rank r trains on in epoch e.

    Each epoch must use every sample at most once across ranks and all but fewer than one
    global batch, and consecutive epochs must not repeat one order (set_epoch reached the sampler).
    With repeated augmentation (data.repeats) an index j·N + i is copy j of sample i: each copy
    at most once, and 1/repeats of the samples, each `repeats` times.
    """
    name = "every sample seen once per epoch, a new order each epoch"
    if repeats > 1:
        name = f"every sample's {repeats} copies seen once per epoch, a new order each epoch"
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
        copies = Counter(i % num_samples for i in unique)
        if set(copies.values()) != {repeats}:
            return Outcome(name, "fail", f"epoch {e}: a sample has {min(copies.values())} of its {repeats} copies")
    for e in range(1, len(epochs)):
        if epochs[e] == epochs[e - 1]:
            detail = f"epoch {e} repeats epoch {e - 1}'s order: the sampler's epoch is not advancing"
            return Outcome(name, "fail", detail)
    each = "each once" if repeats == 1 else f"{expected // repeats} samples × {repeats} copies"
    return Outcome(name, "pass", f"{len(epochs)} epochs × {expected} samples, {each}, order reshuffled")


def has_dropout(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


# ---------------------------------------------------------------- resume

# What a resumed run must continue, by name, and where each lives in a recorded state
# (the loop's `state_dict(whole=True)` plus `next_batch`, the samples of the step the run takes next).
STATE_PARTS = {
    "model": ("model",),
    "optimizer": ("optimizer", "scaler"),
    "scheduler": ("scheduler",),
    "RNG": ("rng",),
    "data position": ("position", "next_batch"),
}
RESUME_RTOL = 1e-10  # float64, another world size: reduction order alone moves values by ~1e-15


def resume_cut(steps: int, steps_per_epoch: int) -> int | None:
    """The step at which the resume check stops a K-step run: inside an epoch (not at its end),
    nearest the middle of the run; None when every step of the run ends an epoch."""
    inside = [c for c in range(1, steps) if c % steps_per_epoch]
    return min(inside, key=lambda c: abs(2 * c - steps)) if inside else None


def leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """The leaves of nested dicts, lists and tuples by dotted path; a sequence of plain values is one leaf."""
    if isinstance(tree, dict):
        items: Any = tree.items()
    elif isinstance(tree, (list, tuple)) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in tree):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def leaf_difference(a: Any, b: Any) -> float:
    """0 when identical; the relative difference of floating values; inf when they differ otherwise."""
    diff = _difference(a, b)
    return diff if diff == diff else float("inf")  # NaN where the other run has a number


def _difference(a: Any, b: Any) -> float:
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            return float("inf")
        if torch.equal(a, b):
            return 0.0
        if not (a.is_floating_point() and b.is_floating_point()):
            return float("inf")
        return ((a.double() - b.double()).abs().max() / (b.double().abs().max().item() or 1.0)).item()
    if isinstance(b, (list, tuple)) and isinstance(a, (list, tuple)) and len(a) == len(b):
        return max((leaf_difference(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    if isinstance(b, float) and isinstance(a, (int, float)) and not isinstance(a, bool):
        return 0.0 if a == b else abs(a - b) / (abs(b) or 1.0)
    return 0.0 if a == b else float("inf")


def _unequal(path: str, a: Any, b: Any) -> str:
    """How two leaves that are not close differ, in a few words."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
        if a.numel() == 1:
            return f"{path}: {a.item()} vs {b.item()}"
        return f"{path}: {int((a != b).sum())} of {b.numel()} values differ"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return f"{path}: shapes {list(getattr(a, 'shape', []))} vs {list(getattr(b, 'shape', []))}"
    text = f"{a!r} vs {b!r}"
    if len(text) <= 40:
        return f"{path}: {text}"
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return f"{path}: {sum(x != y for x, y in zip(a, b, strict=True))} of {len(b)} values differ"
    return f"{path} differs"


def _parts(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The state's leaves, by part; the optimizer's kernel choices (fused, foreach) left out:
    they say how an update is computed, not what it computes."""
    kernels = tuple("." + k for k in OPTIMIZER_KERNEL_KEYS)
    return {
        part: {p: v for k in keys for p, v in leaves(state.get(k, {}), k).items() if not p.endswith(kernels)}
        for part, keys in STATE_PARTS.items()
    }


def part_differences(resumed: dict[str, Any], reference: dict[str, Any], rtol: float) -> dict[str, str]:
    """Each part of the state (model, optimizer, ...) that differs by more than `rtol` (0: bitwise),
    with where: 'position.step_in_epoch: 0 vs 1', 'model.0.0.weight: 3.2e-04'."""
    out = {}
    ref_parts = _parts(reference)
    for part, mine in _parts(resumed).items():
        ref = ref_parts[part]
        worst, where = 0.0, ""
        for path in [*ref, *(p for p in mine if p not in ref)]:  # in the state's own order
            if path not in ref or path not in mine:
                worst, where = float("inf"), f"{path} only in the {'resumed' if path in mine else 'uninterrupted'} run"
                break
            diff = leaf_difference(mine[path], ref[path])
            if diff == float("inf"):
                worst, where = diff, _unequal(path, mine[path], ref[path])
                break
            if diff > worst:
                worst, where = diff, f"{path}: relative difference {diff:.1e}"
        if worst > rtol:
            out[part] = where
    return out


def largest_difference(resumed: dict[str, Any], reference: dict[str, Any]) -> tuple[float, str]:
    """The largest relative difference over every part, and where (for a passing check's line)."""
    worst, where = 0.0, ""
    ref_parts = _parts(reference)
    for part, mine in _parts(resumed).items():
        for path, value in mine.items():
            if path in ref_parts[part]:
                diff = leaf_difference(value, ref_parts[part][path])
                if diff > worst:
                    worst, where = diff, path
    return worst, where


def compare_resumed(name: str, points: list[tuple[str, dict[str, Any], dict[str, Any]]], rtol: float) -> Outcome:
    """`points`: (when, resumed run's state, uninterrupted run's state). Passes when every part
    agrees at every point (bitwise when rtol is 0); else names the parts that differ, where first."""
    failures: list[str] = []
    for when, resumed, reference in points:
        differ = part_differences(resumed, reference, rtol)
        if differ and not failures:  # where it first differs, in detail
            verb = "differs" if len(differ) == 1 else "differ"
            failures.append(f"{when}: {', '.join(differ)} {verb} ({'; '.join(differ.values())})")
        elif differ:
            failures.append(f"{when}: {', '.join(differ)}")
    if failures:
        return Outcome(name, "fail", " · ".join(failures))
    whens = " and ".join(when for when, _, _ in points)
    agree = "identical" if rtol == 0 else f"within {rtol:.0e}"
    detail = f"{', '.join(STATE_PARTS)} {agree} {whens}"
    if rtol:
        worst, where = max(largest_difference(r, u) for _, r, u in points)
        detail += f" (largest relative difference {worst:.1e}, in {where or 'none'})"
    return Outcome(name, "pass", detail)
