"""Who am I and how do I talk to the others: the one place that reads launcher variables.

`detect_env` reads torchrun's and Slurm's variables (nothing else in multicard does);
`setup` starts the process group and returns a frozen `DistContext`; `teardown` ends it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from multicard.errors import UserError

SLURM_DEFAULT_PORT_BASE = 15000  # Slurm runs derive a port from the job id above this base


@dataclass(frozen=True)
class ProcessEnv:
    """The process topology as the launcher describes it."""

    source: str  # "none" (plain process), "torchrun" or "slurm"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def launched(self) -> bool:
        return self.source != "none"


@dataclass(frozen=True)
class DistContext:
    """What every layer below launch needs to know about this process."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    distributed: bool  # a process group is up (ddp), even if world_size == 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm node list such as 'gpu[01-03,07],login1' into host names."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            if not hi:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            width = len(lo)
            for i in range(int(lo), int(hi) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    return hosts


def _int(environ: Mapping[str, str], *names: str, default: int | None = None) -> int:
    for name in names:
        if name in environ:
            try:
                return int(environ[name].split("(")[0])  # Slurm writes e.g. "2(x4)"
            except ValueError:
                raise UserError(f"environment variable {name}={environ[name]!r} is not an integer") from None
    if default is None:
        raise UserError(f"environment variable {names[0]} is missing")
    return default


def detect_env(environ: Mapping[str, str] = os.environ) -> ProcessEnv:
    """Read the topology from torchrun (RANK, ...) or srun (SLURM_*); else one plain process."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return ProcessEnv(
            source="torchrun",
            rank=_int(environ, "RANK"),
            local_rank=_int(environ, "LOCAL_RANK", default=0),
            world_size=_int(environ, "WORLD_SIZE"),
            local_world_size=_int(environ, "LOCAL_WORLD_SIZE", default=1),
            node_rank=_int(environ, "GROUP_RANK", default=0),
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(environ, "MASTER_PORT", default=29500),
        )
    # SLURM_STEP_NUM_TASKS is set by srun, not in a bare sbatch script, which stays one process.
    if "SLURM_PROCID" in environ and "SLURM_STEP_NUM_TASKS" in environ:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
        hosts = expand_hostlist(nodelist) if nodelist else ["127.0.0.1"]
        job_id = _int(environ, "SLURM_JOB_ID", default=0)
        return ProcessEnv(
            source="slurm",
            rank=_int(environ, "SLURM_PROCID"),
            local_rank=_int(environ, "SLURM_LOCALID", default=0),
            world_size=_int(environ, "SLURM_STEP_NUM_TASKS"),
            local_world_size=_int(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", default=1),
            node_rank=_int(environ, "SLURM_NODEID", default=0),
            master_addr=environ.get("MASTER_ADDR", hosts[0]),
            master_port=_int(environ, "MASTER_PORT", default=SLURM_DEFAULT_PORT_BASE + job_id % 20000),
        )
    return ProcessEnv(source="none")


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_gpus(requested: list[int] | None) -> list[int]:
    """GPU ids to use: [] means CPU. `requested` follows config.parse_devices."""
    present = cuda_count()
    if requested is None:
        return []
    if requested == []:
        return list(range(present))
    if present == 0:
        raise UserError(f"devices={requested} asks for GPUs but none is present; use devices=cpu")
    missing = [i for i in requested if i >= present]
    if missing:
        raise UserError(
            f"devices={requested} asks for GPU {missing[0]} but only {present} GPU(s) exist "
            f"(ids 0..{present - 1}); list fewer GPUs"
        )
    return requested


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's total)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _threads(requested: int, local_world_size: int) -> int:
    if requested:
        return requested
    return max(1, cpu_cores() // max(1, local_world_size))


def setup(env: ProcessEnv, gpus: list[int], distributed: bool, threads: int, timeout_s: int) -> DistContext:
    """Pick this process's device, set thread count, and start the process group if asked."""
    if gpus:
        # run.check_topology has made sure there is a GPU for every local rank.
        gpu = gpus[env.local_rank] if distributed else gpus[0]
        device = torch.device("cuda", gpu)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.set_num_threads(_threads(threads, env.local_world_size if distributed else 1))
    if distributed and not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        # torchrun's agent may already host the store (TORCHELASTIC_USE_AGENT_STORE): env://
        # joins it; srun has no agent, so rank 0 hosts one at the master address.
        url = "env://" if env.source == "torchrun" else f"tcp://{env.master_addr}:{env.master_port}"
        store, _, _ = next(dist.rendezvous(url, env.rank, env.world_size, timeout=timeout))
        # The agent's store outlives restarted workers: a prefix per attempt keeps a restarted
        # rank from reading a dead peer's address left by the previous attempt.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            store=dist.PrefixStore(f"multicard/attempt-{attempt}", store),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    return DistContext(
        rank=env.rank if distributed else 0,
        local_rank=env.local_rank if distributed else 0,
        world_size=env.world_size if distributed else 1,
        local_world_size=env.local_world_size if distributed else 1,
        device=device,
        distributed=distributed,
    )


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
