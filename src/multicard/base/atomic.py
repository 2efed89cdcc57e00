"""Files that appear whole or not at all: write a temporary file beside the target, flush it
to disk, rename it over the target. A crash at any moment leaves the old file or the new one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from multicard.base.errors import UserError

TEMP_SUFFIX = ".tmp"  # temporaries are hidden: .<name>.<random>.tmp


def probe_write(folder: Path) -> None:
    """Raise the OSError a new file in `folder` would meet (full, read-only, not permitted): a file
    is made and removed, as permission bits do not tell (root, read-only mounts)."""
    with tempfile.TemporaryFile(dir=folder):
        pass


def write_atomic(path: Path, write: Callable[[IO[bytes]], Any], advice: str | None = None) -> None:
    """Call write(f) on a temporary file, then rename it to `path`.

    A failed write (disk full, quota) removes its temporary file and says so in one line, ending
    with `advice` (default: a run's, whose out_dir holds its checkpoints).
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    except OSError as exc:
        raise UserError(f"cannot write {path} ({exc.strerror}); {advice or 'choose a writable out_dir'}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        reason = exc.strerror or str(exc).splitlines()[0]
        advice = advice or f"free space in {path.parent} or choose another out_dir (earlier checkpoints are intact)"
        raise UserError(f"cannot write {path} ({reason}); {advice}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save `obj` to `path` atomically."""
    write_atomic(path, lambda f: torch.save(obj, f))


def write_text_atomic(path: Path, text: str, advice: str | None = None) -> None:
    write_atomic(path, lambda f: f.write(text.encode("utf-8")), advice)


def link_atomic(target: Path, name: Path) -> None:
    """Point `name` at the same file as `target` (a hard link, so no copy), atomically."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name.name}.", suffix=TEMP_SUFFIX, dir=name.parent)
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


def symlink_atomic(target: str, name: Path) -> None:
    """Point the symbolic link `name` at `target` (relative to name's folder), atomically."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name.name}.", suffix=TEMP_SUFFIX, dir=name.parent)
    os.close(fd)
    os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, name)


def remove_temporaries(folder: Path) -> None:
    """Remove temporary files a killed writer left behind (never a finished file)."""
    for tmp in folder.glob(f".*{TEMP_SUFFIX}"):
        if tmp.is_file() or tmp.is_symlink():
            tmp.unlink(missing_ok=True)
