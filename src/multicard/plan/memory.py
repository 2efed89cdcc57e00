"""Per-device memory of each strategy, op by op, from the traced single-device step.

Every strategy runs the same ops on each device; what differs is which parameters, gradients
and optimizer state a device holds at each op, and what its communication keeps. So each
rule rewrites the single-device timeline (StepModel, affine in the micro-batch n) and the
peak is the maximum over ops of the rewritten total, split into components at that op:

- single: the trace itself, with the optimizer state of a steady step (the first step makes
  it in its optimizer phase; later steps hold it throughout).
- dp (N GPUs): each GPU runs n/N; replicas hold parameters and gradients, not the optimizer
  state; the first GPU also holds the whole micro-batch before it is scattered and the
  gradients summed from the replicas ("first GPU extra").
- ddp: + DDP's gradient buckets (a copy of the gradients, persistent); with
  ddp.gradient_as_bucket_view the gradients live in the buckets instead.
- ZeRO-1 (ddp.shard_optimizer): ddp, with the optimizer state of this rank's parameters
  only, split as torch's ZeroRedundancyOptimizer splits them (largest first, greedily).
- FSDP (ZeRO-3 / ZeRO-2, HSDP): parameters, gradients and optimizer state sharded over the
  shard group; each unit's parameters gathered whole while it runs (ZeRO-3: its forward and
  backward, the next unit prefetched in backward; ZeRO-2: from its forward to the end of its
  backward); a unit's gradients whole from their arrival until its reduce-scatter, then a
  shard; the optimizer runs fused on shards where torch can (AdamW), else unfused (its
  temporaries traced).

Gradient accumulation (grad_accum > 1): every micro-step after the first holds the whole
gradients from its start (FSDP: unsharded, as no_sync keeps them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from multicard.plan.hardware import CUBLAS_WORKSPACE_BYTES
from multicard.plan.step_model import StepModel
from multicard.plan.trace import StepTrace

COMPONENTS = ("parameters", "gradients", "optimizer", "activations", "temporaries", "buckets", "loader", "runtime")
# oneDNN's convolution kernels allocate scratch buffers the dispatcher does not see: 1-2.6% of the
# step's peak on resnet18/50 (docs/plan.md); allowed for as a share of activations and temporaries.
CPU_CONV_SCRATCH = 0.03
ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}


@dataclass(frozen=True)
class Layout:
    """How one strategy places the step on its devices."""

    kind: str  # single | dp | ddp | zero1 | fsdp
    shard: int = 1  # ranks that share parameters/state (ddp: the world size for ZeRO-1; fsdp: the shard group)
    replicas: int = 1  # dp: GPUs the micro-batch is split over
    reshard_after_forward: bool = True
    bucket_view: bool = False
    accum: int = 1
    precision: str = "fp32"
    cuda: bool = False


@dataclass
class Memory:
    """Bytes per device at the step's peak, by component; `first_gpu_extra` is dp's first GPU."""

    parts: dict[str, float]
    op: str
    phase: str
    first_gpu_extra: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.parts.values()) + self.first_gpu_extra

    @property
    def tensors(self) -> float:
        """What torch.cuda.max_memory_allocated (or the CPU allocation peak) would show."""
        return self.total - self.parts.get("runtime", 0.0)


def zero1_state_share(trace: StepTrace, world: int) -> float:
    """Largest optimizer state one rank keeps under ZeroRedundancyOptimizer: per parameter
    group, parameters by size (largest first), each to the rank with the fewest elements so far."""
    sizes = [0] * world
    state = [0.0] * world
    for group in sorted({p.group for p in trace.params}):
        for p in sorted((p for p in trace.params if p.group == group), key=lambda p: p.numel, reverse=True):
            rank = sizes.index(min(sizes))
            sizes[rank] += p.numel
            state[rank] += p.state_bytes
    return max(state)


def _shard(trace: StepTrace, world: int, attr: str) -> float:
    """Bytes one rank holds of `attr` (nbytes or state_bytes) when each parameter is split on
    its first dimension into `world` equal, padded chunks (FSDP2)."""
    total = 0.0
    for p in trace.params:
        whole = getattr(p, attr)
        if whole:
            total += whole * (-(-p.numel // world)) / p.numel
    return total


def _unit_masks(model: StepModel, layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FSDP per op: (bytes of whole parameters held, gradient bytes already reduce-scattered,
    momentary buffers: the flat all-gather output while it is copied out to the parameters,
    and the flat reduce-scatter input beside the whole gradients it is copied from)."""
    units = model.trace.units
    ops = model.ops
    whole = np.zeros(ops)
    reduced = np.zeros(ops)
    spikes = np.zeros(ops)
    scale = ELEMENT[layout.precision] / 4 if layout.precision in ("bf16", "fp16") else 1.0
    backward_order = sorted((u for u in units if u.bwd[0] >= 0), key=lambda u: u.bwd[0])
    prefetch_from = {id(u): (prev.bwd[0] if prev is not None else u.bwd[0])
                     for prev, u in zip([None, *backward_order[:-1]], backward_order, strict=True)}  # fmt: skip
    for u in units:
        gathered = u.param_bytes * scale
        if u.fwd[0] >= 0:
            spikes[u.fwd[0]] += gathered
            if layout.reshard_after_forward:
                whole[u.fwd[0] : u.fwd[1] + 1] += gathered
                if u.bwd[0] >= 0:
                    whole[prefetch_from[id(u)] : u.bwd[1] + 1] += gathered
                    spikes[prefetch_from[id(u)]] += gathered
            else:
                end = u.bwd[1] if u.bwd[1] >= 0 else ops - 1
                whole[u.fwd[0] : end + 1] += gathered
        if u.bwd[1] >= 0:
            spikes[u.bwd[1]] += u.param_bytes  # reduce-scatter input, in fp32 (the reduce dtype)
            reduced[u.bwd[1] + 1 :] += u.param_bytes  # gradients in the parameters' dtype
    return whole, reduced, spikes


