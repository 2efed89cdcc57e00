"""GPUs multicard plans for: memory, memory bandwidth and dense peak rates, from the vendors'
datasheets, kept in gpus.yaml with their sources — the one place these facts live
(scripts/gpu_check/throughput.py reads peak_bf16 from here).

Rates are dense (no structured sparsity) peaks in FLOP/s; datasheets print the sparse figure,
twice the dense one, beside it for tensor-core formats. `tf32` is the tensor-core rate that
fp32 convolutions get (cuDNN uses TF32 by default in PyTorch); fp32 matmuls run at `fp32`
(PyTorch leaves TF32 off for matmuls). Memory is the datasheet capacity (GiB of HBM/GDDR;
the CUDA runtime reports about 1% less) and bandwidth in bytes/s.

What a real step gets is a share of these peaks: ACHIEVABLE below.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from multicard.base.errors import UserError

T = 1e12
GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    name: str  # what --gpu takes (case, spaces and dashes do not matter)
    label: str
    memory_bytes: int
    bandwidth: float  # memory bandwidth, bytes/s
    bf16: float | None  # dense tensor-core peaks, FLOP/s; None: no tensor-core support for the format
    fp16: float
    tf32: float | None
    fp32: float  # CUDA cores
    fp64: float
    link: str  # default GPU-to-GPU link inside a node (links.py)
    device_pattern: str  # matches torch.cuda.get_device_name() of this GPU
    aliases: tuple[str, ...] = ()

    def peak(self, precision: str, conv: bool) -> float:
        """Dense peak for a matmul/convolution at `precision` (fp32 convolutions use TF32)."""
        if precision == "bf16":
            return self.bf16 or self.fp32
        if precision == "fp16":
            return self.fp16
        if precision == "fp64":
            return self.fp64
        return (self.tf32 or self.fp32) if conv else self.fp32


def _load_gpus() -> tuple[Gpu, ...]:
    """The table in gpus.yaml (units there: GiB, GB/s, TFLOP/s), in its order."""
    rows = OmegaConf.to_container(OmegaConf.load(Path(__file__).with_name("gpus.yaml")))
    assert isinstance(rows, list)

    def rate(value: float | None) -> float | None:
        return None if value is None else value * T

    return tuple(
        Gpu(r["name"], r["label"], r["memory_gib"] * GIB, r["bandwidth_gb_s"] * 1e9, rate(r["tflops"]["bf16"]),
            r["tflops"]["fp16"] * T, rate(r["tflops"]["tf32"]), r["tflops"]["fp32"] * T, r["tflops"]["fp64"] * T,
            r["link"], r["device_pattern"], tuple(r.get("aliases", ())))  # fmt: skip
        for r in rows
    )


GPUS = _load_gpus()

# Shares of the datasheet peaks a training step reaches, for ops that are large enough to be
# bound by one of them: big matmuls/convolutions reach 60-80% of the dense tensor-core peak
# (cuBLAS/cuDNN on A100/H100), streaming kernels 75-90% of memory bandwidth. Small ops are
# bound by launch and eager dispatch overhead instead (HOST_OVERHEAD_S).
ACHIEVABLE_COMPUTE = 0.7
ACHIEVABLE_BANDWIDTH = 0.8
KERNEL_MIN_S = 3e-6  # a CUDA kernel takes at least a few microseconds
HOST_OVERHEAD_S = 12e-6  # eager PyTorch: Python + dispatcher + launch per op on a server CPU
FSDP_UNIT_HOST_S = 150e-6  # FSDP2's hooks, copy-in/copy-out launches and stream syncs per unit and micro-step

CUDA_CONTEXT_BYTES = 600 * 2**20  # CUDA context, cuBLAS/cuDNN handles and kernels (lazy loading): not tensors
NCCL_BYTES = 300 * 2**20  # NCCL communicators' buffers and channels per process
CUBLAS_WORKSPACE_BYTES = 32 * 2**20  # cuBLAS workspace on Hopper-class GPUs (allocated as tensors)


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower())


def known_names() -> list[str]:
    return [g.name for g in GPUS]


def find_gpu(name: str) -> Gpu:
    """The table's entry for `--gpu NAME`, or a one-line error listing the known names."""
    key = _key(name)
    for gpu in GPUS:
        if key in {_key(gpu.name), *(_key(a) for a in gpu.aliases)}:
            return gpu
    raise UserError(
        f"--gpu {name} is not a GPU multicard plan knows; use one of cpu, {', '.join(known_names())} "
        f"(or --memory-gb X for a device of X GB on this machine)"
    )


def gpu_for_device(device_name: str) -> Gpu | None:
    """The table's entry for a device name as torch.cuda.get_device_name() says it."""
    for gpu in GPUS:
        if re.search(gpu.device_pattern, device_name):
            return gpu
    return None


def peak_bf16(device_name: str) -> float | None:
    """Dense bf16 peak of the GPU named as torch.cuda.get_device_name() says it; None if unknown."""
    gpu = gpu_for_device(device_name)
    return gpu.bf16 if gpu is not None else None
