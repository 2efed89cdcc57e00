"""A traced step at any micro-batch, from two small traces.

Two traces of the same step at micro-batches a < b run the same ops in the same order; every
per-op quantity (live bytes, saved activations, FLOPs, bytes moved) is then an exact affine
function of the micro-batch n: v_t(n) = c_t + s_t · n. The peak of live bytes is the maximum
of these lines, so it is exact at every n even where the op holding the peak changes with n
(a straight line through two peaks is not). Quantities that do not depend on n (gradients,
FSDP unit windows) are read from the first trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from multicard.base.config import Config
from multicard.tools.plan.trace import StepTrace, trace_step

FORWARD_BACKWARD = ("data", "forward", "backward", "communication")
TRACED_BATCHES = (2, 4)  # small (fast to trace) and >= 2 (BatchNorm refuses one sample on 1×1 maps)


@dataclass
class Line:
    """c + s·n per op."""

    c: np.ndarray
    s: np.ndarray

    def at(self, n: float) -> np.ndarray:
        return self.c + self.s * n


def _line(a: np.ndarray, b: np.ndarray, na: int, nb: int) -> Line:
    s = (b - a).astype(np.float64) / (nb - na)
    return Line(a - s * na, s)


class StepModel:
    """The step of one config at any micro-batch (see the module docstring)."""

    def __init__(self, small: StepTrace, large: StepTrace) -> None:
        if len(small.ops.live) != len(large.ops.live) or small.ops.names != large.ops.names:
            raise ValueError("the two traces ran different ops; trace the micro-batch itself")
        self.trace = small
        na, nb = small.batch, large.batch
        a, b = small.ops, large.ops
        self.live = _line(a.live, b.live, na, nb)
        self.live_cuda = _line(a.live_cuda, b.live_cuda, na, nb)
        self.saved = _line(a.saved, b.saved, na, nb)
        self.flops = _line(a.flops, b.flops, na, nb)
        self.moved = _line(a.moved, b.moved, na, nb)
        self.fresh = _line(a.fresh, b.fresh, na, nb)
        self.elements = _line(a.elements, b.elements, na, nb)
        self.largest_activation = _line(np.array([small.largest_activation]), np.array([large.largest_activation]),
                                        na, nb)  # fmt: skip
        self.grads = a.grads.astype(np.float64)
        self.phase = np.array(a.phase)
        self.forward_backward = np.isin(self.phase, FORWARD_BACKWARD)
        self.kind = a.kind

    @property
    def ops(self) -> int:
        return len(self.grads)


def step_model(cfg: Config, num_classes: int) -> StepModel:
    """The step of `cfg` at any micro-batch, from traces at TRACED_BATCHES."""
    a, b = TRACED_BATCHES
    return StepModel(trace_step(cfg, a, num_classes), trace_step(cfg, b, num_classes))
