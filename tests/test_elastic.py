"""Elastic jobs for real: two hosts (tests/test_multinode.py's network namespaces) run one job through
torchrun's agent with `--nnodes MIN:MAX`; a host is killed mid-epoch (SIGKILL to its launcher and
workers) and the other goes on alone, then the host comes back and the job grows again, and the
job ends with the parameters of an uninterrupted one-process run. Below MIN nodes, or without the
host of its rendezvous, a job ends in one line with its checkpoints intact, and resumes.

The runs are tiny and paced: rank 0's steps are slowed (tests/faults) so that a test can act
mid-epoch, and at world size 1 the job waits for the returning host before it could end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY, final_params, load_checkpoint, max_rel_diff, run_here, slowed, start, wait_for
from multicard.base.errors import ExitCode
from multicard.checkpoint import checkpoints_in
from multicard.cli.main import main
from test_multinode import VALUES, TwoHosts, network_hosts

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
# Three epochs of 8 steps in float64 (parity to 1e-10 whatever the world size; no BatchNorm, whose
# statistics are per process), a checkpoint every 2 steps, every step logged.
JOB = [*TINY, "threads=1", "devices=cpu", "precision=fp64", "model.kwargs={norm: none}", "data.train_size=256",
       "data.val_size=64", "train.epochs=3", "checkpoint.every_steps=2", "log_every=1"]  # fmt: skip
STEPS = 3 * 256 // 32
# Short rendezvous timings: a lost host is noticed 3 s after its last keep-alive, a round closes 1 s
# after its fewest nodes are in, and a job below its fewest nodes ends after 8 s.
TIMINGS = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
RENDEZVOUS = ["--rdzv-timeout", "8", "--rdzv-conf", TIMINGS]
PACED = {**slowed(100, rank=0), "MULTICARD_FAULT_ALONE_STEPS": "3"}  # see tests/faults/sitecustomize.py


Command = tuple[list[str], dict[str, str]]  # argv and environment of a host's one command


def launcher(node: int, nodes: str, program: list[str], env: dict[str, str] = PACED) -> Command:
    """`multicard ...` of host `node` in a job of `nodes` nodes (N or MIN:MAX) of one process each,
    with its environment (rank 0's steps paced)."""
    flags = ["--nnodes", nodes, "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr",
             VALUES["HOST0"], "--master-port", "29400", "--max-restarts", "3", *RENDEZVOUS]  # fmt: skip
    return [sys.executable, "-m", "multicard", program[0], *flags, *program[1:]], env


def pytorchjob(node: int, nodes: str, program: list[str]) -> Command:
    """The same from the variables an elastic Kubeflow PyTorchJob gives each node's one command: no
    node rank, a rendezvous endpoint (torch's agent finds the node it names), MIN:MAX nodes."""
    variables = {"PET_NNODES": nodes, "PET_NPROC_PER_NODE": "1", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ID": "job",
                 "PET_RDZV_ENDPOINT": f"{VALUES['HOST0']}:29400", "PET_MAX_RESTARTS": "3",
                 "PET_RDZV_CONF": TIMINGS}  # fmt: skip
    return [sys.executable, "-m", "multicard", *program], {**PACED, **variables}


def torchrun(node: int, nodes: str, program: list[str]) -> Command:
    """The same under plain torchrun (`multicard run SCRIPT ARGS` as `torchrun ... SCRIPT ARGS`), with what
    docs/fault-tolerance.md says to export for elastic jobs."""
    flags = ["--nnodes", nodes, "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"{VALUES['HOST0']}:29400", "--rdzv-id", "job", "--local-addr", VALUES[f"HOST{node}"],
             "--rdzv-conf", f"is_host={int(node == 0)},{TIMINGS}"]  # fmt: skip
    what = program[1:] if program[0] == "run" else ["-m", "multicard", *program]
    environment = {**PACED, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return [sys.executable, "-m", "torch.distributed.run", *flags, *what], environment


def records(out: Path, kind: str) -> list[dict]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def kill_host(hosts: TwoHosts, node: int) -> None:
    """SIGKILL to every process of host `node`: its launcher (and torch's agent in it) and workers."""
    listed = subprocess.run(["ip", "netns", "pids", hosts.names[node]], capture_output=True, text=True)
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def trained_past(out: Path, step: int, world_size: int) -> bool:
    """The job, at `world_size` processes since its last start, has logged a step past `step`."""
    starts = records(out, "membership")
    return bool(starts) and starts[-1]["world_size"] == world_size and records(out, "step")[-1]["step"] > step


def until(condition, hosts: dict[int, subprocess.Popen], timeout: float, what: str) -> None:
    """wait_for `condition` while every host's command runs; a host that ends first, or the timeout,
    fails the test with what each host said."""
    try:
        wait_for(lambda: condition() or any(host.poll() is not None for host in hosts.values()), timeout, what)
        if condition():
            return
        problem = "a host ended early"
    except AssertionError:
        problem = f"{timeout:.0f} s passed"
    for host in hosts.values():
        host.kill()
    said = [f"host {node} (exit {host.wait()}):\n" + "".join(host.communicate()) for node, host in hosts.items()]
    raise AssertionError("\n".join([f"{problem} waiting for {what}", *said]))


def shrink_and_grow(hosts: TwoHosts, program: list[str], out: Path, how=launcher) -> tuple[str, str]:
    """Run `program` on both hosts as one elastic job (1:2 nodes, started by `how`); kill host 1 mid-epoch
    2 (past step 10), let host 0 go on alone, start host 1 again; both must end with 0. Host 0's
    (stdout, stderr)."""
    first = {node: hosts.start(node, *how(node, "1:2", program)) for node in (1, 0)}
    until(lambda: trained_past(out, 10, world_size=2), first, 120, "step 11 at world size 2")
    kill_host(hosts, 1)
    first[1].wait(timeout=30)
    until(lambda: trained_past(out, records(out, "membership")[-1]["step"], world_size=1), {0: first[0]}, 90,
          "a step alone")  # fmt: skip
    again = hosts.start(1, *how(1, "1:2", program))
    out0, err0 = first[0].communicate(timeout=120)
    _, err1 = again.communicate(timeout=60)
    assert (first[0].returncode, again.returncode) == (0, 0), f"host 0: {err0}\nhost 1: {err1}"
    return out0, err0


def check_elastic_run(out: Path, console: tuple[str, str], steps: int, own_launcher: bool = True) -> None:
    """Every step logged once; the job went 2 → 1 (host 1 left) → 2 (it joined), each said in one line;
    under multicard's launcher host 0's stop for the join says that the job goes on (torchrun's agent
    does not say which stops are its own). `console`: host 0's (stdout, stderr)."""
    assert [r["step"] for r in records(out, "step")] == list(range(1, steps + 1))
    starts = records(out, "membership")
    host1 = f"{socket.gethostname()}/{VALUES['HOST1']}"  # the hosts share a name: their address tells them apart
    left = [r for r in starts if r["left"]]
    joined = [r for r in starts if r["joined"] and r["previous_world_size"] == 1]
    assert left and left[0]["world_size"] == 1 and left[0]["left"] == [host1], starts
    assert joined and joined[-1]["world_size"] == 2 and joined[-1]["step"] > left[0]["step"], starts
    assert left[0]["redone"] is not None and 0 <= left[0]["redone"] < 2  # a checkpoint every 2 steps
    assert joined[-1]["redone"] == 0  # the agent stopped the lone worker with a checkpoint
    said, errors = console
    assert f"nodes changed: node {host1} left; world size 2 → 1; resumed from step {left[0]['step']}" in said
    assert f"nodes changed: node {host1} joined; world size 1 → 2" in said
    if own_launcher:
        assert f"stopped at step {joined[-1]['step']} with a checkpoint: the agent restarts the workers" in errors
        assert "run the same command" not in errors


@pytest.mark.parametrize(
    "flags, overrides, fragment",
    [
        (["--nnodes", "1:3"], [], "train.global_batch_size=32 does not split over every world size --nnodes 1:3 "
         "allows (1, 2, 3 processes) × train.grad_accum=1; use a multiple of 6 such as 30 or 36"),
        (["--nnodes", "2:4", "--nproc-per-node", "2"], ["train.global_batch_size=36"],
         "(4, 6, 8 processes) × train.grad_accum=1; use a multiple of 24 such as 24 or 48"),
        (["--nnodes", "3:2"], [], "--nnodes '3:2': need 1 <= MIN <= MAX nodes"),
        (["--nnodes", "1:2", "--max-restarts", "2"], ["train.resume=never"], "train.resume=never would start the job"),
        (["--nnodes", "1:2", "--rdzv-conf", "join_timeout=5"], [], "--rdzv-conf 'join_timeout=5': it takes"),
    ],
    ids=["batch", "batch-per-node", "range", "resume-never", "rdzv-conf"],
)  # fmt: skip
def test_an_elastic_job_that_cannot_run_at_every_size_is_refused_in_one_line(flags, overrides, fragment, tmp_path,
                                                                            capsys):  # fmt: skip
    command = ["train", "--nproc-per-node", "1", *flags, "--master-addr", "127.0.0.1", "--master-port", "29400"]
    assert main([*command, *TINY, *overrides, f"out_dir={tmp_path / 'run'}"]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()  # refused before anything was made


@pytest.fixture
def two_hosts():
    with network_hosts() as hosts:
        yield hosts


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The job's final parameters as one uninterrupted process."""
    out = tmp_path_factory.mktemp("one-process")
    run_here("train", *JOB, f"out_dir={out}")
    return final_params(out)


def test_a_host_killed_mid_epoch_leaves_and_rejoins_and_the_job_ends_as_one_process(
    two_hosts, one_process, tmp_path
):  # fmt: skip
    """`multicard train` as an elastic PyTorchJob runs it (its variables, no flags), with checkpoints
    written in the background and a copy on each node."""
    program = ["train", *JOB, "checkpoint.async_save=true", "checkpoint.local_copy=true", f"out_dir={tmp_path}"]
    console = shrink_and_grow(two_hosts, program, tmp_path, pytorchjob)
    check_elastic_run(tmp_path, console, STEPS)
    assert max_rel_diff(final_params(tmp_path), one_process) <= 1e-10


def test_a_restart_resumes_from_each_nodes_own_copy_when_the_durable_one_was_not_written(one_process, tmp_path):
    """Rank 0 is killed while the checkpoint of step 12 is written in the background (tests/faults): the
    checkpoint folder's newest is step 10, each node's own copy is step 12; the agent restarts the workers
    and they resume from their copies, with nothing redone, and end as one process would."""
    env = {**slowed(0, rank=0), "MULTICARD_FAULT_KILL_SAVE": "12"}
    program = ["--nproc-per-node", "2", "--max-restarts", "1", *JOB, "checkpoint.async_save=true",
               "checkpoint.local_copy=true", f"out_dir={tmp_path}"]  # fmt: skip
    out = run_here("train", *program, env=env)
    assert f"resuming from each node's own copy of step 12: the newest in {tmp_path / 'checkpoints'} is " in out
    assert "step-000000010.pt (its write had not finished)" in out
    restart = records(tmp_path, "membership")[-1]
    assert (restart["step"], restart["redone"], restart["restart"]) == (12, 0, 1)
    assert [r["step"] for r in records(tmp_path, "step")] == list(range(1, STEPS + 1))
    assert max_rel_diff(final_params(tmp_path), one_process) <= 1e-10


def newest_checkpoint_step(out: Path) -> int:
    """The step of the newest checkpoint in out_dir, read whole (it must load)."""
    return load_checkpoint(checkpoints_in(out / "checkpoints")[0])["step"]


def ends_in_one_line(proc: subprocess.Popen, within: float) -> tuple[int, str, float]:
    """(exit code, multicard's one line, seconds) of a launcher that must end on its own in time."""
    began = time.monotonic()
    _, err = proc.communicate(timeout=within)
    lines = [line for line in err.splitlines() if line.startswith("multicard")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return proc.returncode, lines[0], time.monotonic() - began


def test_below_min_nodes_the_job_waits_then_ends_in_one_line_and_resumes_exactly(two_hosts, one_process, tmp_path):
    program = ["train", *JOB, f"out_dir={tmp_path}"]
    hosts = [two_hosts.start(node, *launcher(node, "2:2", program)) for node in (1, 0)]
    wait_for(lambda: trained_past(tmp_path, 2, world_size=2), what="step 3")
    kill_host(two_hosts, 1)
    saved = newest_checkpoint_step(tmp_path)
    code, line, waited = ends_in_one_line(hosts[1], within=60)
    assert code == ExitCode.NODES_LOST and waited >= 8  # --rdzv-timeout 8: it waited for host 1 that long
    assert line.startswith("multicard: error: the job lost node(s) and fewer than 2 (--nnodes 2) were back")
    assert "last checkpoint is intact" in line
    assert newest_checkpoint_step(tmp_path) >= saved  # the newest still loads
    again = [two_hosts.start(node, *launcher(node, "2:2", program, env={})) for node in (1, 0)]
    for host in again:
        _, err = host.communicate(timeout=120)
        assert host.returncode == 0, err
    assert [r["step"] for r in records(tmp_path, "step")] == list(range(1, STEPS + 1))
    assert max_rel_diff(final_params(tmp_path), one_process) <= 1e-10


def test_losing_the_host_of_the_rendezvous_ends_the_job_in_one_line_with_its_checkpoints(two_hosts, tmp_path):
    """torch's c10d rendezvous lives in node 0's agent: without it the others cannot re-form. They end
    at once, saying so; the same command on every node resumes from the newest checkpoint."""
    program = ["train", *JOB, f"out_dir={tmp_path}"]
    hosts = [two_hosts.start(node, *launcher(node, "1:2", program)) for node in (1, 0)]
    wait_for(lambda: trained_past(tmp_path, 2, world_size=2), what="step 3")
    kill_host(two_hosts, 0)
    code, line, _ = ends_in_one_line(hosts[0], within=60)
    assert code == ExitCode.NODES_LOST
    assert line.startswith(f"multicard: error: lost the rendezvous at {VALUES['HOST0']}:29400: node 0, which hosts it")
    assert newest_checkpoint_step(tmp_path) >= 2

# A user's own loop that no test of multicard names: a small GRU language model on a synthetic stream
# of tokens, 6 steps an epoch, 4 epochs, in float64 with a checkpoint every 2 steps.
SPELLER = """
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
import multicard

VOCABULARY, CONTEXT, WINDOWS = 11, 12, 96
stream = torch.randint(0, VOCABULARY, (CONTEXT * WINDOWS + 1,), generator=torch.Generator().manual_seed(5))


class Windows(torch.utils.data.Dataset):
    def __len__(self):
        return WINDOWS

    def __getitem__(self, i):
        piece = stream[i * CONTEXT : (i + 1) * CONTEXT + 1]
        return piece[:-1], piece[1:]


class Speller(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.rnn = nn.Embedding(VOCABULARY, 16), nn.GRU(16, 24, batch_first=True)
        self.head = nn.Linear(24, VOCABULARY)

    def forward(self, tokens):
        return self.head(self.rnn(self.embed(tokens))[0])


run = multicard.Run(sys.argv[1], global_batch_size=16, precision="fp64", devices="cpu", checkpoint_every=2,
                    log_every=1, options={"threads": 1})
model = Speller()
model, optimizer = run.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
train = run.loader(Windows())
for epoch in run.epochs(4):
    for tokens, following in train:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), following.flatten())
        run.backward(loss)
        run.step(optimizer)
        run.log(loss=loss)
"""


def test_a_user_loop_shrinks_and_grows_under_plain_torchrun_and_ends_as_one_process(two_hosts, tmp_path):
    script = tmp_path / "speller.py"
    script.write_text(SPELLER)
    alone = start("run", str(script), str(tmp_path / "one"))  # the uninterrupted run, meanwhile
    console = shrink_and_grow(two_hosts, ["run", str(script), str(tmp_path / "two")], tmp_path / "two", torchrun)
    assert alone.wait(timeout=60) == 0, alone.communicate()[1]
    check_elastic_run(tmp_path / "two", console, 4 * 96 // 16, own_launcher=False)
    assert max_rel_diff(final_params(tmp_path / "two"), final_params(tmp_path / "one")) <= 1e-10
