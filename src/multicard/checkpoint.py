"""Checkpoints: one complete, unwrapped unit, written atomically by one rank."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from multicard import __version__
from multicard.errors import UserError


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Write to a temporary file in the same folder, flush to disk, then rename over `path`.

    A crash at any moment leaves either the old file or the new one, never half of one; a
    failed write (disk full, quota) removes its temporary file and says so in one line.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise UserError(f"cannot write {path} ({exc.strerror}); choose a writable out_dir") from None
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        reason = exc.strerror or str(exc).splitlines()[0]
        raise UserError(
            f"cannot write {path} ({reason}); free space in {path.parent} or choose another out_dir "
            f"(earlier checkpoints are intact)"
        ) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def make_state(**parts: Any) -> dict[str, Any]:
    return {"multicard_version": __version__, **parts}


def load(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint onto the CPU, or fail in one line saying what is wrong."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"checkpoint not found: {path}")
    try:
        state = torch.load(file, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise UserError(
            f"checkpoint {path} cannot be read ({type(exc).__name__}); it may be truncated or not a checkpoint"
        ) from None
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise UserError(f"checkpoint {path} is not a multicard checkpoint (no model or config)")
    return state


def load_model_state(model: torch.nn.Module, state_dict: dict[str, Any], path: str | Path) -> None:
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise UserError(f"checkpoint {path} does not fit this model: {first}") from None


# ---------------------------------------------------------------- a run's checkpoint folder

STEP_PREFIX = "step-"


def step_path(folder: Path, step: int) -> Path:
    return folder / f"{STEP_PREFIX}{step:09d}.pt"


def step_files(folder: Path) -> list[Path]:
    """This run's step checkpoints, newest first."""
    files = [p for p in folder.glob(f"{STEP_PREFIX}*.pt") if p.stem[len(STEP_PREFIX) :].isdigit()]
    return sorted(files, key=lambda p: int(p.stem[len(STEP_PREFIX) :]), reverse=True)


def link_atomic(target: Path, name: Path) -> None:
    """Point `name` at the same file as `target` (a hard link, so no copy), atomically."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name.name}.", suffix=".tmp", dir=name.parent)
    os.close(fd)
    os.unlink(tmp)
    try:
        os.link(target, tmp)
    except OSError:  # file systems without hard links: copy
        with open(target, "rb") as src, open(tmp, "wb") as dst:
            dst.write(src.read())
            dst.flush()
            os.fsync(dst.fileno())
    os.replace(tmp, name)


def save_step(state: dict[str, Any], folder: Path, step: int, keep_last: int, best: bool) -> Path:
    """Write step-N.pt atomically, point last.pt (and best.pt) at it, drop all but the newest K."""
    path = step_path(folder, step)
    save_atomic(state, path)
    link_atomic(path, folder / "last.pt")
    if best:
        link_atomic(path, folder / "best.pt")
    for old in step_files(folder)[keep_last:]:
        old.unlink(missing_ok=True)
    return path


def newest_valid(folder: Path) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """The newest step checkpoint that loads, and one line per damaged newer one skipped."""
    skipped = []
    for path in step_files(folder):
        try:
            state = load(path)
        except UserError as exc:
            skipped.append(str(exc))
            continue
        if "resume" not in state:
            skipped.append(f"checkpoint {path} has no resume state")
            continue
        return path, state, skipped
    return None, None, skipped
