"""What the plan is for: a named GPU × count × nodes with its links, or this machine's CPU.

`--gpu NAME` plans for NAME from the datasheet table (gpus.yaml), `--gpu cpu` for this
machine (its memory shared by the processes of a strategy), `--memory-gb X` for this machine
with X GB per process. Rates on this machine come from `--calibrate` (calibrate.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from multicard.base.errors import UserError
from multicard.base.host_memory import available_memory, cgroup_limit
from multicard.runtime.process_group import cpu_cores
from multicard.tools.plan.calibration import Calibration
from multicard.tools.plan.hardware import CUDA_CONTEXT_BYTES, FSDP_UNIT_HOST_S, NCCL_BYTES, Gpu, find_gpu
from multicard.tools.plan.links import DEFAULT_BETWEEN_NODES, Link, find_link, per_gpu_bandwidth
from multicard.tools.plan.timing import Net, Rates

GB = 10**9
# Bounds of what a plan describes: the most GPUs one node holds (an HGX-2/DGX-2 has 16; this
# machine's CPU takes as many processes, or one per core), nodes of the largest clusters, and the
# memory of one device or process (a large host has a few TB).
MAX_GPUS_PER_NODE = 16
MAX_NODES = 100_000
MAX_MEMORY_GB = 100_000


@dataclass(frozen=True)
class Target:
    label: str
    gpu: Gpu | None  # None: this machine's CPU
    gpus: int  # devices (processes) per node
    nodes: int
    memory_per_process: int | None  # --memory-gb: fixed per process; None: the device's, or RAM shared
    intra: Link | None
    inter: Link | None
    calibration: Calibration | None

    @property
    def cuda(self) -> bool:
        return self.gpu is not None

    @property
    def devices(self) -> int:
        return self.gpus * self.nodes

    @property
    def capped(self) -> bool:
        """Whether processes run under a memory limit: --memory-gb, or this process's cgroup's."""
        return self.memory_per_process is not None or cgroup_limit() is not None

    def memory(self, processes_per_node: int) -> int:
        """Bytes one process (one GPU) may use."""
        if self.memory_per_process is not None:
            return self.memory_per_process
        if self.gpu is not None:
            return self.gpu.memory_bytes
        return available_memory() // max(1, processes_per_node)

    def runtime_bytes(self, distributed: bool, loader: str) -> int:
        """Memory a process uses besides tensors: CUDA context and NCCL, or the interpreter, torch
        and the allocator's slack (more with the workers loader's image libraries)."""
        if self.gpu is not None:
            return CUDA_CONTEXT_BYTES + (NCCL_BYTES if distributed else 0)
        cal = self.calibration or Calibration.default()
        return cal.runtime_workers_bytes if loader == "workers" else cal.runtime_bytes

    def rates(self, precision: str, processes_per_node: int) -> Rates:
        if self.gpu is not None:
            return Rates(self.gpu, precision, fsdp_unit_s=FSDP_UNIT_HOST_S)
        threads = max(1, cpu_cores() // max(1, processes_per_node))
        cal = self.calibration or Calibration.default()
        r = cal.rates_for(threads)
        return Rates.cpu(precision, r, cal.fsdp_unit_s)

    def net(self, processes_per_node: int) -> Net:
        if self.gpu is None:
            cal = self.calibration or Calibration.default()
            return Net(cal.allreduce_bus_bandwidth, cal.allreduce_latency, overlaps=False)
        assert self.intra is not None
        inter_bw = per_gpu_bandwidth(self.inter, processes_per_node) if self.inter else 0.0
        return Net(
            per_gpu_bandwidth(self.intra, processes_per_node),
            self.intra.latency_s,
            inter_bw,
            self.inter.latency_s if self.inter else 0.0,
        )


def make_target(gpu: str | None, memory_gb: float | None, gpus: int, nodes: int, interconnect: str | None,
                calibration: Calibration | None) -> Target:  # fmt: skip
    if (gpu is None) == (memory_gb is None):
        raise UserError("give one of --gpu NAME (a GPU, or cpu for this machine) and --memory-gb X (this machine)")
    here = gpu is None or gpu.lower() == "cpu"  # processes on this machine's CPU
    most = max(MAX_GPUS_PER_NODE, cpu_cores()) if here else MAX_GPUS_PER_NODE
    if not 1 <= gpus <= most:
        raise UserError(
            f"--gpus {gpus} must be in 1..{most} (devices, or CPU processes, of one node); more take --nodes"
        )
    if not 1 <= nodes <= MAX_NODES:
        raise UserError(f"--nodes {nodes} must be in 1..{MAX_NODES}")
    if memory_gb is not None:
        if not 0 < memory_gb <= MAX_MEMORY_GB:
            raise UserError(
                f"--memory-gb {memory_gb:g} must be more than 0 and at most {MAX_MEMORY_GB:,} GB "
                f"(the memory of one process)"
            )
        return Target(f"this machine, {memory_gb:g} GB per process", None, gpus, nodes, int(memory_gb * GB), None,
                      None, calibration)  # fmt: skip
    if gpu is not None and gpu.lower() == "cpu":
        return Target(f"this machine's CPU ({cpu_cores()} cores)", None, gpus, nodes, None, None, None, calibration)
    assert gpu is not None
    entry = find_gpu(gpu)
    link = find_link(interconnect) if interconnect else None
    intra = link if link is not None and nodes == 1 else find_link(entry.link)
    inter = (link or find_link(DEFAULT_BETWEEN_NODES)) if nodes > 1 else None
    where = f"{nodes} nodes × {gpus}" if nodes > 1 else f"{gpus}"
    label = f"{where} × {entry.label}, {intra.label}" + (f" in a node, {inter.label} between nodes" if inter else "")
    return Target(label, entry, gpus, nodes, None, intra, inter, None)
