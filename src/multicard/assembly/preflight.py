"""Cheap checks made before anything starts: the out_dir can be written, the optional packages the
config asks for are installed, and, for a run of a config (`check_training_run`, the one list of
its checks), fsdp.units and the resume settings hold.

`preflight` makes them once per run, where they belong: multicard's launcher makes them before it
starts any worker of `multicard train` (and holds out_dir's lock on node 0), and its workers make
none (their plan says so: plan.py `checked`); every other run makes them as it starts (the parts
of a Run: parts.py), before its process group: one process, torchrun, srun, and a script's
workers under `multicard run`, whose launcher knows nothing of its config; there rank 0 holds the
lock."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from multicard.base.config import Config, LogConfig, check_local_path, to_dict
from multicard.base.errors import UserError
from multicard.base.store import LocalStore, open_store
from multicard.base.store_lock import StoreLock
from multicard.checkpoint import check_resume_settings
from multicard.observe.telemetry import check_tensorboard_folder, tensorboard_writer
from multicard.runtime.run_lock import RunLock


def prepare_out_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"out_dir={path} cannot be created ({exc.strerror}); choose a writable out_dir") from None
    if not os.access(out, os.W_OK):
        raise UserError(f"out_dir={path} is not writable; choose a writable out_dir")
    return out


def check_output_folder(path: str, flag: str) -> None:
    """The folder a command writes its results into (plan --out, bench --out, verify --keep) can
    be: checked before any work, so a file in its place or a folder that cannot be written is one
    line now, not a traceback after minutes of measuring. Nothing is created here."""
    check_local_path(path, flag)
    LocalStore(path).check_writable(flag)


# The one line for a tracker asked for whose package is missing (the module is the config key)
MISSING = {
    "mlflow": "log.mlflow=true needs mlflow: pip install 'multicard[mlflow]' (or set log.mlflow=false)",
    "wandb": "log.wandb=true needs wandb: pip install 'multicard[wandb]' (or set log.wandb=false)",
}


def check_trackers(log: LogConfig) -> None:
    """The trackers the config asks for are installed: one line naming the extra if not. Only
    looked up (importing them takes seconds; rank 0 does it when it starts them, observe/tracking.py)."""
    for key, message in MISSING.items():
        if getattr(log, key) and importlib.util.find_spec(key) is None:
            raise UserError(message)


def check_extras(cfg: Config) -> None:
    """Optional packages the config asks for are installed (one line naming the extra if not), and
    the folder TensorBoard writes to can be written."""
    if cfg.log.tensorboard:
        tensorboard_writer()
        check_tensorboard_folder(Path(cfg.out_dir) / "tensorboard")
    check_trackers(cfg.log)


def check_training_run(cfg: Config) -> None:
    """Every cheap check of a training run, made once before it starts: by multicard's launcher
    before it starts workers, else by the training process: fsdp.units against the model (built on
    the meta device), the optional packages, and the resume settings against the checkpoint
    train.resume would continue."""
    if cfg.strategy == "fsdp":
        from multicard.strategy.fsdp_units import check_units  # the strategies' package loads torch's sharding stack

        check_units(cfg.model, list(cfg.fsdp.units), cfg.data.num_classes)
    check_extras(cfg)
    check_resume_settings(Path(cfg.out_dir) / "checkpoints", cfg.train.resume, to_dict(cfg))


def check_run(cfg: Config, script: str | None) -> None:
    """The checks of a run of `cfg` (a script's: those of the config it has; its model and data are
    its own, its length known only when its loop begins)."""
    if script is None:
        check_training_run(cfg)
    else:
        check_extras(cfg)


def claim_out_dir(path: str, hold: bool, say: Callable[[str], None], checkpoint_dir: str | None = None) -> RunLock:
    """out_dir, made and checked writable, with its lock, and checkpoint.dir's lock where it is given
    (a folder or a URL other runs may also name): held when `hold` (the run's holder). A run refused
    here leaves out_dir as it found it."""
    fresh = not Path(path).exists()
    lock = RunLock(prepare_out_dir(path), made_out_dir=fresh)
    if hold:
        try:
            lock.acquire(say)
            if checkpoint_dir:
                lock.hold_also(StoreLock(open_store(checkpoint_dir, "checkpoint.dir"), "checkpoint.dir"), say)
        except UserError:
            lock.refused()
            lock.release()
            raise
    return lock


def preflight(cfg: Config, hold_lock: bool, say: Callable[[str], None] = print, script: str | None = None) -> RunLock:
    """A run's checks (`check_run`), then out_dir claimed (`claim_out_dir`): its lock, held for as long
    as the run lasts (release it, or use it as a context manager). See the module docstring for who
    calls it; a run refused after it (bad input) calls `lock.refused()` to leave out_dir as it found it."""
    check_run(cfg, script)
    return claim_out_dir(cfg.out_dir, hold_lock, say, cfg.checkpoint.dir)
