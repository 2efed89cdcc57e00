"""Slurm: the commands of examples/slurm/train.sbatch are valid for multicard and torchrun, and a
job warned by SIGUSR1 before its time limit checkpoints and its requeued run resumes exactly.

srun is emulated: two processes with the SLURM_* variables srun gives its tasks.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from conftest import TINY, assert_bitwise_equal, final_params, srun_task, wait_for
from multicard.base.config import load_config
from multicard.checkpoint import checkpoints_in, load_file
from multicard.cli.main import parse
from multicard.runtime.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
# What the batch script's variables hold on 2 nodes × 4 GPUs.
JOB = {"SLURM_NNODES": "2", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "multicard", "GPUS": "4", "CPUS": "8",
       "HEAD": "gpu01"}  # fmt: skip


def srun_commands() -> dict[str, list[str]]:
    """The program each `srun` line of the script starts, with its arguments: {program: argv}."""
    text = SBATCH.read_text().replace("\\\n", " ")
    found = {}
    for line in text.splitlines():
        if not line.strip().startswith("srun "):
            continue
        line = re.sub(r"\$\(\((\w+) \* (\w+)\)\)", lambda m: str(int(JOB[m[1]]) * int(JOB[m[2]])), line)
        line = re.sub(r"\$\{?(\w+)\}?", lambda m: JOB.get(m[1], m[0]), line)
        words = shlex.split(line)
        assert words[-2:] == ["$@", "&"], "srun runs in the background, passing the script's arguments on"
        words = words[1:-2]
        program = next(i for i, w in enumerate(words) if not w.startswith("-"))
        found[words[program]] = words[program + 1 :]
    return found


def multicard_argv(argv: list[str]) -> list[str]:
    """The arguments after `-m multicard`."""
    at = argv.index("-m")
    assert argv[at + 1] == "multicard"
    return argv[at + 2 :]


def check_multicard_args(args: list[str]) -> None:
    parsed = parse(args)
    assert parsed.command == "train" and parsed.nproc_per_node is None  # srun starts the workers
    load_config(str(ROOT / parsed.config), parsed.overrides)  # keys and values are valid


def test_batch_script_is_valid_bash_with_requeue_on_sigusr1():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    assert "#SBATCH --signal=B:USR1@" in text and "#SBATCH --requeue" in text
    assert re.search(r"^trap forward_usr1 USR1$", text, re.M) and 'scontrol requeue "$SLURM_JOB_ID"' in text


def test_srun_variant_runs_multicard_once_per_gpu():
    check_multicard_args(multicard_argv(srun_commands()["python"]))


def test_torchrun_variant_uses_c10d_and_passes_sigusr1_on():
    args = get_args_parser().parse_args(srun_commands()["torchrun"])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("2", "4", "c10d")
    assert args.rdzv_endpoint == "gpu01:29400" and args.rdzv_id == "4242"
    assert "SIGUSR1" in args.signals_to_handle.split(",")
    assert args.module and args.training_script == "multicard"
    check_multicard_args(args.training_script_args)


# ------------------------------------------------------------------ preemption

# 2 epochs of 64 steps, a checkpoint every 5: long enough to signal mid-run, seconds in all.
PREEMPT = [*TINY, "data.train_size=2048", "train.epochs=2", "checkpoint.every_steps=5", "data.val_size=64",
           "threads=1", "devices=cpu"]  # fmt: skip


def run_tasks(tasks: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    try:
        outputs = [task.communicate(timeout=180) for task in tasks]
    finally:
        for task in tasks:
            if task.poll() is None:
                os.killpg(task.pid, signal.SIGKILL)
                task.wait()
    return [(task.returncode, out, err) for task, (out, err) in zip(tasks, outputs, strict=True)]


@pytest.mark.distributed
def test_sigusr1_under_srun_checkpoints_and_the_requeued_run_resumes(tmp_path):
    args = ["-m", "multicard", *multicard_argv(srun_commands()["python"]), *PREEMPT, f"out_dir={tmp_path / 'job'}"]
    folder = tmp_path / "job" / "checkpoints"
    port = free_port()
    tasks = [srun_task(rank, port, args) for rank in (0, 1)]
    wait_for(lambda: bool(checkpoints_in(folder)) or tasks[0].poll() is not None, what="the first checkpoint")
    for task in tasks:  # as Slurm's warning reaches every task
        os.kill(task.pid, signal.SIGUSR1)
    (code0, _, err0), (code1, _, err1) = run_tasks(tasks)
    assert (code0, code1) == (138, 138), err0 + err1
    stopped = load_step(folder / "last.pt")
    assert f"multicard: stopped by SIGUSR1 at step {stopped}; checkpoint" in err0 and not err1.strip()
    assert 5 <= stopped < 128

    # The requeued job: the same command, a new store (its port may still be held for a while).
    port = free_port()
    (code0, out0, err0), (code1, _, err1) = run_tasks([srun_task(rank, port, args) for rank in (0, 1)])
    assert (code0, code1) == (0, 0), err0 + err1
    assert f"step {stopped} of 128" in out0

    port, uninterrupted = free_port(), [*args, f"out_dir={tmp_path / 'uninterrupted'}"]
    assert [code for code, _, _ in run_tasks([srun_task(rank, port, uninterrupted) for rank in (0, 1)])] == [0, 0]
    assert_bitwise_equal(final_params(tmp_path / "job"), final_params(tmp_path / "uninterrupted"))


def load_step(path: Path) -> int:
    return load_file(path)["step"]
