"""Several nodes for real: two hosts over a network, an unreachable master, and the commands of
docs/multinode.md and examples/slurm/train.sbatch.

The two hosts are two network namespaces joined by a veth pair, each with its own address,
interface and ports; they need root and `ip netns` and are skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import MULTICARD, TINY, assert_bitwise_equal, clean_env, cli, final_params, run_here

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "multinode.md"
# The values the test gives the guide's variables: node addresses on the veth, its name in
# both namespaces, one process per node. The guide's rehearsal section quotes them.
VALUES = {"HOST0": "10.213.7.1", "HOST1": "10.213.7.2", "IFNAME": "mcnet0", "GPUS": "1"}
# threads=1: the default thread count depends on the processes per node, and another count
# rounds the convolutions differently (see the guide). devices=cpu: one GPU cannot serve two nodes.
SMALL = [*TINY, "threads=1", "devices=cpu"]


def fenced_commands(text: str, prefix: str) -> list[str]:
    """Command lines in ```bash blocks that start with `prefix` (continuation lines joined)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines += [line.strip() for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line.startswith(prefix)]


def expand(command: str, values: dict[str, str]) -> list[str]:
    """shlex-split a command after putting in $VAR / ${VAR}; an unknown variable fails the test."""

    def value(match: re.Match) -> str:
        name = match[1] or match[2]
        assert name in values, f"no test value for ${name} in: {command}"
        return values[name]

    return shlex.split(re.sub(r"\$\{(\w+)\}|\$(\w+)", value, command))


def guide_commands(prefix: str) -> list[list[str]]:
    commands = [expand(c, VALUES) for c in fenced_commands(GUIDE.read_text(), prefix)]
    assert len(commands) == 2, f"the guide should give node 0's and node 1's `{prefix}` command"
    return commands


# ------------------------------------------------------------------ two hosts


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


class TwoHosts:
    """Two network namespaces joined by a veth pair named `mcnet0` on both sides."""

    def __init__(self) -> None:
        tag = f"mc{os.getpid()}"  # unique per test process: parallel runs do not collide
        self.names = [f"{tag}-node0", f"{tag}-node1"]
        self.veth = [f"{tag}a", f"{tag}b"]  # at most 15 characters
        self.procs: list[subprocess.Popen] = []

    def create(self) -> None:
        a, b = self.veth
        for ns in self.names:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        for ns, end, addr in zip(self.names, self.veth, (VALUES["HOST0"], VALUES["HOST1"]), strict=True):
            sh("ip", "link", "set", end, "netns", ns)
            sh("ip", "-n", ns, "link", "set", end, "name", VALUES["IFNAME"])
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", VALUES["IFNAME"])
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", VALUES["IFNAME"], "up")
            # As in a pod or a VM, the host name resolves to the node's own address, where gloo listens
            # without net.socket_ifname (`ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts).
            self.etc(ns).mkdir(parents=True, exist_ok=True)
            (self.etc(ns) / "hosts").write_text(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")

    @staticmethod
    def etc(ns: str) -> Path:
        return Path("/etc/netns") / ns

    def start(self, node: int, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.names[node], *argv], cwd=ROOT, env=clean_env(env),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def destroy(self) -> None:
        # Every process inside the namespaces: launchers and their workers (which the agent
        # starts in sessions of their own, out of reach of the launcher's process group).
        for ns in self.names:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            proc.kill()
            proc.wait()
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(self.etc(ns), ignore_errors=True)
        for end in self.veth:  # left in the root namespace if setup failed half-way
            subprocess.run(["ip", "link", "del", end], capture_output=True)


@contextmanager
def network_hosts() -> Iterator[TwoHosts]:
    """Two hosts for a test, removed with every process in them afterwards; the test is skipped,
    with the reason, where network namespaces are not available."""
    if os.geteuid() != 0:
        pytest.skip("two hosts need network namespaces: run as root")
    hosts = TwoHosts()
    try:
        try:
            hosts.create()
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"ip netns / veth unavailable: {getattr(exc, 'stderr', None) or exc}")
        yield hosts
    finally:
        hosts.destroy()


@pytest.fixture
def two_hosts():
    with network_hosts() as hosts:
        yield hosts


@pytest.fixture(scope="module")
def one_host_reference(tmp_path_factory):
    """Final parameters of the same job as 2 processes on one host."""
    out = tmp_path_factory.mktemp("one-host")
    config = str(ROOT / "configs" / "demo.yaml")
    run_here("train", "--config", config, "--nproc-per-node", "2", *SMALL, f"out_dir={out}")
    return final_params(out)


