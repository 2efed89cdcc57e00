"""A run's out_dir: one run at a time (its lock; a lock left by a killed run is taken over), a refused
run leaves no lock behind, what cannot be written there (config.yaml, metrics.jsonl, tensorboard/, a
file where checkpoints/ goes) is one line before or without losing a checkpoint, and metrics.jsonl
holds each step once after a resume."""

from __future__ import annotations

import errno
import re
import socket

import pytest

from conftest import RUNNING, TINY, cli, one_line, run_here, start, unwritable, wait_for
from multicard.checkpoint import checkpoints_in, load_file
from multicard.cli.main import main


@pytest.mark.distributed
def test_a_second_run_on_one_out_dir_is_refused_and_a_stale_lock_taken_over(tmp_path):
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


@pytest.mark.distributed
def test_a_run_its_workers_refuse_leaves_no_lock(tmp_path):
    """Refused by the workers (weights that do not load), after the launcher took the lock."""
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli("train", "--nproc-per-node", "2", *TINY, f"model.weights={garbage}", f"out_dir={empty}")
    assert result.returncode == 2, result.stderr
    assert list(empty.iterdir()) == []


def test_a_file_where_the_checkpoint_folder_goes_fails_at_once(tmp_path, capsys):
    (tmp_path / "checkpoints").write_text("not a folder")
    assert main(["train", *TINY, f"out_dir={tmp_path}"]) == 2
    assert "is a file, not a folder for checkpoints" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "metrics.jsonl").exists()  # said before any training


def test_config_yaml_that_cannot_be_written_is_one_line(tmp_path, capsys):
    (tmp_path / "config.yaml").mkdir()  # renaming over it fails, as a full disk would
    assert main(["train", *TINY, "train.max_steps=2", f"out_dir={tmp_path}"]) == 2
    assert "cannot write" in one_line(capsys.readouterr().err)


def test_metrics_jsonl_being_a_directory_is_one_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").mkdir()
    assert main(["train", *TINY, "train.max_steps=2", f"out_dir={tmp_path}"]) == 2
    assert "metrics.jsonl (Is a directory)" in one_line(capsys.readouterr().err)


def test_disk_full_while_writing_metrics_keeps_the_checkpoints(tmp_path, capsys, monkeypatch):
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


@pytest.mark.distributed
def test_tensorboard_folder_that_is_a_file_or_unwritable_is_one_line_before_training(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.mkdir()
    (blocked / "tensorboard").write_text("in the way")
    assert main(["train", *TINY, "log.tensorboard=true", f"out_dir={blocked}"]) == 2  # one process
    assert "tensorboard is a file, not a folder for TensorBoard's event files" in one_line(capsys.readouterr().err)
    locked = tmp_path / "locked"
    (locked / "tensorboard").mkdir(parents=True)
    with unwritable(locked / "tensorboard"):
        for out in (blocked, locked):  # ddp×2: said by the launcher before any worker starts
            result = cli("train", *TINY, "log.tensorboard=true", f"out_dir={out}", "--nproc-per-node", "2", timeout=120)
            assert result.returncode == 2, result.stderr
            line = one_line(result.stderr)
            assert "multicard: error: " in line and "rank" not in line
        assert "log.tensorboard=true cannot write" in line and "set log.tensorboard=false" in line
    for out in (blocked, locked):
        assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


@pytest.mark.slow
def test_metrics_have_no_duplicate_steps_after_resuming_from_a_crash(tmp_path):
    proc = start("train", *RUNNING, "log_every=1", f"out_dir={tmp_path}")
    wait_for(lambda: len(checkpoints_in(tmp_path / "checkpoints")) >= 2, what="two checkpoints")
    proc.kill()  # a crash: metrics.jsonl has steps after the last checkpoint
    proc.wait()
    saved = load_file(checkpoints_in(tmp_path / "checkpoints")[0])["step"]
    run_here("train", *RUNNING, "log_every=1", f"train.max_steps={saved + 10}", f"out_dir={tmp_path}")
    metrics = (tmp_path / "metrics.jsonl").read_text()
    steps = [int(s) for s in re.findall(r'"kind": "step", "epoch": \d+, "step": (\d+)', metrics)]
    assert steps == list(range(1, saved + 11))
