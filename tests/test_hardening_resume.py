"""Hardening round 2 (issue 27), checkpoints and resume: cases 2, 4, 6, 7, 8, 9 and 14 — one
line, a documented exit code, nothing lost — with real processes for the sharded (fsdp×2) cases."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY, copy_of, run_here
from multicard.cli.main import main


def one_line(err: str) -> str:
    """stderr holds exactly one line and no traceback; that line."""
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    return err.strip()


def run_ok(*args: str) -> str:
    """`multicard train ARGS` run by this process (conftest.run_here); its stdout and its workers'."""
    return run_here("train", *args)


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


# ------------------------------------------------------------------ tracebacks


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
