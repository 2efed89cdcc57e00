"""One way to assemble a run (assembly/parts.py), and its preflight made once, where it
belongs (assembly/preflight.py): by multicard's launcher before it starts workers, else by the
training process itself."""

from __future__ import annotations

import os

import pytest

import multicard.assembly.preflight as preflight
from conftest import TINY
from multicard.base.config import load_config
from multicard.cli import commands
from multicard.runtime.environment import ProcessEnv
from multicard.runtime.run_lock import LOCK_NAME

ONE_STEP = [*TINY, "train.max_steps=1", "data.val_size=32", "devices=cpu"]


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The out_dirs whose training-run checks (preflight.check_training_run) were made."""
    made: list[str] = []
    real = preflight.check_training_run
    monkeypatch.setattr(preflight, "check_training_run", lambda cfg: (made.append(cfg.out_dir), real(cfg)))
    return made


def test_a_worker_of_multicards_launcher_makes_no_check_of_its_own(tmp_path, checks):
    """The launcher made the checks and holds out_dir's lock: its workers repeat neither."""
    cfg = load_config(None, [*ONE_STEP, f"out_dir={tmp_path}", "strategy=single"])  # one worker, no group
    commands.train(cfg, ProcessEnv("torchrun", launcher_pid=os.getppid()))
    assert checks == []
    assert not (tmp_path / LOCK_NAME).exists()  # nor did the worker take the lock
    assert (tmp_path / "checkpoints").is_dir()  # it trained


def test_a_process_no_launcher_started_makes_the_checks_once(tmp_path, checks):
    cfg = load_config(None, [*ONE_STEP, f"out_dir={tmp_path}"])
    commands.train(cfg, ProcessEnv("none"))
    assert checks == [str(tmp_path)]
    assert (tmp_path / LOCK_NAME).exists()  # rank 0 held the lock (released: its holder's name cleared)
    assert (tmp_path / "checkpoints").is_dir()
