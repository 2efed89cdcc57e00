"""Who am I and how do I talk to the others: the one place that reads launcher variables.

`detect_env` reads torchrun's and Slurm's variables (nothing else in multicard does);
`setup` starts the process group and returns a frozen `ProcessContext`; `teardown` ends it.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from multicard.base.errors import ExitCode, UserError
from multicard.base.malloc import keep_freed_memory

SLURM_DEFAULT_PORT_BASE = 15000  # Slurm runs derive a port from the job id above this base
LAUNCHER_PID = "MULTICARD_LAUNCHER_PID"  # set by multicard's own launcher for its workers
PR_SET_PDEATHSIG = 1  # prctl option: a signal for this process when its parent dies
EXIT_GRACE_S = 2.0  # how long threads still running when a command is done may delay its process's end


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
    launcher_pid: int | None = None  # multicard's own launcher started this worker
    restart: int = 0  # how many times torchrun's agent has restarted the workers (--max-restarts)

    @property
    def launched(self) -> bool:
        return self.source != "none"

    @property
    def is_main(self) -> bool:
        """Rank 0, which says what every rank met (as ProcessContext.is_main, before there is one)."""
        return self.rank == 0


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


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm node list such as 'gpu[01-03,07],login1' or 'r[1-2]-n[1-2]' into host names."""
    hosts: list[str] = []
    for part in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        hosts.extend(_expand_name(part))
    return hosts


def _expand_name(name: str) -> list[str]:
    match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", name)
    if not match:
        return [name]
    prefix, ranges, rest = match.groups()
    heads: list[str] = []
    for item in ranges.split(","):
        lo, _, hi = item.partition("-")
        width = len(lo)  # zero padding is kept: node[08-10] → node08, node09, node10
        heads.extend(f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi or lo) + 1))
    # Several bracket groups in one name (rack[1-2]-n[1-2]) multiply, as in Slurm.
    return [head + tail for head in heads for tail in _expand_name(rest)]


def tasks_on_node(spec: str, node: int) -> int:
    """Tasks on node `node` from a Slurm count list such as '4(x2),3' (= 4, 4, 3)."""
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise UserError(f"cannot read the Slurm task count list {spec!r} (expected e.g. '4(x2),3')")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts[node] if node < len(counts) else counts[-1]


def _int(environ: Mapping[str, str], *names: str, default: int | None = None) -> int:
    for name in names:
        if name in environ:
            try:
                return int(environ[name])
            except ValueError:
                raise UserError(f"environment variable {name}={environ[name]!r} is not an integer") from None
    if default is None:
        raise UserError(f"environment variable {names[0]} is missing")
    return default


def _local_tasks(environ: Mapping[str, str], node: int) -> int:
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        if environ.get(name):
            return tasks_on_node(environ[name], node)
    return 1


def detect_env(environ: Mapping[str, str] = os.environ) -> ProcessEnv:
    """Read the topology from torchrun (RANK, ...) or srun (SLURM_*); else one plain process."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return ProcessEnv(
            source="torchrun",
            launcher_pid=_int(environ, LAUNCHER_PID) if LAUNCHER_PID in environ else None,
            restart=_int(environ, "TORCHELASTIC_RESTART_COUNT", default=0),
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
        node = _int(environ, "SLURM_NODEID", default=0)
        return ProcessEnv(
            source="slurm",
            rank=_int(environ, "SLURM_PROCID"),
            local_rank=_int(environ, "SLURM_LOCALID", default=0),
            world_size=_int(environ, "SLURM_STEP_NUM_TASKS"),
            local_world_size=_local_tasks(environ, node),
            node_rank=node,
            master_addr=environ.get("MASTER_ADDR", hosts[0]),
            master_port=_int(environ, "MASTER_PORT", default=SLURM_DEFAULT_PORT_BASE + job_id % 20000),
        )
    return ProcessEnv(source="none")


@dataclass(frozen=True)
class NodeTopology:
    """How a cloud launcher that starts one command per node describes the job, for multicard's own
    launcher to start this node's workers: a Kubeflow TrainJob/PyTorchJob (PET_*, the variables
    torchrun reads for its flags) or a SkyPilot task (SKYPILOT_*)."""

    source: str  # kubeflow | skypilot
    nproc_per_node: int | None  # None: one per GPU in use (one on CPU)
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int


SKYPILOT_PORT = 29400  # a SkyPilot task names its nodes' addresses, not a port: the rendezvous takes this one


def node_topology(environ: Mapping[str, str] = os.environ) -> NodeTopology | None:
    """The topology a cloud launcher gave this node's one command in its environment, or None."""
    if "PET_NNODES" in environ and "PET_MASTER_ADDR" in environ:
        per_node = environ.get("PET_NPROC_PER_NODE", "auto")
        return NodeTopology(
            "kubeflow", _int(environ, "PET_NPROC_PER_NODE") if per_node.isdigit() else None,
            _int(environ, "PET_NNODES"), _int(environ, "PET_NODE_RANK", default=0), environ["PET_MASTER_ADDR"],
            _int(environ, "PET_MASTER_PORT", default=29500),
        )  # fmt: skip
    if "SKYPILOT_NODE_IPS" in environ and "SKYPILOT_NODE_RANK" in environ:
        gpus = _int(environ, "SKYPILOT_NUM_GPUS_PER_NODE", default=0)
        return NodeTopology(
            "skypilot", gpus or None, _int(environ, "SKYPILOT_NUM_NODES", default=1),
            _int(environ, "SKYPILOT_NODE_RANK"), environ["SKYPILOT_NODE_IPS"].split()[0], SKYPILOT_PORT,
        )  # fmt: skip
    return None


