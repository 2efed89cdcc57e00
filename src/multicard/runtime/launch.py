"""Starting DDP workers: torchrun's own elastic launcher, never a home-made one."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from multicard.base.config import CheckpointConfig
from multicard.base.errors import SELF_REPORTED, STOPPED_BY_SIGNAL, ExitCode, MulticardError, NodesLost, UserError
from multicard.base.host_memory import available_memory
from multicard.runtime.environment import (
    LAUNCHER_PID,
    LAUNCHER_STOP_S,
    NODE_RANGE,
    STOP_MARK,
    agent_folder,
    remove_stale_agent_folders,
)
from multicard.runtime.process_group import cpu_cores, route_addr, wait_for_master
from multicard.runtime.stopping import STOP_SIGNALS, hand_over, quit_line

# The launcher passes these on to the workers (StopRelay): they checkpoint and exit 128 + signal,
# or quit at once on SIGQUIT (stopping.py). torch's agent handles none of them: it would give a
# stop 30 s, then kill the workers, and speak in lines of its own.
SIGNALS_TO_FORWARD = (*STOP_SIGNALS, signal.SIGQUIT)
KILL_WAIT_S = 10.0  # after SIGKILL, how long to wait for a worker stuck in the kernel before giving up on it


# torch's c10d rendezvous settings --rdzv-conf may give (torchrun's flag of that name); the join and
# read timeouts are --rdzv-timeout, and whether a node hosts the store is --node-rank's.
RDZV_CONF_KEYS = ("last_call_timeout", "close_timeout", "heartbeat", "keep_alive_interval", "keep_alive_max_attempt")


def rendezvous_conf(text: str) -> dict[str, int]:
    """torchrun's --rdzv-conf KEY=VALUE,... (those of RDZV_CONF_KEYS, whole seconds or counts >= 1)."""
    conf = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key not in RDZV_CONF_KEYS:
            raise UserError(f"--rdzv-conf {item!r}: it takes {', '.join(RDZV_CONF_KEYS)}, as KEY=VALUE")
        if not value.isdigit() or int(value) < 1:
            raise UserError(f"--rdzv-conf {item!r}: {key} takes a whole number >= 1")
        conf[key] = int(value)
    return conf


@dataclass(frozen=True)
class LaunchOptions:
    nproc_per_node: int
    nnodes: int = 1  # the most nodes (--nnodes N, or MAX of MIN:MAX)
    node_rank: int | None = 0  # 0 hosts the rendezvous; None: torch's agent decides (an elastic PyTorchJob)
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    rdzv_timeout: int = 300  # seconds a node waits to reach node 0 and for enough nodes to join
    oversubscribe: bool = False  # on CPU, allow more processes than cores or than memory allows
    min_nodes: int | None = None  # an elastic job's fewest nodes (--nnodes MIN:MAX); None: nnodes
    rdzv_conf: dict[str, int] = field(default_factory=dict)  # rendezvous_conf's settings

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise UserError(f"--nproc-per-node {self.nproc_per_node} must be at least 1")
        if not 1 <= self.fewest <= self.nnodes:
            raise UserError(f"--nnodes {self.nodes_text} needs 1 <= MIN <= MAX nodes")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise UserError(f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1}")
        if self.nnodes > 1 and (self.master_addr is None or self.master_port is None):
            raise UserError("--nnodes > 1 needs --master-addr and --master-port (the rendezvous host of node 0)")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise UserError(f"--master-port {self.master_port} must be in 1..65535")
        if self.rdzv_timeout < 1:
            raise UserError(f"--rdzv-timeout {self.rdzv_timeout} must be at least 1 second")
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts {self.max_restarts} must be at least 0")

    @property
    def fewest(self) -> int:
        return self.nnodes if self.min_nodes is None else self.min_nodes

    @property
    def nodes_text(self) -> str:
        return str(self.nnodes) if self.fewest == self.nnodes else f"{self.fewest}:{self.nnodes}"

    @property
    def world_size(self) -> int:
        """Processes at the most nodes."""
        return self.nproc_per_node * self.nnodes

    @property
    def world_sizes(self) -> list[int]:
        """Every world size the job may run at: one, or one per node count of MIN:MAX."""
        return [self.nproc_per_node * nodes for nodes in range(self.fewest, self.nnodes + 1)]

    @property
    def restartable(self) -> bool:
        """The agent may start this node's workers again: after a failure, or as nodes come and go."""
        return self.max_restarts > 0 or self.fewest < self.nnodes


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


