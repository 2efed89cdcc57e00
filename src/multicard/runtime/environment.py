"""Who am I among the job's processes: the one place that reads launcher variables.

`detect_env` reads torchrun's and Slurm's variables (nothing else in multicard does) into a
`ProcessEnv`; `node_topology` reads the cloud launchers' (Kubeflow's PET_*, SkyPilot's) into the
launcher flags they stand for; Slurm's compressed host lists are expanded here.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from multicard.base.errors import UserError

SLURM_DEFAULT_PORT_BASE = 15000  # Slurm runs derive a port from the job id above this base
LAUNCHER_PID = "MULTICARD_LAUNCHER_PID"  # set by multicard's own launcher for its workers
LAUNCHER_STOP_S = "MULTICARD_LAUNCHER_STOP_S"  # the seconds it gives them to stop (its stop timeout)
NODE_RANGE = "MULTICARD_NNODES"  # multicard's launcher tells its workers an elastic job's MIN:MAX nodes
STOP_MARK = "stop"  # in an agent's folder: its launcher was told to stop the job (a signal to it)


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
    stop_timeout_s: float = 300.0  # how long that launcher gives this worker to stop (checkpoint.stop_timeout_s)
    restart: int = 0  # how many times torchrun's agent has restarted the workers (--max-restarts)
    # The agent hosts the workers' store and keeps it over restarts (torch's default); False: rank 0
    # hosts a fresh one at each start (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as elastic runs need).
    agent_store: bool = False
    nnodes: str | None = None  # an elastic job's MIN:MAX nodes, where multicard's launcher started it
    max_restarts: int = 0  # torchrun's --max-restarts

    @property
    def world_sizes(self) -> list[int]:
        """Every world size this job may run at (an elastic job's MIN:MAX × processes per node)."""
        if self.nnodes is None:
            return [self.world_size]
        fewest, most = node_range(self.nnodes, NODE_RANGE)
        return [nodes * self.local_world_size for nodes in range(fewest, most + 1)]

    @property
    def launched(self) -> bool:
        return self.source != "none"

    @property
    def is_main(self) -> bool:
        """Rank 0, which says what every rank met (as ProcessContext.is_main, before there is one)."""
        return self.rank == 0


def node_range(text: str, name: str) -> tuple[int, int]:
    """(fewest, most) nodes from torchrun's --nnodes syntax: N (a fixed size) or MIN:MAX (elastic)."""
    low, sep, high = text.strip().partition(":")
    try:
        fewest, most = int(low), int(high if sep else low)
    except ValueError:
        raise UserError(f"{name} {text!r} must be a number of nodes N or a range MIN:MAX such as 1:4") from None
    if not 1 <= fewest <= most:
        raise UserError(f"{name} {text!r}: need 1 <= MIN <= MAX nodes, e.g. 1:4")
    return fewest, most


def agent_folder(agent_pid: int) -> Path | None:
    """A folder on this node's local disk that belongs to one elastic agent (multicard's launcher, or
    torchrun) for its whole life: its workers, restarted ones included, find there what the previous
    ones left (membership.py). Named by the agent's pid and start time: unique on this node, and the
    same for the agent itself and for every worker it starts (their parent). None off Linux."""
    try:
        started = Path(f"/proc/{agent_pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
    return Path(tempfile.gettempdir()) / f"multicard-agent-{agent_pid}-{started}"


def remove_stale_agent_folders() -> None:
    """The folders of agents that no longer run (killed, whatever left their folder behind): they hold
    what no worker will read again, each node's copies of checkpoints among it."""
    for folder in Path(tempfile.gettempdir()).glob("multicard-agent-*-*"):
        pid = folder.name.split("-")[2]
        if pid.isdigit() and agent_folder(int(pid)) != folder:  # gone, or its pid taken by another process
            shutil.rmtree(folder, ignore_errors=True)


def parent_agent_folder(env: ProcessEnv) -> Path | None:
    """agent_folder of the agent that started this worker (its parent), or None without one (one
    process, srun)."""
    return agent_folder(os.getppid()) if env.source == "torchrun" else None


def stopped_to_restart(env: ProcessEnv) -> bool:
    """A stop signal this worker got came from its agent, to start the workers again (nodes joined, or
    a worker failed), not from a person or a scheduler: multicard's launcher marks the stops it is told
    of in its folder (STOP_MARK), and the agent may restart. (Under torchrun it cannot be told apart.)"""
    folder = parent_agent_folder(env)
    restartable = env.max_restarts > 0 or env.nnodes is not None
    return env.launcher_pid is not None and restartable and folder is not None and not (folder / STOP_MARK).exists()


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
            stop_timeout_s=float(environ.get(LAUNCHER_STOP_S, ProcessEnv.stop_timeout_s)),
            restart=_int(environ, "TORCHELASTIC_RESTART_COUNT", default=0),
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            nnodes=environ.get(NODE_RANGE),
            max_restarts=_int(environ, "TORCHELASTIC_MAX_RESTARTS", default=0),
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
    torchrun reads for its flags; an elastic PyTorchJob names a rendezvous endpoint and MIN:MAX
    nodes instead of node 0 and a node rank) or a SkyPilot task (SKYPILOT_*)."""

    source: str  # kubeflow | skypilot
    nproc_per_node: int | None  # None: one per GPU in use (one on CPU)
    nnodes: int  # the most nodes
    node_rank: int | None  # None: not said (torch's agent finds out whether this node hosts the rendezvous)
    master_addr: str
    master_port: int
    min_nodes: int | None = None  # an elastic job's fewest nodes; None: nnodes, a fixed size
    max_restarts: int | None = None  # PET_MAX_RESTARTS; None: the command line's
    rdzv_conf: str = ""  # PET_RDZV_CONF (torchrun's --rdzv-conf), e.g. last_call_timeout=5


SKYPILOT_PORT = 29400  # a SkyPilot task names its nodes' addresses, not a port: the rendezvous takes this one
C10D_PORT = 29400  # torchrun's port for a c10d endpoint given without one


def node_topology(environ: Mapping[str, str] = os.environ) -> NodeTopology | None:
    """The topology a cloud launcher gave this node's one command in its environment, or None."""
    if "PET_NNODES" in environ and ("PET_MASTER_ADDR" in environ or "PET_RDZV_ENDPOINT" in environ):
        return _kubeflow(environ)
    if "SKYPILOT_NODE_IPS" in environ and "SKYPILOT_NODE_RANK" in environ:
        gpus = _int(environ, "SKYPILOT_NUM_GPUS_PER_NODE", default=0)
        return NodeTopology(
            "skypilot", gpus or None, _int(environ, "SKYPILOT_NUM_NODES", default=1),
            _int(environ, "SKYPILOT_NODE_RANK"), environ["SKYPILOT_NODE_IPS"].split()[0], SKYPILOT_PORT,
        )  # fmt: skip
    return None


def _kubeflow(environ: Mapping[str, str]) -> NodeTopology:
    """A TrainJob's node (PET_MASTER_ADDR, PET_NODE_RANK) or an elastic PyTorchJob's (PET_RDZV_ENDPOINT:
    any node may host the rendezvous, torch's agent finds out which)."""
    fewest, most = node_range(environ["PET_NNODES"], "PET_NNODES")
    node_rank: int | None = _int(environ, "PET_NODE_RANK", default=0)
    if "PET_MASTER_ADDR" in environ:
        addr, port = environ["PET_MASTER_ADDR"], _int(environ, "PET_MASTER_PORT", default=29500)
    else:
        addr, _, port_text = environ["PET_RDZV_ENDPOINT"].partition(":")
        port = int(port_text) if port_text.isdigit() else C10D_PORT
        node_rank = node_rank if "PET_NODE_RANK" in environ else None
    per_node = environ.get("PET_NPROC_PER_NODE", "auto")
    return NodeTopology(
        "kubeflow", _int(environ, "PET_NPROC_PER_NODE") if per_node.isdigit() else None, most, node_rank, addr, port,
        fewest if fewest < most else None,
        _int(environ, "PET_MAX_RESTARTS") if "PET_MAX_RESTARTS" in environ else None, environ.get("PET_RDZV_CONF", ""),
    )  # fmt: skip