def end_process(code: int) -> NoReturn:
    """End this process now, its output flushed, without the interpreter's shutdown: for a rank
    that failed (its peers must not see its connections close before the launcher hears of it),
    and for one whose work is done and written under fsdp, where torch's native teardown
    sometimes aborts at exit (SIGABRT, "terminate called without an active exception": a C++
    thread still joinable) — in about 1 of 5 `plan --measure` runs and once in a CI run of the
    tests — and the launcher then reports a failed rank for a job that succeeded."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_in_time(code: int, grace_s: float = EXIT_GRACE_S) -> None:
    """Make sure the process ends with `code` once the command is done. The interpreter's exit
    waits for every non-daemon thread, and one that never ends (started by a dataset function,
    say) would keep the process, and a launcher waiting for it, alive forever: such threads get
    `grace_s` to end, then the process ends without them, naming them. Call it just before the
    interpreter's exit, which runs as usual meanwhile (exit handlers, threads that do end)."""
    lingering = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    if not lingering:
        return

    def watch() -> None:
        deadline = time.monotonic() + grace_s
        for thread in lingering:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [repr(t.name) for t in lingering if t.is_alive()]
        if alive:
            line = (
                f"multicard: warning: thread(s) {', '.join(alive)} still running {grace_s:g} s after the command "
                f"ended (started by the dataset's or model's code, not multicard's); ending the process without them"
            )
            os.write(2, f"{line}\n".encode())
            end_process(code)

    threading.Thread(target=watch, name="multicard-exit", daemon=True).start()


def die_with_launcher(env: ProcessEnv) -> None:
    """A worker of multicard's launcher gets SIGTERM when the launcher dies, however it dies
    (SIGKILL by the out-of-memory killer or a scheduler): it then stops like on any SIGTERM,
    with a checkpoint if training, at once if still starting."""
    if env.launcher_pid is not None:
        die_with_parent(env.launcher_pid)


def die_with_parent(parent_pid: int) -> None:
    """This process gets SIGTERM when its parent (`parent_pid`) dies, however it dies. Linux only;
    elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def communication_failure(exc: BaseException) -> ExitCode | None:
    """STALLED for a collective that timed out, PEER_LOST for a connection another rank dropped
    (it failed, was killed or its node went away); None if `exc` is not a communication failure."""
    text = str(exc)
    # gloo's timeouts also surface as "Application timeout caused pair closure", naming no backend.
    gloo = any(word in text for word in ("gloo", "NCCL", "pair closure"))
    if not (isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and gloo)):
        return None
    if re.search(r"timed out|timeout", text, re.IGNORECASE):
        return ExitCode.STALLED
    return ExitCode.PEER_LOST


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
            record_nccl_flights(trace_dir)
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
    # The agent's store outlives restarted workers: a prefix per attempt keeps a restarted rank
    # from reading a dead peer's address left by the previous attempt.
    store = dist.PrefixStore(f"multicard/attempt-{env.restart}", store)
    cuda = device.type == "cuda"
    dist.init_process_group(backend="nccl" if cuda else "gloo", store=store, rank=env.rank, world_size=env.world_size,
                            timeout=timeout, device_id=device if cuda else None)  # fmt: skip
    return store


def record_nccl_flights(trace_dir: Path) -> None:
    """NCCL's flight recorder keeps each rank's last collectives and dumps them into `trace_dir`
    when one times out (torch's TORCH_NCCL_* variables; ones already set win)."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(trace_dir / "nccl-trace-rank-"))


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
