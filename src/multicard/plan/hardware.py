"""GPUs multicard plans for: memory, memory bandwidth and dense peak rates, from the vendors'
datasheets — the one place these facts live (scripts/gpu_check/throughput.py reads PEAK_BF16
from here).

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

from multicard.errors import UserError

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


GPUS: tuple[Gpu, ...] = (
    # NVIDIA Tesla V100 GPU Accelerator datasheet (SXM2): 7.8 FP64 / 15.7 FP32 / 125 tensor TFLOPS,
    # 16 or 32 GB HBM2 at 900 GB/s, NVLink 300 GB/s. No BF16 or TF32 tensor cores.
    Gpu("v100-sxm2-32gb", "V100 SXM2 32GB", 32 * GIB, 900e9, None, 125 * T, None, 15.7 * T, 7.8 * T, "nvlink2",
        r"V100.*SXM2.*32GB", aliases=("v100", "v100-32gb")),
    Gpu("v100-sxm2-16gb", "V100 SXM2 16GB", 16 * GIB, 900e9, None, 125 * T, None, 15.7 * T, 7.8 * T, "nvlink2",
        r"V100.*SXM2", aliases=("v100-16gb",)),
    # Same datasheet (PCIe): 7 FP64 / 14 FP32 / 112 tensor TFLOPS, 900 GB/s.
    Gpu("v100-pcie-32gb", "V100 PCIe 32GB", 32 * GIB, 900e9, None, 112 * T, None, 14 * T, 7 * T, "pcie3",
        r"V100.*PCIE", aliases=("v100-pcie",)),
    # NVIDIA A100 Tensor Core GPU datasheet: 9.7 FP64 / 19.5 FP32 / 156 TF32 / 312 BF16 and FP16 (dense);
    # 40GB HBM2 1,555 GB/s; 80GB HBM2e 2,039 GB/s (SXM) or 1,935 GB/s (PCIe); NVLink 600 GB/s.
    Gpu("a100-40gb", "A100 SXM 40GB", 40 * GIB, 1555e9, 312 * T, 312 * T, 156 * T, 19.5 * T, 9.7 * T, "nvlink3",
        r"A100.*SXM.*40GB", aliases=("a100-sxm-40gb", "a100-40")),
    Gpu("a100-40gb-pcie", "A100 PCIe 40GB", 40 * GIB, 1555e9, 312 * T, 312 * T, 156 * T, 19.5 * T, 9.7 * T, "pcie4",
        r"A100.*PCIE.*40GB"),
    Gpu("a100-80gb-pcie", "A100 PCIe 80GB", 80 * GIB, 1935e9, 312 * T, 312 * T, 156 * T, 19.5 * T, 9.7 * T, "pcie4",
        r"A100.*PCIE.*80GB|A100 80GB PCIe"),
    # Any other A100 name (SXM4 80GB among them) is taken for the SXM 80GB.
    Gpu("a100-80gb", "A100 SXM 80GB", 80 * GIB, 2039e9, 312 * T, 312 * T, 156 * T, 19.5 * T, 9.7 * T, "nvlink3",
        r"A100", aliases=("a100", "a100-sxm-80gb", "a100-80")),
    # NVIDIA A10 Tensor Core GPU datasheet: 31.2 FP32 / 62.5 TF32 / 125 BF16 and FP16 (dense); 24GB GDDR6, 600 GB/s.
    Gpu("a10", "A10 24GB", 24 * GIB, 600e9, 125 * T, 125 * T, 62.5 * T, 31.2 * T, 0.98 * T, "pcie4", r"\bA10\b"),
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 34 FP64 / 67 FP32 / 989 TF32 sparse (494.7 dense) /
    # 1,979 BF16 and FP16 sparse (989 dense); 80GB HBM3 at 3.35 TB/s; NVLink 900 GB/s.
    Gpu("h100", "H100 SXM 80GB", 80 * GIB, 3.35e12, 989 * T, 989 * T, 494.7 * T, 67 * T, 34 * T, "nvlink4",
        r"H100(?!.*(PCIe|NVL))", aliases=("h100-sxm", "h100-80gb")),
    # Same datasheet, H100 PCIe: 26 FP64 / 51 FP32 / 756 TF32 sparse / 1,513 BF16 and FP16 sparse; 80GB HBM2e 2 TB/s.
    Gpu("h100-pcie", "H100 PCIe 80GB", 80 * GIB, 2.0e12, 756 * T, 756 * T, 378 * T, 51 * T, 26 * T, "pcie5",
        r"H100.*PCIe"),
    # Same datasheet, H100 NVL: 30 FP64 / 60 FP32 / 835 TF32 sparse / 1,671 BF16 and FP16 sparse; 94GB HBM3 3.9 TB/s.
    Gpu("h100-nvl", "H100 NVL 94GB", 94 * GIB, 3.9e12, 835 * T, 835 * T, 417.5 * T, 60 * T, 30 * T, "pcie5",
        r"H100.*NVL"),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: rates of H100 SXM; 141GB HBM3e at 4.8 TB/s; NVLink 900 GB/s.
    Gpu("h200", "H200 SXM 141GB", 141 * GIB, 4.8e12, 989 * T, 989 * T, 494.7 * T, 67 * T, 34 * T, "nvlink4",
        r"(?<!G)H200(?!.*NVL)", aliases=("h200-sxm",)),
    # Same datasheet, H200 NVL: 30 FP64 / 60 FP32 / 835 TF32 sparse / 1,671 BF16 and FP16 sparse; 141GB, 4.8 TB/s.
    Gpu("h200-nvl", "H200 NVL 141GB", 141 * GIB, 4.8e12, 835 * T, 835 * T, 417.5 * T, 60 * T, 30 * T, "pcie5",
        r"H200.*NVL"),
    # NVIDIA GH200 Grace Hopper Superchip datasheet: the H100's rates (989 BF16 dense); 96GB HBM3 at 4 TB/s.
    Gpu("gh200", "GH200 96GB", 96 * GIB, 4.0e12, 989 * T, 989 * T, 494.7 * T, 67 * T, 34 * T, "nvlink4", r"GH200"),
    # NVIDIA L4 Tensor Core GPU datasheet: 30.3 FP32 / 120 TF32 sparse / 242 BF16 and FP16 sparse; 24GB GDDR6,
    # 300 GB/s; PCIe Gen4 x16.
    Gpu("l4", "L4 24GB", 24 * GIB, 300e9, 121 * T, 121 * T, 60 * T, 30.3 * T, 0.49 * T, "pcie4", r"\bL4\b"),
    # NVIDIA L40S datasheet: 91.6 FP32 / 183 TF32 / 362.05 BF16 and FP16 (dense; rounded to 362); 48GB GDDR6
    # at 864 GB/s; PCIe Gen4.
    Gpu("l40s", "L40S 48GB", 48 * GIB, 864e9, 362 * T, 362 * T, 183 * T, 91.6 * T, 1.41 * T, "pcie4",
        r"L40S"),
    # NVIDIA Ada GPU Architecture whitepaper, GeForce RTX 4090: 82.6 FP32; tensor cores with FP32 accumulate
    # (what PyTorch uses): 165.2 FP16 and BF16, 82.6 TF32 (dense); 24GB GDDR6X at 1,008 GB/s; PCIe Gen4, no NVLink.
    Gpu("rtx4090", "GeForce RTX 4090 24GB", 24 * GIB, 1008e9, 165.2 * T, 165.2 * T, 82.6 * T, 82.6 * T, 1.29 * T,
        "pcie4", r"RTX 4090", aliases=("4090", "geforce-rtx-4090")),
)  # fmt: skip

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


# (pattern, dense bf16 FLOP/s) for scripts/gpu_check/throughput.py, which matches device names
# in order; each GPU's own pattern says which variant (SXM, PCIe, NVL) it is.
PEAK_BF16: list[tuple[str, float]] = [(g.device_pattern, g.bf16) for g in GPUS if g.bf16 is not None]


def peak_bf16(device_name: str) -> float | None:
    """Dense bf16 peak of the GPU named as torch.cuda.get_device_name() says it; None if unknown."""
    gpu = gpu_for_device(device_name)
    return gpu.bf16 if gpu is not None else None
