"""Which checkpoint a run continues from: train.resume = auto | never | PATH.

Rank 0 picks the file and every rank reads that same file. `auto` takes the newest step
checkpoint in out_dir that loads, saying which damaged ones it passed over; `never` starts
afresh and clears the folder's old checkpoints (so they cannot mix with the new run's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from multicard import checkpoint
from multicard.errors import UserError
from multicard.strategy import Strategy


def clean_temporaries(folder: Path) -> None:
    """Remove temporary files a killed writer left behind (never a finished checkpoint)."""
    for tmp in folder.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def choose(cfg: DictConfig, folder: Path, strategy: Strategy, say: Any) -> Path | None:
    """The checkpoint to continue from, agreed by all ranks (None: start afresh)."""
    mode = cfg.train.resume
    chosen: str | None = None
    if strategy.ctx.is_main and folder.is_dir():
        clean_temporaries(folder)
        if mode == "never":
            old = checkpoint.step_files(folder) + [folder / n for n in ("last.pt", "best.pt") if (folder / n).exists()]
            for path in old:
                path.unlink()
            if old:
                say(f"train.resume=never: removed {len(old)} checkpoint file(s) of an earlier run in {folder}")
        elif mode == "auto":
            path, _, skipped = checkpoint.newest_valid(folder)
            for line in skipped:
                say(f"warning: skipping damaged {line.removeprefix('checkpoint ')}")
            chosen = str(path) if path is not None else None
    if mode not in ("auto", "never"):
        if not Path(mode).is_file():
            raise UserError(f"train.resume={mode} is neither auto, never nor an existing checkpoint file")
        chosen = mode  # an explicit path: every rank reads it, and a bad one fails on every rank
    chosen = strategy.broadcast_object(chosen)
    return Path(chosen) if chosen is not None else None


def load(path: Path, cfg: DictConfig, steps_per_epoch: int) -> dict[str, Any]:
    """Read a checkpoint to continue from and check that this run can continue it exactly."""
    state = checkpoint.load(path)
    if "resume" not in state:
        raise UserError(f"checkpoint {path} has no resume state (an older format); use train.resume=never")
    saved = state["config"]["train"]["global_batch_size"]
    if saved != cfg.train.global_batch_size:
        raise UserError(
            f"checkpoint {path} was trained with train.global_batch_size={saved}; resume with that value "
            f"(any world size works) or set train.resume=never"
        )
    if state["resume"]["steps_per_epoch"] != steps_per_epoch:
        raise UserError(
            f"checkpoint {path} had {state['resume']['steps_per_epoch']} steps per epoch, this dataset gives "
            f"{steps_per_epoch}; resume on the same training data or set train.resume=never"
        )
    return state