def python_argv(argv: list[str]) -> list[str]:
    """Run `multicard ...` (the installed command) / `torchrun ...` (with this interpreter)."""
    if argv[0] == "multicard":
        return [MULTICARD, *argv[1:]]
    assert argv[0] == "torchrun"
    return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]


def cloud_environment(launcher: str, node: int) -> dict[str, str]:
    """What a cloud launcher sets for node `node`'s one `multicard train` (no launcher flags): a Kubeflow
    TrainJob's torch runtime (the PET_* variables torchrun reads for its flags), or a SkyPilot task."""
    if launcher == "trainjob":
        return {"PET_NNODES": "2", "PET_NPROC_PER_NODE": VALUES["GPUS"], "PET_NODE_RANK": str(node),
                "PET_MASTER_ADDR": VALUES["HOST0"], "PET_MASTER_PORT": "29400"}  # fmt: skip
    return {"SKYPILOT_NODE_IPS": f"{VALUES['HOST0']}\n{VALUES['HOST1']}", "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NODE_RANK": str(node), "SKYPILOT_NUM_GPUS_PER_NODE": "0"}  # fmt: skip  # a CPU-only node


def node_commands(launcher: str) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, environment) of node 0 and node 1: the guide's commands, or a cloud launcher's plain one."""
    if launcher in ("trainjob", "skypilot"):
        argv = ["multicard", "train", "--config", str(ROOT / "configs" / "demo.yaml")]
        return [(argv, cloud_environment(launcher, node)) for node in range(2)]
    return [(argv, {}) for argv in guide_commands(launcher)]


@pytest.mark.parametrize(
    "launcher", ["multicard train ", "torchrun ", "trainjob", "skypilot"],
    ids=["builtin", "torchrun", "trainjob", "skypilot"],
)  # fmt: skip
def test_two_hosts_over_a_network_match_one_host(two_hosts, one_host_reference, tmp_path, launcher):
    procs = [
        two_hosts.start(node, python_argv([*argv, *SMALL, f"out_dir={tmp_path}"]), env)
        for node, (argv, env) in enumerate(node_commands(launcher))
    ]  # fmt: skip
    outputs = [proc.communicate(timeout=180) for proc in procs]
    codes = [proc.returncode for proc in procs]
    assert codes == [0, 0], "\n".join(f"node {node} (exit {code}): {err}" for node, (code, (_, err)) in
                                        enumerate(zip(codes, outputs, strict=True)))  # fmt: skip
    assert "strategy=ddp world_size=2" in "".join(out for out, _ in outputs)
    assert_bitwise_equal(final_params(tmp_path), one_host_reference)


def test_guide_rehearsal_uses_the_test_values():
    assignment = " ".join(f"{k}={v}" for k, v in VALUES.items())
    assert fenced_commands(GUIDE.read_text(), assignment), f"docs/multinode.md should show `{assignment}`"


# ------------------------------------------------------------------ unreachable rendezvous


@pytest.mark.parametrize("node_rank", [1, 0], ids=["master-unreachable", "peer-missing"])
def test_unreachable_rendezvous_is_a_one_line_error_within_the_timeout(tmp_path, node_rank):
    from multicard.runtime.launch import free_port

    port = free_port()  # nobody listens there: connections are refused
    start = time.monotonic()
    result = cli(
        "train", "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-timeout", "2",
        *TINY, f"out_dir={tmp_path}", timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    expected = "cannot reach the rendezvous" if node_rank else "not all 2 nodes joined"
    assert f"multicard: error: {expected}" in result.stderr and f"127.0.0.1:{port}" in result.stderr
    assert elapsed < 30  # the 2 s timeout plus starting Python twice, not a hang


def test_unreachable_master_under_srun_is_a_one_line_error(tmp_path):
    from multicard.runtime.launch import free_port

    slurm = {
        "SLURM_JOB_ID": "77", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
        "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "localhost",
        "MASTER_PORT": str(free_port()),
    }  # fmt: skip
    result = cli("train", *TINY, "dist_timeout_s=2", f"out_dir={tmp_path}", timeout=60, env=slurm)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().startswith("multicard: error (rank 1): cannot reach the rendezvous at localhost:")
    assert result.stderr.count("\n") == 1
