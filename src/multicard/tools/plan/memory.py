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
  backward); what FSDP2 keeps for its communication: each unit's forward all-gather output
  until the next unit's parameters are copied out (the last until the forward ends), and each
  unit's reduce-scatter input until the next unit's reduce-scatter (the last until backward
  ends); a unit's gradients whole from their arrival until its reduce-scatter, then a shard;
  the optimizer runs fused on shards where torch can (AdamW), else unfused (its temporaries
  traced). gloo (CPU) also copies for a moment: an all-gather's output, a reduce-scatter's input.

Gradient accumulation (grad_accum > 1): every micro-step after the first holds the whole
gradients from its start (FSDP: unsharded, as no_sync keeps them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from multicard.tools.plan.hardware import CUBLAS_WORKSPACE_BYTES
from multicard.tools.plan.step_model import StepModel
from multicard.tools.plan.trace import StepTrace

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


@dataclass
class _FSDPHeld:
    """What FSDP2 holds beyond the shards, per op: unsharded parameters (`whole`), gradient bytes
    already reduce-scattered to shards (`reduced`), and its communication buffers (`buffers`)."""

    whole: np.ndarray
    reduced: np.ndarray
    buffers: np.ndarray


def _fsdp_held(model: StepModel, layout: Layout) -> _FSDPHeld:
    """What FSDP2 holds beyond the shards at every op of the step, unit by unit."""
    ops = model.ops
    held = _FSDPHeld(np.zeros(ops), np.zeros(ops), np.zeros(ops))
    scale = ELEMENT[layout.precision] / 4 if layout.precision in ("bf16", "fp16") else 1.0
    _forward_gathers(model, layout, held, scale)
    if layout.reshard_after_forward:
        _backward_gathers(model, layout, held, scale)
    _reduce_scatters(model, layout, held, scale)
    return held


def _forward_gathers(model: StepModel, layout: Layout, held: _FSDPHeld, scale: float) -> None:
    """Each unit's forward all-gather: its flat output and the unsharded parameters copied out
    of it. FSDP keeps the output until the next unit's parameters are copied out of theirs (so
    one all-gather overlaps the previous copy-out), the last one until the root's forward ends.
    The parameters stay whole until the unit's forward ends (ZeRO-3; the root too, as multicard
    sets reshard_after_forward on every unit) or its backward ends (ZeRO-2). gloo's all-gather
    also fills a temporary of the output's size, before the parameters exist: no higher than
    the copy-out."""
    root = model.trace.units[-1]
    ran = sorted((u for u in model.trace.units if u.fwd[0] >= 0), key=lambda u: u.fwd[0])
    for u, after in zip(ran, [*ran[1:], None], strict=True):
        gathered = u.param_bytes * scale
        end = u.fwd[1] if layout.reshard_after_forward else (u.bwd[1] - 1 if u.bwd[1] >= 0 else model.ops - 1)
        held.whole[u.fwd[0] : end + 1] += gathered
        output_until = after.fwd[0] if after is not None else root.fwd[1]
        held.buffers[u.fwd[0] : output_until + 1] += gathered


def _backward_gathers(model: StepModel, layout: Layout, held: _FSDPHeld, scale: float) -> None:
    """ZeRO-3 gathers each unit again for its backward, prefetched when the unit before it in
    backward order starts its own: the flat output from then, the parameters copied out of it
    (the output then freed) when the unit's backward starts, whole until it ends. At that start
    the output and the parameters are both live for a moment, then the next prefetch begins
    (gloo: beside its temporary)."""
    order = sorted((u for u in model.trace.units if u.bwd[0] >= 0), key=lambda u: u.bwd[0])
    for before, u, after in zip([None, *order[:-1]], order, [*order[1:], None], strict=True):
        following = after.param_bytes * scale if after is not None else 0.0
        temporary = 0.0 if layout.cuda else following
        gathered = u.param_bytes * scale
        start = before.bwd[0] if before is not None else u.bwd[0]
        held.whole[start : u.bwd[1]] += gathered
        held.buffers[u.bwd[0]] += max(0.0, gathered - following, temporary)


def _reduce_scatters(model: StepModel, layout: Layout, held: _FSDPHeld, scale: float) -> None:
    """Once a unit's last gradient has arrived (before op bwd[1]): its parameters resharded, the
    previous unit's reduce-scatter input released, its own allocated (the reduce dtype, fp32) and
    the gradients copied in and freed; the output is the gradient shard (gloo also copies the
    input for the collective). FSDP keeps the input until the next unit's reduce-scatter (the
    last until backward ends). Those moments are counted at the op before, whose parameters,
    gradients and previous input they replace."""
    end_of_backward = int(np.flatnonzero(model.forward_backward).max())
    order = sorted((u for u in model.trace.units if u.bwd[1] > 0), key=lambda u: u.bwd[1])
    released = 0.0  # the previous unit's input, freed as this unit's reduce-scatter begins
    for u, after in zip(order, [*order[1:], None], strict=True):
        grads, shard = float(u.param_bytes), u.param_bytes / layout.shard
        copy = 0.0 if layout.cuda else grads
        done = u.bwd[1]
        counted = u.param_bytes * scale + grads + released
        held.buffers[done - 1] += max(0.0, grads + grads - counted, grads + shard + copy - counted)
        held.reduced[done:] += grads
        until = after.bwd[1] if after is not None else end_of_backward + 1
        held.buffers[done:until] += grads
        released = grads


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
        held = _fsdp_held(model, layout)
        w = layout.shard
        params = np.full(model.ops, _shard(trace, w, "nbytes") + trace.buffer_bytes) + held.whole
        buckets = held.buffers
        optimizer[:] = _shard(trace, w, "state_bytes")
        # whole gradients until their unit's reduce-scatter, a shard after it (no_sync keeps them whole)
        grads = grads - held.reduced + held.reduced / w
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
        t = np.asarray(sum(timeline(model, layout, n).values()))
        if layout.kind == "dp":
            t = t + dp_first_gpu_extra(model, layout, n)
        return t + fixed

    c = total(0.0)
    s = total(1.0) - c
    if np.any(c > budget):
        return 0
    growing = s > 0
    if not growing.any():
        return 10**9
    n = float(np.min((budget - c[growing]) / s[growing]))
    return int(n // step) * step
