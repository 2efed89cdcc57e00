"""The single-file checkpoint format: step-NNNNNNNNN.pt, written whole by rank 0.

For strategies whose every rank holds the whole model (single, dp, ddp). `last.pt` and
`best.pt` are hard links to step files (no copies), so best.pt outlives its rotated step file.
Files are read with torch's weights-only unpickler: a crafted file cannot run code.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from multicard.base.atomic import link_atomic, save_atomic
from multicard.base.errors import UserError
from multicard.runtime.process_group import ProcessContext

PREFIX = "step-"
SUFFIX = ".pt"


def load_weights_only(path: Path) -> Any:
    """torch.load with the weights-only unpickler, without torch's warning about the pickle protocol
    of a file it then refuses: the refusal is said in one line by whoever called."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"Detected pickle protocol \d+ in the checkpoint", UserWarning)
        return torch.load(path, map_location="cpu", weights_only=True)


def load_file(path: Path) -> dict[str, Any]:
    """A checkpoint file's contents on the CPU, or a one-line error saying what is wrong."""
    if path.is_dir():
        raise UserError(f"checkpoint {path} is a directory, not a checkpoint file")
    if not path.is_file():
        raise UserError(f"checkpoint not found: {path}")
    try:
        state = load_weights_only(path)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unpickling error"
        raise UserError(
            f"checkpoint {path} holds objects a checkpoint never holds and was not loaded ({first[:120]}); "
            f"use a checkpoint written by multicard"
        ) from None
    except Exception as exc:
        raise UserError(
            f"checkpoint {path} cannot be read ({type(exc).__name__}); it may be truncated or not a checkpoint"
        ) from None
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise UserError(f"checkpoint {path} is not a multicard checkpoint (no model or config)")
    return state


class SingleFile:
    name = "file"
    pointers = ("last.pt", "best.pt")
    needs_template = False  # reads whole tensors; nothing to load into
    whole_state = True  # rank 0 writes whole tensors (fsdp gathers them onto rank 0 for it)

    def path_for(self, folder: Path, step: int) -> Path:
        return folder / f"{PREFIX}{step:09d}{SUFFIX}"

    def owns(self, path: Path) -> bool:
        return path.suffix == SUFFIX and not path.is_dir()

    def steps(self, folder: Path) -> list[tuple[int, Path]]:
        """(step, path) of the step files in `folder`."""
        out = []
        for p in folder.glob(f"{PREFIX}*{SUFFIX}"):
            digits = p.name[len(PREFIX) : -len(SUFFIX)]
            if digits.isdigit() and p.is_file():
                out.append((int(digits), p))
        return out

    def write(
        self, path: Path, state: dict[str, Any], ctx: ProcessContext, background: Any = None
    ) -> Callable[[], None]:
        """Rank 0 writes (every rank holds the same model); the file is complete on return."""
        if ctx.is_main:
            save_atomic(state, path)
        return lambda: None

    def read(self, path: Path, template: dict[str, Any] | None = None) -> dict[str, Any]:
        return load_file(path)

    def read_meta(self, path: Path) -> dict[str, Any]:
        return load_file(path)

    def point(self, folder: Path, name: str, path: Path) -> None:
        """Make `<name>.pt` (last, best) refer to `path`."""
        link_atomic(path, folder / f"{name}{SUFFIX}")

    def pinned(self, folder: Path) -> set[Path]:
        """Step checkpoints rotation must keep: none (best.pt is its own hard link)."""
        return set()

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)