def _rendezvous(options: LaunchOptions, addr: str, port: int) -> dict:
    """LaunchConfig fields for c10d rendezvous: on a private port (one node, as torchrun
    --standalone) or hosted by node 0's agent at --master-addr:--master-port."""
    if options.nnodes == 1:
        private = f"multicard-{uuid.uuid4().hex[:8]}"
        # Hosted here, said outright: else, on a port another process took since free_port chose it,
        # torch's agent quietly joins that process's store, and the job dies when that process ends.
        rendezvous = {"rdzv_endpoint": f"{addr}:{port}", "run_id": private, "rdzv_configs": {"is_host": True}}
        return {"rdzv_backend": "c10d", **rendezvous}
    return {
        "rdzv_backend": "c10d",
        "rdzv_endpoint": f"{addr}:{port}",
        "run_id": f"multicard-{addr}-{port}",
        # Node 0 hosts the store, said outright: torch's guess (the endpoint matching the host
        # name's addresses) fails on machines with several interfaces.
        "rdzv_configs": {
            **({"is_host": options.node_rank == 0} if options.node_rank is not None else {}),
            "join_timeout": options.rdzv_timeout,
            "read_timeout": options.rdzv_timeout,
            **options.rdzv_conf,
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


def _report_cause(failures: list[tuple[int, int]]) -> int:
    """The exit code of the failure that ended the job, said in one line where its worker could not
    (_describe), from (rank, code) in the order the workers failed: a rank that said why (its own error)
    rather than peers that then lost their connection or were stopped by the agent; else a rank killed by
    a signal; else the first to fail."""
    for pick in (
        lambda c: c in SELF_REPORTED and c not in STOPPED_BY_SIGNAL,
        lambda c: c > 128 and c not in STOPPED_BY_SIGNAL,  # killed by a signal nobody sent on purpose
        lambda c: c != ExitCode.PEER_LOST,
        lambda c: True,
    ):
        for rank, code in failures:
            if pick(code):
                line = _describe(rank, code)
                if line is not None:
                    print(f"multicard: error: {line}", file=sys.stderr)
                return code
    raise AssertionError("a failed job has failures")


def _describe(rank: int, code: int) -> str | None:
    """The launcher's line for a worker that could not say why it ended (None: it did)."""
    if code in SELF_REPORTED:
        return None
    if code == ExitCode.PEER_LOST:
        return f"rank {rank} lost its connection to the other ranks (a node or the network went away?)"
    if code == ExitCode.ABORTED:  # gloo's or NCCL's C++ abort: its own text above is native; this says why
        return (
            f"rank {rank} aborted in native code (SIGABRT; exit code {code}), most often because the ranks called "
            f"different collectives (a collective on one rank only, or with tensors of other sizes: gloo's "
            f"\"collective mismatch\" above); call the same collectives in the same order on every rank "
            f"(TORCH_DISTRIBUTED_DEBUG=DETAIL names the first that differs)"
        )
    if code > 128:
        sig = signal.Signals(code - 128)
        why = ": out of memory?" if sig == signal.SIGKILL else ""
        return f"rank {rank} was killed by {sig.name} (signal {code - 128}{why}); exit code {code}"
    return f"worker rank {rank} failed with exit code {code} (its traceback is above)"


def _workers() -> dict[int, int]:
    """pid → global rank of this launcher's workers: its child processes that lead a session
    (torch's agent starts each in a session of its own, with its data-loader processes; a process
    that a worker started and left is this launcher's child too, in the worker's session)."""
    me, found = os.getpid(), {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split() if entry.name.isdigit() else []
            if stat and int(stat[1]) == me and stat[3] == entry.name:
                ranks = [v for v in (entry / "environ").read_bytes().split(b"\0") if v.startswith(b"RANK=")]
                found.update({int(entry.name): int(ranks[0][5:])} if ranks else {})
        except OSError:
            continue  # ended meanwhile
    return found


def _ended(pid: int) -> tuple[int, bool] | None:
    """(exit code, killed by a signal) of a worker that has ended, left for the agent to reap; None: running."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return 0, False  # already reaped: it ended, how is no longer known
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status, False
    return 128 + info.si_status, True


class StopRelay:
    """The launcher's handling of SIGNALS_TO_FORWARD, in place of torch's agent's.

    The first signal goes to every worker's process group; the launcher then waits up to
    `timeout` seconds (checkpoint.stop_timeout_s) for them to checkpoint and exit, and kills them
    after that, or at once after a second SIGINT (a SIGQUIT is passed on: stacks show where a
    slow stop is). The agent's run then ends with SignalException, so no restart follows a stop,
    and `report` says in one line what happened (nothing when rank 0 has said it).
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.signum = 0
        self.quit = False  # a second SIGINT: workers killed
        self.timed_out = False
        self.ended: dict[int, tuple[int, int, bool]] = {}  # pid → (rank, exit code, killed by a signal), in order
        self._ranks: dict[int, int] = {}
        self._previous: dict[int, Any] = {}  # what signal.signal returned: a handler, SIG_DFL or SIG_IGN

    def __enter__(self) -> StopRelay:
        if threading.current_thread() is threading.main_thread():  # only it may handle signals
            for sig in SIGNALS_TO_FORWARD:
                self._previous[sig] = signal.signal(sig, self._handle)
                hand_over(self._previous[sig])
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum:  # while waiting for the stop (the handler runs again inside _wait)
            if signum == signal.SIGINT == self.signum:
                self.quit = True
            elif signum == signal.SIGQUIT:
                self._send(signum)
            return
        self.signum = signum
        self._ranks = _workers()
        _mark_stop(signum)
        self._send(signum)
        self._wait()
        raise SignalException(f"multicard's launcher got {signal.Signals(signum).name}", signal.Signals(signum))

    def _send(self, signum: int) -> None:
        for pid in self._ranks:
            if pid not in self.ended:
                with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                    os.killpg(pid, signum)

    def _wait(self) -> None:
        """Until every worker has ended. Killed: on a second SIGINT, past the timeout, or once one
        died of the signal itself (it had no handler yet; the others cannot agree on a stop without it)."""
        deadline = time.monotonic() + self.timeout
        while True:
            for pid, rank in self._ranks.items():
                if pid not in self.ended and (status := _ended(pid)) is not None:
                    self.ended[pid] = (rank, *status)
            if len(self.ended) == len(self._ranks) or time.monotonic() > deadline + KILL_WAIT_S:
                return
            self.timed_out = self.timed_out or (time.monotonic() > deadline and not self.quit)
            if self.quit or self.timed_out or self._unprepared():
                self._send(signal.SIGKILL)
            time.sleep(0.05)

    def _unprepared(self) -> list[int]:
        """Ranks the signal itself ended: they had not yet started training (no handler)."""
        return [rank for rank, code, killed in self.ended.values() if killed and code == 128 + self.signum]

    def report(self, training: bool) -> int:
        """Say what the stop came to, in at most one line; its exit code."""
        name = signal.Signals(self.signum).name
        stopped = ExitCode.for_signal(self.signum)
        if self.quit:
            print(quit_line(self.signum), file=sys.stderr)
            return stopped
        if self.timed_out:
            print(
                f"multicard: error: the stop on {name} took longer than {self.timeout:g} s; workers killed before "
                f"their checkpoint was complete (the last one written stays); raise checkpoint.stop_timeout_s",
                file=sys.stderr,
            )
            return stopped
        if not self.ended or self._unprepared():
            tail = " before training started; nothing to save" if training else "; workers terminated"
            print(f"multicard: stopped by {name}{tail}", file=sys.stderr)
            return stopped
        failures = [(rank, code) for rank, code, _ in self.ended.values() if code != ExitCode.OK]
        if not failures:
            return ExitCode.OK  # the job ended before the stop took effect
        return _report_cause(failures)


def _mark_stop(signum: int) -> None:
    """Tell this launcher's workers that the signal they get is a stop of the job, not their agent's
    restart (environment.stopped_to_restart)."""
    folder = agent_folder(os.getpid())
    if folder is not None:
        folder.mkdir(mode=0o700, exist_ok=True)
        (folder / STOP_MARK).write_text(signal.Signals(signum).name)


def _quiet_torch_agent() -> None:
    """torch's agent logs each worker's end and each signal; our one line says what matters.
    Its modules set their loggers' levels themselves, so each is raised, not just their parent."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch_workers(
    options: LaunchOptions,
    worker_argv: list[str],
    module: str = "multicard",
    stop_timeout_s: float = CheckpointConfig.stop_timeout_s,
) -> int:
    """Run `python -m <module> <worker_argv>` in nproc_per_node workers (`multicard train ...`, or
    `multicard run SCRIPT ...`: a user's loop with multicard.Run); return the exit code. A signal to
    the launcher gives the workers up to `stop_timeout_s` to stop (StopRelay).

    Several nodes: ranks follow the rendezvous order (by node address), not --node-rank, which
    only says which node hosts the rendezvous.
    """
    program = ["-m", module, *worker_argv]
    relay = StopRelay(stop_timeout_s)
    try:
        with for_workers_only(), relay:  # from the start: a signal while waiting for node 0 is answered too
            os.environ[LAUNCHER_STOP_S] = f"{stop_timeout_s:g}"  # a worker whose launcher dies stops within it too
            return _launch(options, program)
    except SignalException:
        # A signal to the launcher: StopRelay has passed it on and the workers have ended.
        return relay.report(training=module == "multicard" and worker_argv[:1] in (["train"], ["run"]))


# ours, and torch's agent's own (it sets the signals its workers handle in its process's environment)
WORKER_VARIABLES = (LAUNCHER_STOP_S, LAUNCHER_PID, NODE_RANGE, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
                    "TORCHELASTIC_SIGNALS_TO_HANDLE")  # fmt: skip


@contextlib.contextmanager
def for_workers_only() -> Iterator[None]:
    """The variables the launcher sets for its workers (torch's agent gives them this process's
    environment) are unset again when it returns: a process that launches, then starts other
    programs (a test suite, a notebook), must not pass them on as though it were still a launcher."""
    before = {name: os.environ.get(name) for name in WORKER_VARIABLES}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _launch(options: LaunchOptions, program: list[str], port_tries: int = 3) -> int:
    addr = options.master_addr or "127.0.0.1"
    port = options.master_port or free_port()
    if options.master_port is not None and options.node_rank == 0:
        check_port_free(port)
    if options.nnodes > 1 and options.node_rank not in (0, None):  # None: this node may host it itself
        hint = "start node 0 with the same --master-addr/--master-port, open that port, or raise --rdzv-timeout"
        wait_for_master(addr, port, options.rdzv_timeout, hint)
    os.environ[LAUNCHER_PID] = str(os.getpid())  # workers inherit it: they die with this process
    remove_stale_agent_folders()
    os.environ.pop(NODE_RANGE, None)
    if options.fewest < options.nnodes:
        os.environ[NODE_RANGE] = options.nodes_text  # a script's Run checks its batch at every size
    if options.restartable:
        # A store of its own for each start of the workers, hosted by their rank 0, instead of the agent's
        # shared one: with that, a node joining a running job waits forever in torch's agent (it reads
        # the store's address from a rendezvous round that no longer publishes it), and workers of one
        # start disagree on the restart count that keys it (a joined node counts from 0).
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    _quiet_torch_agent()
    logs = tempfile.mkdtemp(prefix="multicard-launch-")  # else torch's agent leaves a directory in /tmp per run
    config = LaunchConfig(
        min_nodes=options.fewest,
        max_nodes=options.nnodes,
        nproc_per_node=options.nproc_per_node,
        max_restarts=options.max_restarts,
        monitor_interval=0.1,
        signals_to_handle="",  # none: StopRelay handles them
        logs_specs=DefaultLogsSpecs(log_dir=logs),
        **_rendezvous(options, addr, port),
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)(*program)
    except RendezvousConnectionError as exc:
        if options.master_port is None and options.nnodes == 1 and port_tries > 1:
            return _launch(options, program, port_tries - 1)  # its free port was taken meanwhile
        raise _rendezvous_failed(exc, options, f"{addr}:{port}") from None
    except RendezvousError as exc:
        raise _rendezvous_failed(exc, options, f"{addr}:{port}") from None
    except ChildFailedError as exc:
        by_time = sorted(exc.failures.items(), key=lambda item: item[1].timestamp)  # killed: -signal, as 128 + it
        return _report_cause([(r, f.exitcode if f.exitcode >= 0 else 128 - f.exitcode) for r, f in by_time])
    finally:
        shutil.rmtree(logs, ignore_errors=True)
        folder = agent_folder(os.getpid())  # what its workers kept on the node's disk for their restarts
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return ExitCode.OK


def _rendezvous_failed(exc: RendezvousError, options: LaunchOptions, endpoint: str) -> MulticardError:
    """The one line for a rendezvous that failed: before the job started (bad input: UserError), or
    when the job re-formed after losing nodes (NodesLost: its checkpoints stay, the same command resumes)."""
    trained = (folder := agent_folder(os.getpid())) is not None and folder.exists()  # membership.py made it
    if isinstance(exc, RendezvousTimeoutError) and trained:
        return NodesLost(
            f"the job lost node(s) and fewer than {options.fewest} (--nnodes {options.nodes_text}) were back "
            f"at the rendezvous {endpoint} within --rdzv-timeout {options.rdzv_timeout} s; its last checkpoint is "
            f"intact: start the lost node(s), then the same command on every node resumes"
        )
    if isinstance(exc, RendezvousConnectionError) and trained:
        return NodesLost(
            f"lost the rendezvous at {endpoint}: node 0, which hosts it, is gone, and the other nodes cannot "
            f"re-form without it; its last checkpoint is intact: start the lost node(s), then the same command on "
            f"every node resumes (node 0 first)"
        )
    if isinstance(exc, RendezvousTimeoutError):
        return UserError(
            f"not all {options.fewest} nodes joined the rendezvous at {endpoint} within {options.rdzv_timeout} s; "
            f"start every node with the same --nnodes/--master-addr/--master-port or raise --rdzv-timeout"
        )
    if isinstance(exc, RendezvousConnectionError):
        return UserError(
            f"rendezvous at {endpoint} failed: this node cannot host its store there (the port is taken, or the "
            f"address is not this machine's); choose another --master-port or --master-addr"
        )
    return UserError(f"rendezvous at {endpoint} failed ({exc}); see docs/multinode.md")
