"""Cheap checks made before anything starts, by a launcher as by a training process: the out_dir
can be written, and the optional packages the config asks for are installed."""

from __future__ import annotations

import os
from pathlib import Path

from multicard.config import Config
from multicard.errors import UserError
from multicard.telemetry import tensorboard_writer


def prepare_out_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"out_dir={path} cannot be created ({exc.strerror}); choose a writable out_dir") from None
    if not os.access(out, os.W_OK):
        raise UserError(f"out_dir={path} is not writable; choose a writable out_dir")
    return out


def check_extras(cfg: Config) -> None:
    """Optional packages the config asks for are installed (one line naming the extra if not)."""
    if cfg.log.tensorboard:
        tensorboard_writer()
