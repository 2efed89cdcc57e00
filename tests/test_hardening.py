"""What a hostile new user broke, each case fixed: one line, a documented exit code, no
traceback, nothing lost. Numbers refer to the cases of the hardening issue."""

from __future__ import annotations

import ast
import errno
import os
import pickle
import re
import signal
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import (
    ROOT,
    RUNNING,
    TINY,
    alive,
    cli,
    descendants,
    load_checkpoint,
    run_here,
    start,
    wait_for,
    worker_pid,
)
from multicard.base.config import load_config
from multicard.base.errors import UserError
from multicard.checkpoint import checkpoints_in, load_file
from multicard.cli.main import main, parse
from multicard.data import read_splits


def one_line(err: str) -> str:
    """stderr holds exactly one line and no traceback; that line."""
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    return err.strip()


def image_folder(root: Path, classes: list[str], per_class: int = 8) -> Path:
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(np.full((8, 8, 3), 10 * c + i, dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


# ------------------------------------------------------------------ silently wrong


def test_1_rerun_with_other_settings_is_refused_and_run_length_may_grow(tmp_path, capsys):
    args = ["train", *TINY, "train.max_steps=4", f"out_dir={tmp_path}"]
    assert main(args) == 0
    config = (tmp_path / "config.yaml").read_text()
    capsys.readouterr()
    assert main([*args, "optim.lr=0.001", "sched.name=constant"]) == 2
    err = one_line(capsys.readouterr().err)
    assert "optim.lr: 0.1 → 0.001" in err and "sched.name: cosine → constant" in err
    assert "train.resume=never" in err and "model.weights=" in err  # the choices
    assert (tmp_path / "config.yaml").read_text() == config  # a refused run writes nothing
    assert main([*args, "optim.name=adamw"]) == 2  # case 8: was KeyError 'step', rc 1
    assert "optim.name: sgd → adamw" in one_line(capsys.readouterr().err)
    assert main(["train", *TINY, "train.max_steps=8", f"out_dir={tmp_path}"]) == 0  # more steps: no fuss
    assert "resumed from" in capsys.readouterr().out


@pytest.mark.distributed
def test_3_a_second_run_on_one_out_dir_is_refused_and_a_stale_lock_taken_over(tmp_path):
    first = start("train", *RUNNING, f"out_dir={tmp_path}")
    try:
        wait_for(lambda: bool(checkpoints_in(tmp_path / "checkpoints")), what="the first run's checkpoint")
        second = cli("train", *RUNNING, f"out_dir={tmp_path}")
        assert second.returncode == 2
        err = one_line(second.stderr)
        assert f"host {socket.gethostname()}, pid {first.pid}" in err and "is in use by another run" in err
    finally:
        first.kill()  # as the out-of-memory killer would: the lock file still names it
        first.wait()
    third = cli("train", *TINY, "train.max_steps=2", "train.resume=never", f"out_dir={tmp_path}")
    assert third.returncode == 0, third.stderr
    assert f"taking over from a run that ended without releasing it (host {socket.gethostname()}, pid {first.pid}" in (
        third.stdout
    )


# ------------------------------------------------------------------ left-behind processes and hangs


# ------------------------------------------------------------------ tracebacks where one line is promised


def test_9_disk_full_while_writing_metrics_keeps_the_checkpoints(tmp_path, capsys, monkeypatch):
    from multicard.observe import telemetry

    records = []

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            records.append(text)
            if len(records) > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

    real_open = telemetry.open if hasattr(telemetry, "open") else open
    monkeypatch.setattr(telemetry, "open", lambda *a, **kw: FullDisk(real_open(*a, **kw)), raising=False)
    assert main(["train", *TINY, "checkpoint.every_steps=4", f"out_dir={tmp_path}"]) == 2
    err = one_line(capsys.readouterr().err)
    assert "cannot write" in err and "metrics.jsonl (No space left on device)" in err
    assert load_file(tmp_path / "checkpoints" / "last.pt")["step"] >= 4


def test_9_config_yaml_that_cannot_be_written_is_one_line(tmp_path, capsys):
    (tmp_path / "config.yaml").mkdir()  # renaming over it fails, as a full disk would
    assert main(["train", *TINY, "train.max_steps=2", f"out_dir={tmp_path}"]) == 2
    assert "cannot write" in one_line(capsys.readouterr().err)


def test_11_metrics_jsonl_being_a_directory_is_one_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").mkdir()
    assert main(["train", *TINY, "train.max_steps=2", f"out_dir={tmp_path}"]) == 2
    assert "metrics.jsonl (Is a directory)" in one_line(capsys.readouterr().err)


# ------------------------------------------------------------------ security


# ------------------------------------------------------------------ misleading messages and small surprises


@pytest.mark.slow
def test_16_metrics_have_no_duplicate_steps_after_resuming_from_a_crash(tmp_path):
    proc = start("train", *RUNNING, "log_every=1", f"out_dir={tmp_path}")
    wait_for(lambda: len(checkpoints_in(tmp_path / "checkpoints")) >= 2, what="two checkpoints")
    proc.kill()  # a crash: metrics.jsonl has steps after the last checkpoint
    proc.wait()
    saved = load_file(checkpoints_in(tmp_path / "checkpoints")[0])["step"]
    run_here("train", *RUNNING, "log_every=1", f"train.max_steps={saved + 10}", f"out_dir={tmp_path}")
    metrics = (tmp_path / "metrics.jsonl").read_text()
    steps = [int(s) for s in re.findall(r'"kind": "step", "epoch": \d+, "step": (\d+)', metrics)]
    assert steps == list(range(1, saved + 11))


def test_16_a_file_where_the_checkpoint_folder_goes_fails_at_once(tmp_path, capsys):
    (tmp_path / "checkpoints").write_text("not a folder")
    assert main(["train", *TINY, f"out_dir={tmp_path}"]) == 2
    assert "is a file, not a folder for checkpoints" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "metrics.jsonl").exists()  # said before any training


@pytest.mark.slow
def test_17_a_run_says_early_how_long_it_will_take(tmp_path):
    output = run_here("train", *TINY, "train.epochs=2", f"out_dir={tmp_path}")
    assert re.search(r"estimated time: \d+ (s|min \d+ s) for the \d+ steps left", output), output
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["step"] == 64
