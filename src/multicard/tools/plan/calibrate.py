"""This machine's achievable rates, measured once for planning on it (`--calibrate`; the stored
record: calibration.py).

A CPU step costs FLOPs / R + bytes / BW, and its writes into new tensors large enough to be
fresh mappings cost 1 / BW_fresh instead of 1 / BW (timing.Rates):

- BW: an add over tensors larger than the caches into memory already touched;
- BW_fresh: the same add into a newly allocated tensor (too large for malloc to reuse: fresh pages);
- BW of normalisations: a BatchNorm's forward and backward, its bytes counted as the trace counts
  them (it reads its input twice: statistics, then the normalised values);
- R of matmuls: a linear layer's forward and backward (a ViT-B MLP's shape; FLOPs counted by
  torch's FlopCounterMode); R of grouped convolutions: EfficientNet-shaped depthwise
  convolutions', forward and backward apart (far below a dense one's on a CPU, the backward
  at about half the forward's);
- R of convolutions: fitted on real steps of resnet18 in multicard's own loop (measure.py), whose
  FLOPs and bytes come from the plan's own trace: its convolution FLOPs over what remains of the
  step time after the other terms. (A single convolution's rate, the fallback when the fit is
  implausible, runs well below a real network's mix of shapes.)

Each is taken for one process using every core (single) and for each of `cores` processes with
a thread apiece (ddp). The ddp run also gives gloo's all-reduce rate between the processes; an
fsdp run gives FSDP's own cost per unit and micro-step (hooks, copies, waiting for the other
rank) beyond its modelled compute and communication; the single run, made alone in a cgroup
where possible, what a training process needs besides tensors (its peak charge − its tensors).
"""

from __future__ import annotations

import timeit
from collections.abc import Callable
from contextlib import nullcontext
from datetime import datetime, timezone
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from multicard.base.config import Config, load_config
from multicard.runtime.process_group import cpu_cores
from multicard.tools.plan import cgroup_cap
from multicard.tools.plan.calibration import RATE_KEYS, Calibration, machine_id
from multicard.tools.plan.dataset import data_facts
from multicard.tools.plan.measure import Measured, run_alone, run_steps
from multicard.tools.plan.memory import Layout, peak
from multicard.tools.plan.ops import CONV
from multicard.tools.plan.step_model import StepModel, step_model
from multicard.tools.plan.timing import Net, Rates, step_time

WORKLOAD = [  # the fit's model: convolutions, norms and pointwise ops in the mix of real nets
    "model.name=resnet18",
    "data.image_size=224",
    "data.val_size=16",
    "data.loader=workers",
    "data.num_workers=0",  # batches made in the training process, outside the timed phases
    "optim.name=sgd",
    "precision=fp32",
]
WORKLOAD_BATCH = 8
# What a process holds besides tensors, measured with the device loader: small images, batches
# made on the device, small model (its tensors are predicted and taken away).
RUNTIME_WORKLOAD = ["model.name=smallcnn", "data.image_size=64", "data.val_size=16", "data.loader=device",
                    "train.global_batch_size=64", "data.train_size=512", "strategy=single", "devices=cpu"]  # fmt: skip
ALLREDUCE_BYTES = [1 << 20, 16 << 20, 64 << 20]
# Depthwise convolutions of an EfficientNet's (channels, size, kernel, stride): their forward
# and backward run at rates of their own on a CPU, the backward's well below the forward's.
DEPTHWISE = [(96, 56, 3, 1), (240, 28, 5, 1), (672, 14, 5, 1), (1152, 7, 3, 1)]


def _best_seconds(fn: Any, repeats: int) -> float:
    fn()
    return min(timeit.repeat(fn, number=1, repeat=repeats))