def timeline(model: StepModel, layout: Layout, n: float) -> dict[str, np.ndarray]:
    """Bytes of each component at every op, on one device (dp: the GPUs after the first)."""
    trace = model.trace
    fb = model.forward_backward
    per_device = n / layout.replicas
    live = (model.live_cuda if layout.cuda else model.live).at(per_device)
    live = live + trace.optimizer_bytes * fb  # a steady step holds the optimizer state throughout
    saved = model.saved.at(per_device)
    grads = model.grads.copy()
    params = np.full(model.ops, float(trace.param_bytes + trace.buffer_bytes))
    optimizer = np.full(model.ops, float(trace.optimizer_bytes))
    # The rest of what is live: op outputs not saved for backward, gradients of activations. Not
    # clamped: every component stays affine in n, which largest_batch relies on.
    temporaries = live - params - grads - optimizer - saved
    if layout.accum > 1:  # micro-steps after the first hold the whole gradients throughout
        grads = np.where(fb, float(trace.grad_bytes), grads)
    buckets = np.zeros(model.ops)
    opt_phase = model.phase == "optimizer"
    if layout.kind == "dp":
        optimizer[:] = 0.0  # replicas: the optimizer and its state live on the first GPU only
    elif layout.kind in ("ddp", "zero1"):
        buckets[:] = trace.grad_bytes
        if layout.bucket_view:
            grads[:] = 0.0
        if layout.kind == "zero1":
            optimizer[:] = zero1_state_share(trace, layout.shard)
    elif layout.kind == "fsdp":
        whole, reduced, spikes = _unit_masks(model, layout)
        w = layout.shard
        params = np.full(model.ops, _shard(trace, w, "nbytes") + trace.buffer_bytes) + whole
        buckets = spikes
        optimizer[:] = _shard(trace, w, "state_bytes")
        # whole gradients until their unit's reduce-scatter, a shard after it (no_sync keeps them whole)
        grads = grads - reduced + reduced / w
        grads = np.where(opt_phase, _shard(trace, w, "nbytes"), grads)
        key = "foreach" if layout.cuda else "loop"
        temporaries = np.where(opt_phase, trace.optimizer_temps.get(key, 0) / w, temporaries)
    if layout.cuda:
        workspace = CUBLAS_WORKSPACE_BYTES + (model.largest_activation.at(per_device)[0] if trace.has_conv else 0.0)
        temporaries = temporaries + workspace
    elif trace.has_conv:
        temporaries = temporaries + CPU_CONV_SCRATCH * (saved + temporaries)
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer": optimizer,
        "activations": saved,
        "temporaries": temporaries,
        "buckets": buckets,
    }


def dp_first_gpu_extra(model: StepModel, layout: Layout, n: float) -> float:
    """The first GPU of DataParallel also holds the optimizer state, the whole micro-batch before
    it is scattered, and the gradients summed from the replicas beside its own replica's."""
    trace = model.trace
    per_image = trace.input_bytes / trace.batch
    return trace.optimizer_bytes + per_image * n * (layout.replicas - 1) / layout.replicas + trace.grad_bytes


def peak(model: StepModel, layout: Layout, n: float, fixed: dict[str, float]) -> Memory:
    """The peak op's components at micro-batch n (per process), plus the fixed components
    (loader buffers, runtime) that do not change over the step."""
    parts = timeline(model, layout, n)
    total = sum(parts.values())
    i = int(np.argmax(total))
    memory = Memory({k: float(v[i]) for k, v in parts.items()}, model.trace.ops.names[i], str(model.phase[i]))
    memory.parts.update(fixed)
    if layout.kind == "dp":
        memory.first_gpu_extra = dp_first_gpu_extra(model, layout, n)
    return memory


def largest_batch(model: StepModel, layout: Layout, budget: float, fixed: float, step: int = 1) -> int:
    """The largest micro-batch (a multiple of `step`) whose peak plus `fixed` stays within `budget`;
    0 if not even `step` fits. Exact: the total at each op is affine in n."""

    def total(n: float) -> np.ndarray:
        t = sum(timeline(model, layout, n).values())
        if layout.kind == "dp":
            t = t + dp_first_gpu_extra(model, layout, n)
        return t + fixed

    return _largest(total, budget, step)


def _largest(total: Callable[[float], np.ndarray], budget: float, step: int) -> int:
    c = total(0.0)
    s = total(1.0) - c
    if np.any(c > budget):
        return 0
    growing = s > 0
    if not growing.any():
        return 10**9
    n = float(np.min((budget - c[growing]) / s[growing]))
    return int(n // step) * step
