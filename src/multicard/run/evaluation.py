"""`run.evaluate(model, dataset, metric_fn)`: exact evaluation of any task, at any world size.

Each rank runs `metric_fn(model, batch)` over its own share of the dataset (every sample once
over all ranks, no padding, as many batches on every rank) and sums what it returns; the sums
are then reduced over ranks. Metrics are therefore sums — a per-sample tensor (each element is
added), or a batch's sum — and ratios are taken after the reduction (accuracy = correct /
samples, IoU = intersection / union, perplexity = exp(loss sum / tokens)), never as a mean of
per-rank means.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from numbers import Number
from typing import TYPE_CHECKING, Any, SupportsFloat, cast

import torch
import torch.nn as nn

from multicard.base.errors import UserError
from multicard.data.loading.keyed import move_to
from multicard.data.loading.workers import shutdown_workers
from multicard.engine.phases import EVALUATION, IDLE, PhaseClock
from multicard.run.loading import evaluation_batches

if TYPE_CHECKING:
    from multicard.assembly.parts import Assembly
    from multicard.strategy.base import Strategy

MetricFn = Callable[[nn.Module, Any], dict[str, Any]]


class Scores(dict):
    """Each metric's sum over the whole dataset, and "samples": how many samples were evaluated."""

    @property
    def samples(self) -> int:
        return int(self["samples"])

    def mean(self, name: str) -> float:
        """`name`'s sum per sample."""
        return self[name] / self.samples if self.samples else float("nan")


def _sum(name: str, value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64).sum()
    if isinstance(value, Number) and not isinstance(value, (bool, complex)):  # int, float, Decimal, numpy's…
        return torch.tensor(float(cast(SupportsFloat, value)), dtype=torch.float64, device=device)
    raise UserError(
        f"metric_fn returned {name}={type(value).__name__}; return a dict of numbers or tensors "
        f"(their elements are summed)"
    )


@torch.no_grad()
def evaluate_sums(
    model: nn.Module, batches: Iterable[tuple[Any, int]], metric_fn: MetricFn, strategy: Strategy,
    progress: Callable[[], None],
) -> Scores:  # fmt: skip
    """Sums of `metric_fn` over `batches` ((batch, samples in it) pairs of this rank), reduced over
    ranks; `model` as given (unwrapped by the caller: DDP's forward would sync with the others). A
    batch of 0 samples runs its forward only (every rank makes as many)."""
    device = strategy.ctx.device
    was_training = model.training
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    samples = 0
    for batch, count in batches:
        with strategy.precision.autocast():
            values = metric_fn(model, move_to(batch, device, strategy.precision.param_dtype))
        if not isinstance(values, dict):
            raise UserError(f"metric_fn returned {type(values).__name__}; return a dict such as {{'correct': ...}}")
        for name, value in values.items() if count else ():
            totals[name] = totals.get(name, 0) + _sum(name, value, device)
        samples += count
        progress()
    model.train(was_training)
    names = sorted({n for names in strategy.all_gather_object(sorted(totals)) for n in names})
    zero = torch.zeros((), dtype=torch.float64, device=device)
    packed = torch.stack([*(totals.get(n, zero) for n in names), torch.tensor(float(samples), device=device).double()])
    reduced = strategy.all_reduce_sum(packed).tolist()
    return Scores({**dict(zip(names, reduced[:-1], strict=True)), "samples": int(reduced[-1])})


def evaluate_in(
    parts: Assembly, clock: PhaseClock, model: nn.Module, dataset: Any, metric_fn: MetricFn, options: tuple[Any, ...]
) -> Scores:  # fmt: skip
    """run.evaluate: `model` unwrapped (DDP's forward would wait for the other ranks' forwards) with
    rank 0's BatchNorm statistics (as checkpoints hold them), over this rank's share of `dataset`."""
    loader, batches = evaluation_batches(dataset, parts, *options)
    bare = parts.strategy.unwrap(model)
    parts.strategy.agree_buffers(bare)
    clock.set_phase(EVALUATION)
    try:
        return evaluate_sums(bare, batches, metric_fn, parts.strategy, clock.tick)
    finally:
        clock.set_phase(IDLE)
        if loader is not None:
            shutdown_workers(loader)