def microbenchmarks(threads: int) -> dict[str, float]:
    """This machine's rates at `threads` (RATE_KEYS, and "conv": one convolution's alone):
    FLOP/s of a 3×3 convolution's forward and backward, 64→64 channels, 56×56, batch 8;
    FLOP/s of a linear layer's, 768→3072 features over 8 × 197 tokens (a ViT-B/16 MLP);
    FLOP/s of the depthwise convolutions in DEPTHWISE at batch 8, forward and backward apart;
    values/s of SiLU's forward and backward beyond their bytes at BW;
    bytes/s of an add over 3 × 64 MiB into touched memory; of writing into fresh pages; of a
    BatchNorm's forward and backward, counted as the plan counts bytes (inputs + outputs)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        conv = _step(lambda x, w: F.conv2d(x, w, padding=1), (8, 64, 56, 56), (64, 64, 3, 3))
        linear = _step(F.linear, (8 * 197, 768), (3072, 768))
        a, b, out = torch.ones(16 << 20), torch.ones(16 << 20), torch.ones(16 << 20)
        nbytes = a.numel() * a.element_size()
        touched = _best_seconds(lambda: torch.add(a, b, out=out), 5)
        fresh = _best_seconds(lambda: torch.add(a, b), 5)  # a new 64 MiB result each time: mmap'd, faulted in
        stream = 3 * nbytes / touched
        x = torch.randn(8, 96, 56, 56)
        xbytes = x.numel() * x.element_size()
        silu = _step(F.silu, x.shape)
        beyond = _best_seconds(silu, 5) - 6 * xbytes / stream  # ones, y, 3 in backward
        norm = _step(lambda x, w, b: F.batch_norm(x, torch.zeros(96), torch.ones(96), w, b, training=True),
                     x.shape, (96,), (96,))  # fmt: skip
        norm_s = _best_seconds(norm, 5) - xbytes / stream  # less the ones_like of the output gradient
        forward_s, backward_s, forward_flops = _depthwise_seconds(stream)
        return {
            "conv": _flops(conv) / _best_seconds(conv, 5),
            "matmul_flops": _flops(linear) / _best_seconds(linear, 5),
            "grouped_flops": forward_flops / forward_s,
            "grouped_backward_flops": 2 * forward_flops / backward_s,  # as the trace counts a grouped backward
            "transcendental": 2 * x.numel() / max(beyond, 1e-9),  # forward and backward: a sigmoid per value each
            "bandwidth": stream,
            "norm_bandwidth": 5 * xbytes / max(norm_s, 1e-9),  # forward reads x, writes y; backward 2 in, 1 out
            "fresh_bandwidth": nbytes / max(fresh - 2 * nbytes / stream, 1e-9),
        }
    finally:
        torch.set_num_threads(previous)


def _depthwise_seconds(stream: float) -> tuple[float, float, float]:
    """(forward seconds, backward seconds, forward FLOPs) of DEPTHWISE's convolutions together."""
    forward_s = backward_s = forward_flops = 0.0
    for channels, size, kernel, stride in DEPTHWISE:
        x = torch.randn(8, channels, size, size, requires_grad=True)
        w = torch.randn(channels, 1, kernel, kernel, requires_grad=True)
        forward = partial(F.conv2d, x, w, stride=stride, padding=kernel // 2, groups=channels)
        with torch.no_grad():
            alone = _best_seconds(forward, 5)
        with FlopCounterMode(display=False) as counter:
            y = forward()
        both = _best_seconds(lambda forward=forward, x=x, w=w: _gradients(forward(), x, w), 5)
        forward_s += alone
        backward_s += max(both - alone - y.numel() * y.element_size() / stream, 1e-9)  # less the ones_like
        forward_flops += counter.get_total_flops()
    return forward_s, backward_s, forward_flops


def _gradients(y: torch.Tensor, *inputs: torch.Tensor) -> None:
    torch.autograd.grad(y, inputs, torch.ones_like(y))


def _step(op: Callable[..., torch.Tensor], *shapes: tuple[int, ...] | torch.Size) -> Callable[[], None]:
    """`op`'s forward on random inputs of these shapes and the gradients of all of them."""
    inputs = [torch.randn(shape, requires_grad=True) for shape in shapes]

    def run() -> None:
        _gradients(op(*inputs), *inputs)

    return run


def _flops(fn: Any) -> float:
    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def _workload(processes: int, strategy: str, threads: int) -> Config:
    return load_config(None, [*WORKLOAD, f"strategy={strategy}", "devices=cpu", f"threads={threads}",
                              f"train.global_batch_size={WORKLOAD_BATCH * processes}",
                              f"data.train_size={WORKLOAD_BATCH * processes * 8}"])  # fmt: skip


def calibrate(say: Callable[[str], Any] = print) -> Calibration:
    """Measure this machine (a few minutes on 2 cores) and return the calibration."""
    cores = cpu_cores()
    cal = Calibration(machine_id(), {}, 1e9, 1e-6, Calibration.DEFAULT_RUNTIME)
    model = step_model(_workload(1, "single", cores), 10)
    for processes in sorted({1, cores}):
        threads = max(1, cores // processes)
        micro = microbenchmarks(threads)
        say(f"calibrate: {processes} process(es) × {threads} thread(s): matmul {micro['matmul_flops'] / 1e9:.1f} "
            f"GFLOP/s, depthwise convolution {micro['grouped_flops'] / 1e9:.1f} (backward "
            f"{micro['grouped_backward_flops'] / 1e9:.1f}) GFLOP/s, memory {micro['bandwidth'] / 1e9:.1f} GB/s, "
            f"batch norm {micro['norm_bandwidth'] / 1e9:.1f} GB/s, fresh pages {micro['fresh_bandwidth'] / 1e9:.1f} "
            f"GB/s; timing steps of resnet18 at 224 px")  # fmt: skip
        measured = _measure_workload(cal, model, processes, threads)
        if not measured.ok:
            raise RuntimeError(f"calibration run failed: {measured.reason}")
        _fit_conv_rate(cal, model, micro, measured, f"{processes}x{threads}", threads, say)
    if cores > 1:
        _fit_fsdp_unit(cal, model, cores, say)
    cal.date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return cal


def _measure_workload(cal: Calibration, model: StepModel, processes: int, threads: int) -> Measured:
    """Real steps of the workload: alone in one process (also giving what a process needs besides
    tensors), or ddp over `processes` (also giving gloo's all-reduce rate)."""
    if processes == 1:
        measured, cal.runtime_workers_bytes = _alone(_workload(1, "single", threads), model, WORKLOAD_BATCH)
        small = load_config(None, RUNTIME_WORKLOAD)
        _, cal.runtime_bytes = _alone(small, step_model(small, 10), small.train.global_batch_size)
        return measured
    measured = run_steps(_workload(processes, "ddp", threads), processes, steps=4,
                         allreduce_bytes=ALLREDUCE_BYTES, profile_memory=False)  # fmt: skip
    if measured.allreduce_ms:
        cal.allreduce_bus_bandwidth, cal.allreduce_latency = _fit_allreduce(measured.allreduce_ms, processes)
        cal.details["allreduce_ms"] = measured.allreduce_ms
    return measured


def _fit_conv_rate(cal: Calibration, model: StepModel, micro: dict[str, float], measured: Measured, name: str,
                   threads: int, say: Callable[[str], Any]) -> None:  # fmt: skip
    """The convolution rate at `threads`: the workload's convolution FLOPs over what remains of its
    fastest measured step after the other (micro-benchmarked) terms."""
    n = WORKLOAD_BATCH
    split = measured.split_min_ms  # the fastest step: least disturbed by other work on the machine
    step_s = (split["compute_ms"] + split["optimizer_ms"]) / 1000  # batches are made apart (no workers)
    measured_rates = {k: micro[k] for k in RATE_KEYS if k != "flops"}
    others = Rates.cpu("fp32", {"flops": 1.0, **measured_rates}).op_seconds(
        np.where(model.kind == CONV, 0.0, model.flops.at(n)), model.moved.at(n), model.kind, model.fresh.at(n),
        model.elements.at(n),
    )
    left = step_s - float(others.sum())  # what is not convolution arithmetic
    fitted = float(model.flops.at(n)[model.kind == CONV].sum()) / left if left > 0 else 0.0
    r = micro["conv"]
    conv = fitted if r / 2 <= fitted <= 4 * r else r  # else the step was disturbed: the single conv's rate
    say(f"calibrate: convolution {conv / 1e9:.1f} GFLOP/s in resnet18 (one 3×3 alone: {r / 1e9:.1f})")
    cal.rates[threads] = {"flops": conv, **measured_rates}
    cal.details[name] = {"step_s": step_s, "gflop": float(model.flops.at(n).sum()) / 1e9,
                         "gb_moved": float(model.moved.at(n).sum()) / 1e9,
                         "gb_fresh": float(model.fresh.at(n).sum()) / 1e9}  # fmt: skip


def _fit_fsdp_unit(cal: Calibration, model: StepModel, processes: int, say: Callable[[str], Any]) -> None:
    """FSDP's own cost per unit and micro-step: what its measured step has beyond the model, with
    a thread per process (as the ddp run measured the rates)."""
    say(f"calibrate: {processes} processes, fsdp: timing steps of resnet18 at 224 px")
    measured = run_steps(_workload(processes, "fsdp", 1), processes, steps=4, profile_memory=False)
    if not measured.ok:
        return
    net = Net(cal.allreduce_bus_bandwidth, cal.allreduce_latency, overlaps=False)
    modelled = step_time(model, "fsdp", Rates.cpu("fp32", cal.rates[1]), net, WORKLOAD_BATCH, 1, processes, 1)
    units = max(1, len(model.trace.units))
    cal.fsdp_unit_s = max(0.0, (measured.step_min_s - modelled.total_s) / units)
    cal.details["fsdp"] = {"step_s": measured.step_min_s, "modelled_s": modelled.total_s}


def _alone(cfg: Config, model: StepModel, batch: int) -> tuple[Measured, int]:
    """Steps of `cfg` in a process of their own, in a cgroup where this machine allows (its peak
    charge is what a memory cap sees; else the peak RSS): (the measurement, bytes besides tensors)."""
    capped = cgroup_cap.available() == ""
    with cgroup_cap.MemoryCap(None) if capped else nullcontext() as cap:
        measured = run_alone(cfg, steps=3, cap=cap)
        charged = cap.max_usage if cap is not None else measured.rss_peak_bytes
    images = data_facts(cfg.data, cfg.seed).decoded_bytes(cfg.data.image_size)
    tensors = peak(model, Layout("single"), batch, {"loader": float(images)}).tensors
    return measured, int(max(0.0, charged - tensors))


def _fit_allreduce(times_ms: dict[int, float], world: int) -> tuple[float, float]:
    """(bus bandwidth, latency per ring step) from all-reduce times of several sizes:
    t = 2(w-1)·latency + 2(w-1)/w · bytes / bus."""
    sizes = sorted(times_ms)
    small, large = sizes[0], sizes[-1]
    t_small, t_large = times_ms[small] / 1000, times_ms[large] / 1000
    share = 2 * (world - 1) / world
    slope = (t_large - t_small) / (large - small)
    bus = share / slope if slope > 0 else share * large / t_large
    latency = (t_small - share * small / bus) / (2 * (world - 1))
    return bus, max(latency, 1e-6)
