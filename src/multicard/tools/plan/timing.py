"""Predicted step time: the traced ops against a device's achievable rates, plus each strategy's
communication over its links, less what the strategy overlaps with compute.

GPU: each op takes max(FLOPs / compute rate, bytes moved / memory bandwidth, a kernel's
minimum) — the roofline per op — with the compute rate of its kind and dtype (hardware.Gpu);
the host must also dispatch every op (eager PyTorch), so a micro-step takes the larger of the
device's sum and the host's. CPU: FLOPs / R + bytes / BW, with rates measured on this machine
(calibrate.py), R apart for dense convolutions, grouped ones (forward and backward) and
matmuls, BW apart for normalisations (which read their input twice); an op's writes into new tensors
at or above glibc's mmap threshold cost 1 / BW_fresh: such an allocation is a fresh mapping
whose pages fault in as they are written, where a smaller one reuses memory already touched.
The threshold rises to 32 MiB as a process runs; fsdp fixes it at 128 KiB (malloc.py) where
fsdp.cpu_release_memory resolves to true (by default: under a memory limit, as --memory-gb plans).

Communication (ring algorithms, NCCL/gloo): all-reduce moves 2(g-1)/g of the bytes over each
GPU's link, all-gather and reduce-scatter (g-1)/g; across nodes the slower of the two links
bounds it (hierarchical all-reduce: reduce-scatter in the node, all-reduce of a 1/N share
between nodes, all-gather in the node).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from multicard.base.malloc import LARGE, MMAP_THRESHOLD_MAX
from multicard.tools.plan.hardware import (
    ACHIEVABLE_BANDWIDTH,
    ACHIEVABLE_COMPUTE,
    HOST_OVERHEAD_S,
    KERNEL_MIN_S,
    Gpu,
)
from multicard.tools.plan.ops import CONV, GROUPED_CONV, GROUPED_CONV_BACKWARD, MATMUL, NORM
from multicard.tools.plan.step_model import StepModel
from multicard.tools.plan.trace import StepTrace


@dataclass(frozen=True)
class Rates:
    """How fast one device (one process's share of it, on a CPU) runs ops."""

    gpu: Gpu | None
    precision: str
    cpu_flops: float = 0.0  # CPU: achievable FLOP/s of convolutions (calibrated)
    cpu_bandwidth: float = 0.0  # CPU: bytes/s read and written in memory already touched
    cpu_fresh_bandwidth: float = 0.0  # CPU: bytes/s written into freshly mapped pages
    fsdp_unit_s: float = 0.0  # CPU: FSDP's own cost per unit and micro-step (hooks, copies, waits)
    cpu_matmul_flops: float = 0.0  # CPU: achievable FLOP/s of matmuls (calibrated; 0: as convolutions)
    cpu_grouped_flops: float = 0.0  # CPU: of grouped (depthwise) convolutions (calibrated; 0: as dense ones)
    cpu_transcendental: float = 0.0  # CPU: values/s a SiLU-like op evaluates beyond its bytes (0: no cost)
    cpu_grouped_backward_flops: float = 0.0  # CPU: of grouped convolutions' backward (0: as their forward)
    cpu_norm_bandwidth: float = 0.0  # CPU: bytes/s of normalisations, counted as other ops' (0: as BW)

    @classmethod
    def cpu(cls, precision: str, rates: dict[str, float], fsdp_unit_s: float = 0.0) -> Rates:
        """A CPU's rates from a calibration's entry (calibrate.RATE_KEYS)."""
        return cls(None, precision, rates["flops"], rates["bandwidth"], rates["fresh_bandwidth"], fsdp_unit_s,
                   rates.get("matmul_flops", 0.0), rates.get("grouped_flops", 0.0),
                   rates.get("transcendental", 0.0), rates.get("grouped_backward_flops", 0.0),
                   rates.get("norm_bandwidth", 0.0))  # fmt: skip

    def op_seconds(self, flops: np.ndarray, moved: np.ndarray, kind: np.ndarray, fresh: np.ndarray,
                   elements: np.ndarray, fault_from: float = MMAP_THRESHOLD_MAX) -> np.ndarray:  # fmt: skip
        """Seconds of each op; on a CPU, new tensors of `fault_from` bytes or more fault their pages in
        (an op's new bytes are taken as one tensor: most ops make one large output), and
        transcendental ops pay for their `elements` too."""
        if self.gpu is None:
            grouped = self.cpu_grouped_flops or self.cpu_flops
            rate = np.select([kind == MATMUL, kind == GROUPED_CONV, kind == GROUPED_CONV_BACKWARD],
                             [self.cpu_matmul_flops or self.cpu_flops, grouped,
                              self.cpu_grouped_backward_flops or grouped],
                             self.cpu_flops)  # fmt: skip
            bandwidth = np.where(kind == NORM, self.cpu_norm_bandwidth or self.cpu_bandwidth, self.cpu_bandwidth)
            faulted = np.where(fresh >= fault_from, fresh, 0.0)
            arithmetic = elements / self.cpu_transcendental if self.cpu_transcendental else 0.0
            return (flops / rate + arithmetic + (moved - faulted) / bandwidth
                    + faulted / self.cpu_fresh_bandwidth)  # fmt: skip
        gpu = self.gpu
        conv = (kind == CONV) | (kind == GROUPED_CONV) | (kind == GROUPED_CONV_BACKWARD)
        peak = np.where(conv, gpu.peak(self.precision, conv=True), gpu.peak(self.precision, conv=False))
        compute = np.where((kind == CONV) | (kind == MATMUL) | conv, flops / (peak * ACHIEVABLE_COMPUTE), 0.0)
        memory = moved / (gpu.bandwidth * ACHIEVABLE_BANDWIDTH)
        launched = (flops > 0) | (moved > 0)
        return np.where(launched, np.maximum(np.maximum(compute, memory), KERNEL_MIN_S), 0.0)

    def host_seconds(self, ops: int) -> float:
        return 0.0 if self.gpu is None else ops * HOST_OVERHEAD_S


@dataclass(frozen=True)
class Net:
    """The links one process's collectives use (bytes/s achievable, seconds per ring step)."""

    intra_bw: float  # between the processes (GPUs) of a node
    intra_latency: float
    inter_bw: float = 0.0  # one GPU's share between nodes
    inter_latency: float = 0.0
    overlaps: bool = True  # collectives run beside compute (NCCL streams); gloo on CPU cores does not


def ring(kind: str, nbytes: float, group: int, bw: float, latency: float) -> float:
    """Seconds of one ring collective over `group` ranks."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    share = (group - 1) / group
    if kind == "all_reduce":
        return 2 * share * nbytes / bw + 2 * (group - 1) * latency
    return share * nbytes / bw + (group - 1) * latency  # all_gather, reduce_scatter, broadcast (pipelined)


def collective(kind: str, nbytes: float, per_node: int, nodes: int, net: Net) -> float:
    """A collective over per_node × nodes ranks."""
    if nodes <= 1:
        return ring(kind, nbytes, per_node, net.intra_bw, net.intra_latency)
    if kind == "all_reduce":
        inside = 2 * ring("reduce_scatter", nbytes, per_node, net.intra_bw, net.intra_latency)
        return inside + ring("all_reduce", nbytes / per_node, nodes, net.inter_bw, net.inter_latency)
    bw = min(net.intra_bw, net.inter_bw)
    return ring(kind, nbytes, per_node * nodes, bw, max(net.intra_latency, net.inter_latency))


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # forward + backward of all micro-steps
    optimizer_s: float
    comm_s: float  # all communication of the step
    exposed_s: float  # the part not hidden behind compute
    total_s: float


def compute_seconds(model: StepModel, rates: Rates, n: float, replicas: int = 1,
                    fault_from: float = MMAP_THRESHOLD_MAX) -> tuple[float, float, float]:  # fmt: skip
    """(forward+backward, backward alone, optimizer) seconds of one micro-step at micro-batch n
    (per process; dp splits it over `replicas` GPUs, whose host threads share one interpreter)."""
    per_device = n / replicas
    seconds = rates.op_seconds(model.flops.at(per_device), model.moved.at(per_device), model.kind,
                               model.fresh.at(per_device), model.elements.at(per_device), fault_from)  # fmt: skip
    fb = model.forward_backward
    backward = model.phase == "backward"
    optimizer = model.phase == "optimizer"
    fb_s = float(seconds[fb].sum())
    host = rates.host_seconds(int(fb.sum()) * replicas)
    return max(fb_s, host), float(seconds[backward].sum()), float(seconds[optimizer].sum())


def step_time(
    model: StepModel,
    kind: str,
    rates: Rates,
    net: Net,
    n: float,
    accum: int,
    per_node: int,
    nodes: int,
    *,
    replicas: int = 1,
    shard_per_node: int | None = None,
    reshard_after_forward: bool = True,
    release_memory: bool = True,
    compute_bytes: float = 4,
    comm_bytes: float = 4,
    bucket_bytes: float = 25e6,
) -> StepTime:
    """Seconds of one optimizer step of `kind` (single, dp, ddp, zero1, fsdp) at micro-batch n
    per process and `accum` micro-steps.

    compute_bytes: element size of the parameters FSDP gathers (bf16/fp16 under mixed precision);
    comm_bytes: of the gradients DDP all-reduces (halved by an fp16/bf16 comm hook).
    shard_per_node: FSDP shards within a node and replicates across nodes (HSDP) when set.
    release_memory: fsdp.cpu_release_memory (on a CPU, fsdp fixes glibc's mmap threshold).
    """
    trace = model.trace
    fault_from = LARGE if kind == "fsdp" and release_memory else MMAP_THRESHOLD_MAX
    fb, backward, optimizer = compute_seconds(model, rates, n, replicas, fault_from)
    compute = accum * fb
    elements = float(sum(p.numel for p in trace.params))
    world = per_node * nodes
    comm = exposed = 0.0
    if kind == "dp":
        comm = exposed = accum * _dp_seconds(trace, replicas, net)  # every micro-step
    elif kind in ("ddp", "zero1"):
        comm, exposed = _ddp_seconds(trace, kind, elements * comm_bytes, backward, per_node, nodes, net, bucket_bytes)
        if kind == "zero1":
            optimizer /= world
    elif kind == "fsdp":
        optimizer /= shard_per_node or world
        compute += accum * len(trace.units) * rates.fsdp_unit_s
        comm, exposed = _fsdp_seconds(trace, elements, compute, accum, per_node, nodes, net, shard_per_node,
                                      reshard_after_forward, compute_bytes)  # fmt: skip
    total = compute + optimizer + exposed
    return StepTime(compute, optimizer, comm, exposed, total)


def _dp_seconds(trace: StepTrace, replicas: int, net: Net) -> float:
    """DataParallel's communication of one micro-step: replicas made, gradients gathered."""
    seconds = ring("broadcast", trace.param_bytes, replicas, net.intra_bw, net.intra_latency)
    return seconds + ring("reduce_scatter", trace.grad_bytes * replicas, replicas, net.intra_bw, net.intra_latency)


def _ddp_seconds(trace: StepTrace, kind: str, grads: float, backward: float, per_node: int, nodes: int, net: Net,
                 bucket_bytes: float) -> tuple[float, float]:  # fmt: skip
    """(all, exposed) communication seconds of a ddp or zero1 step: the gradients' all-reduce,
    overlapped with backward but for the last bucket; zero1's owners then send updated parameters."""
    comm = collective("all_reduce", grads, per_node, nodes, net)
    last_bucket = comm * min(1.0, bucket_bytes / grads) if grads else 0.0
    exposed = max(comm - 0.9 * backward, last_bucket) if net.overlaps else comm
    if kind == "zero1":
        gather = collective("all_gather", trace.param_bytes, per_node, nodes, net)
        comm += gather
        exposed += gather
    return comm, exposed


def _fsdp_seconds(trace: StepTrace, elements: float, compute: float, accum: int, per_node: int, nodes: int, net: Net,
                  shard_per_node: int | None, reshard_after_forward: bool,
                  compute_bytes: float) -> tuple[float, float]:  # fmt: skip
    """(all, exposed) communication seconds of an fsdp step: parameter gathers per micro-step
    (forward, and backward again when resharded), one fp32 reduce-scatter, and for HSDP the shards'
    all-reduce across nodes; prefetched gathers and reduce-scatters run beside compute."""
    group_per_node, group_nodes = (shard_per_node, 1) if shard_per_node else (per_node, nodes)
    gathers = 2 if reshard_after_forward else 1
    gather = collective("all_gather", elements * compute_bytes, group_per_node, group_nodes, net)
    scatter = collective("reduce_scatter", elements * 4, group_per_node, group_nodes, net)  # fp32 reduce
    replicate = 0.0
    if shard_per_node:  # HSDP: each shard's gradients all-reduced across nodes
        replicate = ring("all_reduce", elements * 4 / shard_per_node, nodes, net.inter_bw, net.inter_latency)
    comm = accum * gathers * gather + scatter + replicate
    if not net.overlaps:
        return comm, comm
    units = max(1, len(trace.units))  # the first gather cannot be hidden
    return comm, max(comm - 0.9 * compute, gather / units + scatter / units)
