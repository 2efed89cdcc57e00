"""Starting DDP workers: torchrun's own elastic launcher, never a home-made one."""

from __future__ import annotations

import json
import socket
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from multicard.dist import wait_for_master
from multicard.errors import UserError

# The agent forwards these to the workers, which checkpoint and exit 128 + signal (stopping.py).
SIGNALS_TO_FORWARD = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# Exit codes of workers that have already printed their one line.
REPORTED_CODES = (UserError.exit_code, 3, 130, 138, 143)


@dataclass(frozen=True)
class LaunchOptions:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    rdzv_timeout: int = 300  # seconds a node waits to reach node 0 and for all nodes to join

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
    return code, json.loads(result.read_text()) if code == 0 and result.exists() else None


def _cause(exc: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The failure that ended the job: a rank that exited with one of our own codes (it said
    why) rather than a peer that then lost its connection to it; else the first to fail."""
    reported = [(rank, f) for rank, f in exc.failures.items() if f.exitcode in REPORTED_CODES]
    if reported:
        return min(reported, key=lambda item: item[1].timestamp)
    return exc.get_first_failure()


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
    config = LaunchConfig(
        min_nodes=options.nnodes,
        max_nodes=options.nnodes,
        nproc_per_node=options.nproc_per_node,
        max_restarts=options.max_restarts,
        monitor_interval=0.1,
        signals_to_handle=SIGNALS_TO_FORWARD,
        **_rendezvous(options, addr, port),
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", module, *worker_argv)
    except SignalException as exc:
        # A signal to the launcher: the agent has passed it on and the workers have ended.
        print(f"multicard: stopped by {exc.sigval.name}; workers terminated", file=sys.stderr)
        return 128 + int(exc.sigval)
    except RendezvousTimeoutError:
        raise UserError(
            f"not all {options.nnodes} nodes joined the rendezvous at {addr}:{port} within "
            f"{options.rdzv_timeout} s; start every node with the same --nnodes/--master-addr/--master-port "
            f"or raise --rdzv-timeout"
        ) from None
    except RendezvousError as exc:
        raise UserError(f"rendezvous at {addr}:{port} failed ({exc}); see docs/multinode.md") from None
    except ChildFailedError as exc:
        rank, failure = _cause(exc)
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        if code not in REPORTED_CODES:
            print(f"multicard: error: worker rank {rank} failed with exit code {failure.exitcode}", file=sys.stderr)
        return code
    return 0
