"""Starting DDP workers: torchrun's own elastic launcher, never a home-made one."""

from __future__ import annotations

import socket
import sys
import uuid
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from multicard.errors import UserError


@dataclass(frozen=True)
class LaunchOptions:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0

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


def launch_workers(options: LaunchOptions, worker_argv: list[str], module: str = "multicard") -> int:
    """Run `python -m <module> <worker_argv>` in nproc_per_node workers; return the exit code."""
    addr = options.master_addr or "127.0.0.1"
    port = options.master_port or free_port()
    if options.master_port is not None and options.node_rank == 0:
        check_port_free(port)
    multinode = options.nnodes > 1
    config = LaunchConfig(
        min_nodes=options.nnodes,
        max_nodes=options.nnodes,
        nproc_per_node=options.nproc_per_node,
        run_id=f"multicard-{addr}-{port}" if multinode else f"multicard-{uuid.uuid4().hex[:8]}",
        # Several nodes: static rendezvous, as torchrun does with --node-rank, so node R holds
        # ranks R*nproc .. R*nproc+nproc-1. One node: c10d on a private port (torchrun --standalone).
        rdzv_backend="static" if multinode else "c10d",
        rdzv_endpoint=f"{addr}:{port}",
        rdzv_configs={"rank": options.node_rank} if multinode else {},
        max_restarts=options.max_restarts,
        monitor_interval=0.1,
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", module, *worker_argv)
    except SignalException as exc:
        # SIGINT/SIGTERM to the launcher: the agent has already stopped the workers.
        print(f"multicard: stopped by {exc.sigval.name}; workers terminated", file=sys.stderr)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()  # the cause, not a worker the agent then stopped
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        if code not in (UserError.exit_code, 3, 130, 143):  # those already printed their one line
            print(f"multicard: error: worker rank {rank} failed with exit code {failure.exitcode}", file=sys.stderr)
        return code
    return 0
