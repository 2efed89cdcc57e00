"""Hardening round 2 (issue 27), checkpoints and resume: cases 2, 4, 6, 7, 8, 9 and 14 — one
line, a documented exit code, nothing lost — with real processes for the sharded (fsdp×2) cases."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import TINY, cli, final_params, max_rel_diff, run_here
from multicard.checkpoint import read_checkpoint
from multicard.cli.main import main

# float64 and no BatchNorm: one process and two give the same parameters (within 1e-10).
EXACT = [*TINY, "precision=fp64", "model.kwargs={norm: none}", "sched.name=constant", "checkpoint.every_steps=2"]
FSDP2 = ["--nproc-per-node", "2", "--oversubscribe", "strategy=fsdp"]
ZERO1 = [
    "--nproc-per-node", "2", "--oversubscribe", "strategy=ddp", "ddp.shard_optimizer=true", "checkpoint.format=file",
]  # fmt: skip


def one_line(err: str) -> str:
    """stderr holds exactly one line and no traceback; that line."""
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    return err.strip()


def run_ok(*args: str) -> str:
    """`multicard train ARGS` run by this process (conftest.run_here); its stdout and its workers'."""
    return run_here("train", *args)


def copy_of(run: Path, tmp_path: Path) -> Path:
    """A copy of a run's out_dir (its `last`/`best` links kept as links) for a test to change."""
    return Path(shutil.copytree(run, tmp_path / "out", symlinks=True))


def step_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:09d}"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """The out_dir of an fsdp×2 run of 6 steps: sharded checkpoints at steps 2, 4 and 6."""
    out = tmp_path_factory.mktemp("sharded")
    run_ok(*FSDP2, *EXACT, "train.max_steps=6", f"out_dir={out}")
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The out_dir of a one-process run of 2 steps (step-000000002.pt)."""
    out = tmp_path_factory.mktemp("single")
    assert main(["train", *TINY, "train.max_steps=2", f"out_dir={out}"]) == 0
    return out


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ silently wrong


