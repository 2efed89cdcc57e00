"""How this process talks to the others: its device and threads, and the process group.

`setup` (from the `ProcessEnv` that environment.py read) picks the device, joins the rendezvous,
starts the process group and returns a frozen `ProcessContext`; `teardown` ends it.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from multicard.base.errors import UserError
from multicard.base.malloc import keep_freed_memory
from multicard.runtime.environment import ProcessEnv


@dataclass(frozen=True)
class ProcessContext:
    """What every layer below launch needs to know about this process."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    distributed: bool  # a process group is up (ddp), even if world_size == 1
    # The job's key-value store (the rendezvous'), for heartbeats; a local one in one process.
    store: Any = field(default=None, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0

    def barrier(self) -> None:
        """Wait for every rank (a no-op in one process)."""
        if self.distributed:
            dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (a picklable object; [obj] in one process)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    @contextmanager
    def local_main_first(self) -> Iterator[None]:
        """Local rank 0 runs the block first (filling a cache, say); the others run it after."""
        if not self.is_local_main:
            self.barrier()
        try:
            yield
        finally:
            if self.is_local_main:
                self.barrier()


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


def threads_per_process(requested: int, local_world_size: int) -> int:
    """`threads` if set, else this machine's cores shared out among its processes."""
    if requested:
        return requested
    return max(1, cpu_cores() // max(1, local_world_size))


def select_interface(ifname: str | None, environ: MutableMapping[str, str] = os.environ) -> None:
    """net.socket_ifname → GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME; a value already exported wins."""
    if not ifname:
        return
    present = sorted(name for _, name in socket.if_nameindex())
    missing = [name for name in ifname.split(",") if name not in present]
    if missing:
        raise UserError(
            f"net.socket_ifname={ifname}: {missing[0]} is not a network interface of this host "
            f"({', '.join(present)}); use one of those names"
        )
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        environ.setdefault(var, ifname)


def wait_for_master(addr: str, port: int, timeout_s: float, hint: str) -> None:
    """Return once addr:port accepts a TCP connection; a one-line UserError after timeout_s.

    Run before torch connects to a store, whose own retries log C++ traces and, on a silent
    network, take longer than asked. Refusals are retried: node 0 may simply start later.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(deadline - time.monotonic(), 2.0))):
                return
        except OSError as exc:
            reason = (exc.strerror or type(exc).__name__).lower()
        if time.monotonic() >= deadline:
            raise UserError(f"cannot reach the rendezvous at {addr}:{port} within {timeout_s:g} s ({reason}); {hint}")
        time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))


def route_addr(host: str, port: int) -> str | None:
    """This node's address on the route to `host`: where the other nodes can reach it.

    None (torch then uses the host name) when that route is loopback, i.e. `host` names this
    machine through 127.x, which other nodes could not use.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: picks the route and source address, sends nothing
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def node_name(env: ProcessEnv) -> str:
    """How this node is named to the others: its host name, with its address on the route to the
    job's master where there is one (host names alone may repeat: containers, namespaces)."""
    addr = route_addr(env.master_addr, env.master_port) if env.launched else None
    return f"{socket.gethostname()}/{addr}" if addr else socket.gethostname()


def use_device(gpus: list[int], env: ProcessEnv, distributed: bool, threads: int) -> torch.device:
    """This process's device and CPU threads (and, training on the CPU, its allocator's habits)."""
    if gpus:
        # topology.resolve has made sure there is a GPU for every local rank.
        device = torch.device("cuda", gpus[env.local_rank] if distributed else gpus[0])
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        keep_freed_memory()
    torch.set_num_threads(threads_per_process(threads, env.local_world_size if distributed else 1))
    return device


def setup(
    env: ProcessEnv,
    gpus: list[int],
    distributed: bool,
    threads: int,
    timeout_s: int,
    socket_ifname: str | None = None,
    trace_dir: Path | None = None,
) -> ProcessContext:
    """Pick this process's device, set thread count, and start the process group if asked.

    On CUDA with `trace_dir`, NCCL's flight recorder keeps the last collectives of each rank and
    dumps them there when a collective times out (torch's TORCH_NCCL_* variables; set ones win).
    """
    device = use_device(gpus, env, distributed, threads)
    store = None
    if distributed and not dist.is_initialized():
        select_interface(socket_ifname)
        if device.type == "cuda" and trace_dir is not None:
            trace_dir.mkdir(parents=True, exist_ok=True)
            os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(trace_dir / "nccl-trace-rank-"))
        store = join_group(env, device, timeout_s)
    return ProcessContext(
        rank=env.rank if distributed else 0,
        local_rank=env.local_rank if distributed else 0,
        world_size=env.world_size if distributed else 1,
        local_world_size=env.local_world_size if distributed else 1,
        device=device,
        distributed=distributed,
        store=store if distributed else dist.HashStore(),
    )


def join_group(env: ProcessEnv, device: torch.device, timeout_s: int) -> Any:
    """Meet the other ranks at the rendezvous and start the default process group; its store."""
    timeout = timedelta(seconds=timeout_s)
    if env.source == "slurm" and not env.is_main:
        hint = "start rank 0 (it hosts the store), check MASTER_ADDR/MASTER_PORT and firewalls, or raise dist_timeout_s"
        wait_for_master(env.master_addr, env.master_port, timeout_s, hint)
    # torchrun's agent may already host the store (TORCHELASTIC_USE_AGENT_STORE): env:// joins
    # it; srun has no agent, so rank 0 hosts one at the master address.
    url = "env://" if env.source == "torchrun" else f"tcp://{env.master_addr}:{env.master_port}"
    store, _, _ = next(dist.rendezvous(url, env.rank, env.world_size, timeout=timeout))
    if env.agent_store:
        # The agent's store outlives restarted workers: a prefix per attempt keeps a restarted rank
        # from reading a dead peer's address left by the previous attempt. (Elastic runs need a fresh
        # store per start instead: the count differs between nodes once one has joined; launch.py.)
        store = dist.PrefixStore(f"multicard/attempt-{env.restart}", store)
        if env.max_restarts > 0 and env.is_main:
            print(
                "multicard: warning: torchrun shares its rendezvous store with the workers, and restarts then "
                "meet stale keys and hang when a node joins; export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every "
                "node (docs/fault-tolerance.md, elastic jobs)",
                file=sys.stderr,
            )
    cuda = device.type == "cuda"
    dist.init_process_group(backend="nccl" if cuda else "gloo", store=store, rank=env.rank, world_size=env.world_size,
                            timeout=timeout, device_id=device if cuda else None)  # fmt: skip
    return store


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
