"""Starting DDP workers: torchrun's own elastic launcher, never a home-made one."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from multicard.errors import SELF_REPORTED, STOPPED_BY_SIGNAL, ExitCode, UserError
from multicard.host_memory import available_memory
from multicard.process_group import LAUNCHER_PID, cpu_cores, wait_for_master

# The agent forwards these to the workers: they checkpoint and exit 128 + signal, or quit at
# once on SIGQUIT (stopping.py).
SIGNALS_TO_FORWARD = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


@dataclass(frozen=True)
class LaunchOptions:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    rdzv_timeout: int = 300  # seconds a node waits to reach node 0 and for all nodes to join
    oversubscribe: bool = False  # on CPU, allow more processes than cores or than memory allows

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise UserError(f"--nproc-per-node {self.nproc_per_node} must be at least 1")
        if self.nnodes < 1:
            raise UserError(f"--nnodes {self.nnodes} must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise UserError(f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1}")
        if self.nnodes > 1 and (self.master_addr is None or self.master_port is None):
            raise UserError("--nnodes > 1 needs --master-addr and --master-port (the rendezvous host of node 0)")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise UserError(f"--master-port {self.master_port} must be in 1..65535")
        if self.rdzv_timeout < 1:
            raise UserError(f"--rdzv-timeout {self.rdzv_timeout} must be at least 1 second")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


WORKER_MEMORY = 1 << 29  # bytes a CPU worker needs at the least: torch itself, before any data (~0.5 GiB)


def check_cpu_capacity(nproc: int, oversubscribe: bool) -> None:
    """CPU workers share this node's cores and memory: more than it has is refused up front
    (64 processes on 2 cores take minutes to start and can exhaust memory) unless asked for."""
    if oversubscribe:
        return
    cores = cpu_cores()
    if nproc > cores:
        raise UserError(
            f"--nproc-per-node {nproc} starts more CPU processes than the {cores} core(s) this process may use; "
            f"use --nproc-per-node {cores} or fewer, or add --oversubscribe"
        )
    memory = available_memory()
    if nproc * WORKER_MEMORY > memory:
        fits = max(1, memory // WORKER_MEMORY)
        raise UserError(
            f"--nproc-per-node {nproc} CPU processes need about {nproc * WORKER_MEMORY / 2**30:.1f} GiB, more than the "
            f"{memory / 2**30:.1f} GiB available; use --nproc-per-node {fits} or fewer, or add --oversubscribe"
        )


def free_port() -> int:
    """A TCP port that was free a moment ago on this host (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(port: int) -> None:
    """Node 0 hosts the rendezvous on `port`: say so now if something else holds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            raise UserError(
                f"--master-port {port} is in use on this machine; choose another port "
                f"(or omit --master-port on a single node to get a free one)"
            ) from None


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


def _rendezvous(options: LaunchOptions, addr: str, port: int) -> dict:
    """LaunchConfig fields for c10d rendezvous: on a private port (one node, as torchrun
    --standalone) or hosted by node 0's agent at --master-addr:--master-port."""
    if options.nnodes == 1:
        private = f"multicard-{uuid.uuid4().hex[:8]}"
        return {"rdzv_backend": "c10d", "rdzv_endpoint": f"{addr}:{port}", "run_id": private}
    return {
        "rdzv_backend": "c10d",
        "rdzv_endpoint": f"{addr}:{port}",
        "run_id": f"multicard-{addr}-{port}",
        # Node 0 hosts the store, said outright: torch's guess (the endpoint matching the host
        # name's addresses) fails on machines with several interfaces.
        "rdzv_configs": {
            "is_host": options.node_rank == 0,
            "join_timeout": options.rdzv_timeout,
            "read_timeout": options.rdzv_timeout,
        },
        # Rank 0's agent hands its workers a store at this address; the other nodes must reach it.
        "local_addr": route_addr(addr, port),
    }


def run_spec(module: str, spec: dict, nproc: int, workdir: Path) -> tuple[int, dict | None]:
    """Run `python -m <module> workdir/spec.json` in nproc workers (bench cells, verify runs).

    The spec gets a "result" path for rank 0's JSON answer; returns (exit code, that answer).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    result = workdir / "result.json"
    result.unlink(missing_ok=True)
    (workdir / "spec.json").write_text(json.dumps({**spec, "result": str(result)}))
    code = launch_workers(LaunchOptions(nproc_per_node=nproc), [str(workdir / "spec.json")], module)
    return code, json.loads(result.read_text()) if result.exists() else None


def _cause(exc: ChildFailedError) -> tuple[int, int]:
    """(rank, exit code) of the failure that ended the job: a rank that said why (its own
    error) rather than peers that then lost their connection or were stopped by the agent;
    else a rank killed by a signal; else the first to fail."""
    failures = sorted(exc.failures.items(), key=lambda item: item[1].timestamp)

    def code(failure: ProcessFailure) -> int:
        return failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode

    for pick in (
        lambda c: c in SELF_REPORTED and c not in STOPPED_BY_SIGNAL,
        lambda c: c > 128 and c not in STOPPED_BY_SIGNAL,  # killed by a signal nobody sent on purpose
        lambda c: c != ExitCode.PEER_LOST,
        lambda c: True,
    ):
        for rank, failure in failures:
            if pick(code(failure)):
                return rank, code(failure)
    raise AssertionError("a failed job has failures")


def _describe(rank: int, code: int) -> str | None:
    """The launcher's line for a worker that could not say why it ended (None: it did)."""
    if code in SELF_REPORTED:
        return None
    if code == ExitCode.PEER_LOST:
        return f"rank {rank} lost its connection to the other ranks (a node or the network went away?)"
    if code > 128:
        sig = signal.Signals(code - 128)
        why = ": out of memory?" if sig == signal.SIGKILL else ""
        return f"rank {rank} was killed by {sig.name} (signal {code - 128}{why}); exit code {code}"
    return f"worker rank {rank} failed with exit code {code} (its traceback is above)"


def launch_workers(options: LaunchOptions, worker_argv: list[str], module: str = "multicard") -> int:
    """Run `python -m <module> <worker_argv>` in nproc_per_node workers; return the exit code.

    Several nodes: ranks follow the rendezvous order (by node address), not --node-rank, which
    only says which node hosts the rendezvous.
    """
    addr = options.master_addr or "127.0.0.1"
    port = options.master_port or free_port()
    if options.master_port is not None and options.node_rank == 0:
        check_port_free(port)
    if options.nnodes > 1 and options.node_rank != 0:
        hint = "start node 0 with the same --master-addr/--master-port, open that port, or raise --rdzv-timeout"
        wait_for_master(addr, port, options.rdzv_timeout, hint)
    os.environ[LAUNCHER_PID] = str(os.getpid())  # workers inherit it: they die with this process
    # torch's agent logs each worker's end and every signal it sends; our one line says what matters.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logs = tempfile.mkdtemp(prefix="multicard-launch-")  # else torch's agent leaves a directory in /tmp per run
    config = LaunchConfig(
        min_nodes=options.nnodes,
        max_nodes=options.nnodes,
        nproc_per_node=options.nproc_per_node,
        max_restarts=options.max_restarts,
        monitor_interval=0.1,
        signals_to_handle=SIGNALS_TO_FORWARD,
        logs_specs=DefaultLogsSpecs(log_dir=logs),
        **_rendezvous(options, addr, port),
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", module, *worker_argv)
    except SignalException as exc:
        # A signal to the launcher: the agent has passed it on and the workers have ended.
        print(f"multicard: stopped by {exc.sigval.name}; workers terminated", file=sys.stderr)
        return ExitCode.for_signal(int(exc.sigval))
    except RendezvousTimeoutError:
        raise UserError(
            f"not all {options.nnodes} nodes joined the rendezvous at {addr}:{port} within "
            f"{options.rdzv_timeout} s; start every node with the same --nnodes/--master-addr/--master-port "
            f"or raise --rdzv-timeout"
        ) from None
    except RendezvousError as exc:
        raise UserError(f"rendezvous at {addr}:{port} failed ({exc}); see docs/multinode.md") from None
    except ChildFailedError as exc:
        rank, code = _cause(exc)
        line = _describe(rank, code)
        if line is not None:
            print(f"multicard: error: {line}", file=sys.stderr)
        return code
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return ExitCode.OK