def test_27_2_weights_into_an_out_dir_with_checkpoints_are_refused(single, tmp_path, capsys):
    out = copy_of(single, tmp_path)
    weights = single / "checkpoints" / "last.pt"
    before = contents(out)
    capsys.readouterr()
    assert main(["train", *TINY, "train.max_steps=4", f"model.weights={weights}", f"out_dir={out}"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"model.weights={weights} would be ignored: this run continues checkpoint" in err
    assert "use another out_dir or set train.resume=never" in err and "drop model.weights" in err
    assert contents(out) == before  # nothing written
    # The rule: a fine-tuning run, interrupted or extended, continues with its own weights.
    tuned = tmp_path / "tuned"
    assert main(["train", *TINY, "train.max_steps=2", f"model.weights={weights}", f"out_dir={tuned}"]) == 0
    assert main(["train", *TINY, "train.max_steps=4", f"model.weights={weights}", f"out_dir={tuned}"]) == 0
    assert f"resumed from {tuned / 'checkpoints' / 'step-000000002.pt'}" in capsys.readouterr().out


def test_27_4_a_longer_run_says_its_schedule_is_re_stretched(single, tmp_path, capsys):
    out = copy_of(single, tmp_path)
    capsys.readouterr()
    assert main(["train", *TINY, "train.max_steps=4", f"out_dir={out}"]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: the run length changed from 2 to 4 steps (train.max_steps=4): the cosine LR schedule is "
        "re-stretched over the new length from step 2"
    ]
    assert main(["train", *TINY, "train.max_steps=4", "sched.name=cosine", f"out_dir={out}"]) == 0  # same length
    assert "re-stretched" not in capsys.readouterr().out


# ------------------------------------------------------------------ data lost


@pytest.mark.distributed
def test_27_6_a_damaged_newest_sharded_checkpoint_is_skipped_once_and_named(sharded, tmp_path, capsys):
    out = copy_of(sharded, tmp_path)
    missing = step_dir(out, 6) / "__1_0.distcp"
    missing.unlink()
    output = run_ok(*FSDP2, *EXACT, "train.max_steps=8", f"out_dir={out}")
    skipped = [line for line in output.splitlines() if "skipping damaged" in line]
    assert len(skipped) == 1 and f"({missing} is missing)" in skipped[0], output  # once, not per rank
    assert f"resumed from {step_dir(out, 4)}:" in output
    damaged = copy_of(sharded, tmp_path / "truncated")
    shard = step_dir(damaged, 6) / "__0_0.distcp"
    os.truncate(shard, 100)
    for command in (["export", "--out", str(tmp_path / "m.pt")], ["eval"]):
        assert main([command[0], "--checkpoint", str(damaged / "checkpoints" / "last"), *command[1:]]) == 2
        err = one_line(capsys.readouterr().err)
        assert f"cannot be read ({shard} has 100 of its" in err and "it is damaged" in err
    assert not (tmp_path / "m.pt").exists()


@pytest.mark.distributed
@pytest.mark.parametrize("async_save", ["false", "true"])
def test_27_7_disk_full_during_a_sharded_save_removes_the_partial_write(tmp_path, async_save):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("needs to mount a small tmpfs (root)")
    try:
        out = disk / "out"
        # fp32 smallcnn: a checkpoint takes ~0.9 MB; the first fits, the second fills the disk.
        args = [*FSDP2, *TINY, "train.max_steps=6", "checkpoint.every_steps=2", f"checkpoint.async_save={async_save}"]
        result = cli("train", *args, f"out_dir={out}")
        assert result.returncode == 2, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("multicard: error")]
        assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr  # once, not per rank
        folder = out / "checkpoints"
        step = folder / "step-000000004"
        assert f"cannot write {step} (No space left on device); free space in {folder}" in errors[0]
        assert not list(folder.glob(".*"))  # the unfinished step directory is gone
        assert shutil.disk_usage(disk).free > 400_000  # and its bytes with it
        assert read_checkpoint(folder / "last")["step"] == 2  # the earlier checkpoint, intact
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.slow
def test_27_8_a_step_directory_without_its_marker_is_named_and_refused(sharded, tmp_path, capsys):
    out = copy_of(sharded, tmp_path)
    unmarked = step_dir(out, 6)
    (unmarked / "COMPLETE").unlink()
    for command in (["export", "--out", str(tmp_path / "m.pt")], ["eval"]):
        assert main([command[0], "--checkpoint", str(unmarked), *command[1:]]) == 2
        assert f"checkpoint {unmarked} is incomplete" in one_line(capsys.readouterr().err)
    assert main(["train", *EXACT, "train.max_steps=8", f"out_dir={out}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("warning:")] == [
        f"warning: skipping {unmarked}: it has no COMPLETE marker (a run ended while writing it, or it was copied "
        f"in part)"
    ]
    assert any(line.startswith(f"resumed from {step_dir(out, 4)}:") for line in lines)


# ------------------------------------------------------------------ tracebacks


@pytest.mark.distributed
def test_27_9_fsdp_and_zero1_resume_each_others_checkpoints_exactly(sharded, tmp_path):
    """fsdp×2 to step 6 (shards), ZeRO-1 to 8 (a file), fsdp×2 to 10: one process's parameters."""
    out = copy_of(sharded, tmp_path)
    assert f"resumed from {step_dir(out, 6)}:" in run_ok(*ZERO1, *EXACT, "train.max_steps=8", f"out_dir={out}")
    back = run_ok(*FSDP2, *EXACT, "train.max_steps=10", f"out_dir={out}")
    assert f"resumed from {out / 'checkpoints' / 'step-000000008.pt'}:" in back
    alone = tmp_path / "alone"
    assert main(["train", *EXACT, "train.max_steps=10", f"out_dir={alone}"]) == 0
    assert max_rel_diff(final_params(out), final_params(alone)) < 1e-10


# ------------------------------------------------------------------ messages


def test_27_14_resume_from_a_checkpoints_folder_takes_its_newest(single, tmp_path, capsys):
    folder = single / "checkpoints"
    assert main(["train", *TINY, "train.max_steps=4", f"train.resume={folder}", f"out_dir={tmp_path / 'o'}"]) == 0
    assert f"resumed from {folder / 'step-000000002.pt'}:" in capsys.readouterr().out
    assert main(["eval", "--checkpoint", str(folder)]) == 2
    suggested = f"e.g. {folder / 'last'} or {folder / 'step-000000002.pt'}"  # `last`: the newest, in any format
    assert f"{folder} is a folder of checkpoints; give one of them, {suggested}" in one_line(capsys.readouterr().err)
    assert main(["export", "--checkpoint", str(folder), "--out", str(tmp_path / "model.pt")]) == 2
    assert suggested in one_line(capsys.readouterr().err)
    assert main(["export", "--checkpoint", str(folder / "last"), "--out", str(tmp_path / "model.pt")]) == 0
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    (unreadable / "step-000000002.pt").write_bytes(b"truncated")
    assert main(["train", *TINY, f"train.resume={unreadable}", f"out_dir={tmp_path / 'p'}"]) == 2
    assert f"train.resume={unreadable}: no checkpoint in that folder reads" in one_line(capsys.readouterr().err)


def test_27_14_a_refused_resume_leaves_out_dir_as_it_found_it(single, tmp_path, capsys):
    last = single / "checkpoints" / "last.pt"
    fresh, empty = tmp_path / "fresh", tmp_path / "empty"
    empty.mkdir()
    # Another model: named as the changed setting, not as tensors that do not fit.
    assert main(["train", *TINY, "model.name=resnet18_cifar", f"train.resume={last}", f"out_dir={fresh}"]) == 2
    err = one_line(capsys.readouterr().err)
    assert "was trained with other settings (model.name: smallcnn → resnet18_cifar)" in err and "tensor" not in err
    assert not fresh.exists()
    # A finished checkpoint past this run's length: refused, not "nothing to train".
    assert main(["train", *TINY, "train.max_steps=1", f"train.resume={last}", f"out_dir={empty}"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"checkpoint {last} is at step 2, already past train.max_steps=1 (1 steps); to continue it, raise" in err
    assert list(empty.iterdir()) == []  # no lock, no checkpoints/, no config.yaml or metrics.jsonl
