"""Fault tolerance with real processes and real signals: exact resume, elastic restarts,
graceful stop, checkpoint rotation and damaged checkpoints."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from conftest import (
    TINY,
    assert_bitwise_equal,
    cli,
    descendants,
    final_params,
    load_checkpoint,
    parents,
    run_here,
    slowed,
    start,
    wait_for,
    worker_pid,
)
from multicard.base.config import load_config, to_dict
from multicard.checkpoint import Checkpointer, RunFacts, checkpoints_in, load_file
from multicard.cli.main import main
from multicard.recipes import ImageClassifier
from multicard.runtime.environment import ProcessEnv

pytestmark = pytest.mark.distributed

# Two epochs of 16 steps under a constant LR (so a run cut by train.max_steps follows the same
# schedule as an uninterrupted one), checkpoints every 5 steps.
EXACT = [*TINY, "data.train_size=512", "train.epochs=2", "sched.name=constant", "checkpoint.every_steps=5",
         "data.val_size=64"]  # fmt: skip
# A job a test acts on while it runs is EXACT with every step of one rank made 150 ms longer by
# SLOW (about 5 s in all, mostly asleep); the uninterrupted and resumed runs it is compared with
# run at full speed, and share their reference run with the mid-epoch tests.
SLOW = slowed(150)
SLOW_SINGLE = slowed(150, rank=0)  # the one process of a run without a launcher
STEPS = 2 * 512 // 32
DDP2 = ("--nproc-per-node", "2")


def run_ok(*args: str) -> str:
    """`multicard train ARGS` run by this process (conftest.run_here); its stdout and its workers'."""
    return run_here("train", *args)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The out_dir of an uninterrupted run with the given arguments (each run once per module)."""
    cache: dict[tuple[str, ...], Path] = {}

    def get(*args: str) -> Path:
        if args not in cache:
            out = tmp_path_factory.mktemp("reference")
            run_ok(*args, f"out_dir={out}")
            cache[args] = out
        return cache[args]

    return get


# ------------------------------------------------------------------ exact resume


@pytest.mark.parametrize("loader", ["device", "workers"])
@pytest.mark.parametrize("launch", [(), ("--nproc-per-node", "2")], ids=["single", "ddp2"])
def test_mid_epoch_resume_is_bitwise_exact(reference, tmp_path, launch, loader):
    args = (*launch, *EXACT, f"data.loader={loader}", "data.num_workers=1")
    run_ok(*args, "train.max_steps=21", f"out_dir={tmp_path}")  # stops inside the second epoch
    cut = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert cut["step"] == 21 and cut["resume"]["position"]["step_in_epoch"] == 5
    result = run_ok(*args, f"out_dir={tmp_path}")
    assert "resumed from" in result and "step 21 of 32" in result
    # Either loader gives the uninterrupted run (the same samples, augmented alike): one reference.
    assert_bitwise_equal(final_params(tmp_path), final_params(reference(*launch, *EXACT)))


def test_resume_across_world_sizes_continues_the_epoch(tmp_path):
    """A ddp×2 checkpoint continues under one process at the same global batch (and back)."""
    exact = ["precision=fp64", "model.kwargs={norm: none}"]
    single = tmp_path / "single"
    run_ok(*EXACT, *exact, f"out_dir={single}")
    mixed = tmp_path / "mixed"
    run_ok("--nproc-per-node", "2", *EXACT, *exact, "train.max_steps=11", f"out_dir={mixed}")
    run_ok(*EXACT, *exact, "train.max_steps=21", f"out_dir={mixed}")
    result = run_ok("--nproc-per-node", "2", *EXACT, *exact, f"out_dir={mixed}")
    assert "step 21 of 32" in result
    a, b = final_params(mixed), final_params(single)
    assert max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b) < 1e-10


def test_finished_run_is_not_trained_again(reference, tmp_path):
    out = reference(*EXACT)
    result = run_ok(*EXACT, f"out_dir={out}")
    assert "nothing to train" in result


def test_changed_global_batch_is_refused_on_resume(tmp_path, capsys):
    run_ok(*EXACT, "train.max_steps=7", f"out_dir={tmp_path}")
    capsys.readouterr()
    assert main(["train", *EXACT, "train.global_batch_size=64", f"out_dir={tmp_path}"]) == 2
    assert "train.global_batch_size=32" in capsys.readouterr().err


def test_resume_of_a_missing_file_is_one_line(tmp_path):
    result = cli("train", *EXACT, "train.resume=autoo", f"out_dir={tmp_path}")
    assert result.returncode == 2
    message = "train.resume=autoo is neither auto, never nor an existing checkpoint file"
    assert result.stderr.strip() == f"multicard: error: {message}"


def test_resume_never_starts_afresh(tmp_path):
    run_ok(*EXACT, "train.max_steps=7", f"out_dir={tmp_path}")
    result = run_ok(*EXACT, "train.max_steps=3", "train.resume=never", f"out_dir={tmp_path}")
    assert "removed" in result
    assert [p.name for p in checkpoints_in(tmp_path / "checkpoints")] == ["step-000000003.pt"]


# ------------------------------------------------------------------ checkpoints on disk


def test_rotation_keeps_last_k_and_best(tmp_path):
    cfg = load_config(None, [*TINY, "checkpoint.keep_last=2", f"out_dir={tmp_path / 'run'}"])
    folder = tmp_path / "checkpoints"
    with ImageClassifier(cfg, env=ProcessEnv("none"), records=False, checkpoints=False) as recipe:
        loop, strategy = recipe.run.training.loop, recipe.run.parts.strategy  # the run's, not yet begun
        facts = RunFacts(to_dict(cfg), recipe.data.classes, recipe.batches.steps_per_epoch, 1, recipe.data.fingerprint)
        checkpointer = Checkpointer(folder, strategy, cfg.checkpoint, facts)
        for step, best in [(5, True), (10, False), (15, True), (20, False), (25, False)]:
            recipe.run.position.global_step = step
            checkpointer.save(loop, best=best)
    assert [p.name for p in checkpoints_in(folder)] == ["step-000000025.pt", "step-000000020.pt"]
    assert load_file(folder / "last.pt")["step"] == 25
    assert load_file(folder / "best.pt")["step"] == 15  # outlives its rotated step file
    assert not list(folder.glob(".*"))  # no temporaries


def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    run_ok(*EXACT, "train.max_steps=12", f"out_dir={tmp_path}")
    folder = tmp_path / "checkpoints"
    newest = checkpoints_in(folder)[0]
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as by a crash without atomic writes
    result = run_ok(*EXACT, f"out_dir={tmp_path}")
    assert "skipping damaged" in result and newest.name in result
    assert "step 10 of 32" in result


# ------------------------------------------------------------------ signals and restarts


@pytest.mark.parametrize(
    "sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGUSR1, 138), (signal.SIGHUP, 129)]
)
def test_signal_to_launcher_checkpoints_and_the_next_run_resumes(reference, tmp_path, sig, code):
    args = ("--nproc-per-node", "2", *EXACT, "data.loader=workers", "data.num_workers=1")
    proc = start("train", *args, f"out_dir={tmp_path}", env=SLOW)
    folder = tmp_path / "checkpoints"
    wait_for(lambda: bool(checkpoints_in(folder)), what="the first checkpoint")
    wait_for(lambda: len(descendants(proc.pid)) >= 4, what="2 workers, each with a loader process")
    children = descendants(proc.pid)
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "stopped by" in err and "run the same command to resume" in err
    stopped = load_checkpoint(folder / "last.pt")
    assert 5 < stopped["step"] < STEPS  # written at the stop, mid-run
    assert not children & set(parents())  # no worker or data-loader process left behind
    if sig in (signal.SIGINT, signal.SIGUSR1):
        return  # their stop is SIGTERM's; resuming from it is checked for SIGTERM and SIGHUP
    result = run_ok(*args, f"out_dir={tmp_path}")
    assert f"step {stopped['step']} of {STEPS}" in result
    assert_bitwise_equal(final_params(tmp_path), final_params(reference(*DDP2, *EXACT)))  # either loader gives it


def test_killed_worker_is_restarted_and_the_run_matches_an_uninterrupted_one(reference, tmp_path):
    args = ("--nproc-per-node", "2", *EXACT, "data.loader=device", "data.num_workers=1")
    proc = start("train", "--max-restarts", "1", *args, f"out_dir={tmp_path}", env=SLOW)
    folder = tmp_path / "checkpoints"
    wait_for(lambda: len(checkpoints_in(folder)) >= 2, what="two checkpoints")
    victim = worker_pid(proc.pid, rank=1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "after restart 1" in out
    assert_bitwise_equal(final_params(tmp_path), final_params(reference(*DDP2, *EXACT)))  # either loader gives it


def test_sigquit_quits_at_once_with_stacks_and_keeps_the_last_checkpoint(tmp_path):
    """SIGQUIT (Ctrl-\\) means "quit now and show me where": stacks on stderr, exit 131, no new
    checkpoint; the last one written stays and the same command resumes from it."""
    proc = start("train", *EXACT, f"out_dir={tmp_path}", env=SLOW_SINGLE)
    folder = tmp_path / "checkpoints"
    wait_for(lambda: bool(checkpoints_in(folder)), what="the first checkpoint")
    os.kill(proc.pid, signal.SIGQUIT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 131, err
    assert "quit by SIGQUIT without a checkpoint" in err and "most recent call first" in err  # the stacks
    steps = [load_file(p)["step"] for p in checkpoints_in(folder)]
    assert steps and all(step % 5 == 0 for step in steps)  # only the cadence's checkpoints, none at the quit
    end = max(steps) + 5
    result = run_ok(*EXACT, f"train.max_steps={end}", f"out_dir={tmp_path}")
    assert f"step {max(steps)} of {end}" in result
