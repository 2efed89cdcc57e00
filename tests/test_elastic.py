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

from conftest import TINY, cli, final_params, load_checkpoint, max_rel_diff, run_here, slowed, wait_for
from multicard.base.errors import ExitCode
from multicard.checkpoint import checkpoints_in
from test_multinode import VALUES, TwoHosts, two_hosts  # noqa: F401 -- the hosts, and their fixture

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
# Three epochs of 8 steps in float64 (parity to 1e-10 whatever the world size; no BatchNorm, whose
# statistics are per process), a checkpoint every 2 steps, every step logged.
JOB = [*TINY, "threads=1", "devices=cpu", "precision=fp64", "model.kwargs={norm: none}", "data.train_size=256",
       "data.val_size=64", "train.epochs=3", "checkpoint.every_steps=2", "log_every=1"]  # fmt: skip
STEPS = 3 * 256 // 32
# Short rendezvous timings: a lost host is noticed 3 s after its last keep-alive, a round closes 1 s
# after its fewest nodes are in, and a job below its fewest nodes ends after 8 s.
RENDEZVOUS = ["--rdzv-timeout", "8", "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"]
PACED = {**slowed(200, rank=0), "MULTICARD_FAULT_ALONE_STEPS": "3"}  # see tests/faults/sitecustomize.py


def launcher(node: int, nodes: str, program: list[str]) -> list[str]:
    """`multicard ...` of host `node` in a job of `nodes` nodes (N or MIN:MAX) of one process each."""
    flags = ["--nnodes", nodes, "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr",
             VALUES["HOST0"], "--master-port", "29400", "--max-restarts", "3", *RENDEZVOUS]  # fmt: skip
    return [sys.executable, "-m", "multicard", program[0], *flags, *program[1:]]


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


def shrink_and_grow(hosts: TwoHosts, program: list[str], out: Path) -> tuple[str, str]:
    """Run `program` on both hosts as one elastic job (1:2 nodes); kill host 1 mid-epoch 2 (step > 10),
    let host 0 go on alone, start host 1 again; both must end with 0. Host 0's (stdout, stderr)."""
    first = [hosts.start(node, launcher(node, "1:2", program), PACED) for node in (1, 0)]
    wait_for(lambda: trained_past(out, 10, world_size=2), what="step 11 at world size 2")
    kill_host(hosts, 1)
    first[0].wait(timeout=30)
    wait_for(lambda: trained_past(out, records(out, "membership")[-1]["step"], world_size=1), 90, "a step alone")
    again = hosts.start(1, launcher(1, "1:2", program), PACED)
    out0, err0 = first[1].communicate(timeout=120)
    _, err1 = again.communicate(timeout=60)
    assert (first[1].returncode, again.returncode) == (0, 0), f"host 0: {err0}\nhost 1: {err1}"
    return out0, err0


def check_elastic_run(out: Path, console: str, steps: int) -> None:
    """Every step logged once; the job went 2 → 1 (host 1 left) → 2 (it joined), each said in one line."""
    assert [r["step"] for r in records(out, "step")] == list(range(1, steps + 1))
    starts = records(out, "membership")
    host1 = f"{socket.gethostname()}/{VALUES['HOST1']}"  # the hosts share a name: their address tells them apart
    left = [r for r in starts if r["left"]]
    joined = [r for r in starts if r["joined"] and r["previous_world_size"] == 1]
    assert left and left[0]["world_size"] == 1 and left[0]["left"] == [host1], starts
    assert joined and joined[-1]["world_size"] == 2 and joined[-1]["step"] > left[0]["step"], starts
    assert left[0]["redone"] is not None and 0 <= left[0]["redone"] < 2  # a checkpoint every 2 steps
    assert joined[-1]["redone"] == 0  # the agent stopped the lone worker with a checkpoint
    assert f"nodes changed: node {host1} left; world size 2 → 1; resumed from step {left[0]['step']}" in console
    assert f"nodes changed: node {host1} joined; world size 1 → 2" in console


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The job's final parameters as one uninterrupted process."""
    out = tmp_path_factory.mktemp("one-process")
    run_here("train", *JOB, f"out_dir={out}")
    return final_params(out)


def test_a_host_killed_mid_epoch_leaves_and_rejoins_and_the_job_ends_as_one_process(
    two_hosts, one_process, tmp_path
):  # fmt: skip
    console, _ = shrink_and_grow(two_hosts, ["train", *JOB, f"out_dir={tmp_path}"], tmp_path)
    check_elastic_run(tmp_path, console, STEPS)
    assert max_rel_diff(final_params(tmp_path), one_process) <= 1e-10
