"""Reading image files, decoding them to uint8 tensors, and the on-disk cache of a decoded dataset.

The cache key covers every file's relative path, size and modification time, its label and
the decoded size, so a second run skips decoding and any change to the dataset re-reads it.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from multicard.base.atomic import save_atomic
from multicard.base.errors import UserError
from multicard.data.sources.encoded import EncodedImage
from multicard.data.sources.folders import Files, InMemory

CACHE_FORMAT = 2  # bump when the stored layout or the decoding changes (2: 16-bit greyscale scaled)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "multicard"


def read_image(path: Path) -> EncodedImage:
    """The file read and its header parsed, or a one-line error naming it.

    Pixels are decoded later by whoever knows what they need: `.tensor()` in full, or
    `.decode(reduce)` at reduced JPEG scale (the large-image transforms).
    """
    return EncodedImage.read(path)


def resize_ops() -> Any:
    """torchvision's functional transforms, imported on first use: torchvision's import takes about
    a second (see models.torchvision_models), which runs that never resize should not pay."""
    from torchvision.transforms.v2 import functional

    return functional


def fit_square(image: torch.Tensor, size: int) -> torch.Tensor:
    """Resize the shorter side to `size`, then centre-crop to size × size (a no-op when it fits)."""
    if image.shape[-2:] == (size, size):
        return image
    TF = resize_ops()
    image = TF.resize(image, [size], antialias=True)
    return TF.center_crop(image, [size, size])


def decode_files(files: Files, size: int) -> InMemory:
    """Decode every file to size × size (about 5,000 CIFAR-size JPEGs per second per core)."""
    images = torch.empty(len(files), 3, size, size, dtype=torch.uint8)
    for i, path in enumerate(files.paths):
        images[i] = fit_square(read_image(files.root / path).tensor(), size)
    return InMemory(images, files.labels.clone())


def cache_key(files: Files, size: int) -> str:
    h = hashlib.sha256(f"multicard-decoded {CACHE_FORMAT} {size} {len(files)}\n".encode())
    for path, label in zip(files.paths, files.labels.tolist(), strict=True):
        try:
            st = os.stat(files.root / path)
        except OSError:
            raise UserError(f"image {files.root / path} disappeared while reading the dataset; rerun") from None
        h.update(f"{path}\t{label}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def cache_path(files: Files, size: int, cache_dir: Path, role: str) -> Path:
    # One stem per (directory, role, size), so a changed dataset replaces its old entry.
    where = hashlib.sha256(str(files.root.resolve()).encode()).hexdigest()[:12]
    return cache_dir / f"{files.root.name}-{where}-{role}-{size}px-{cache_key(files, size)}.pt"


def _load_cached(path: Path, n: int) -> InMemory | None:
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True)
        images, labels = stored["images"], stored["labels"]
    except FileNotFoundError:
        return None
    except Exception:
        warnings.warn(f"ignoring unreadable decoded-image cache {path}; decoding again", stacklevel=2)
        return None
    return InMemory(images, labels) if labels.numel() == n else None


def decoded(files: Files, size: int, cache_dir: Path | None, write: bool, role: str) -> InMemory:
    """The decoded images of `files`, from the cache when it holds them.

    Only a process with `write` set stores a missing entry (one per machine, so ranks do not
    decode the same files at once); the others decode in memory if they still find none.
    """
    path = cache_path(files, size, cache_dir, role) if cache_dir is not None else None
    if path is not None and (hit := _load_cached(path, len(files))) is not None:
        return hit
    data = decode_files(files, size)
    if path is not None and write:
        try:
            save_atomic({"images": data.images, "labels": data.labels}, path)
            for stale in path.parent.glob(path.name.rsplit("-", 1)[0] + "-*.pt"):
                if stale != path:
                    stale.unlink(missing_ok=True)
        except (OSError, UserError) as exc:
            warnings.warn(f"decoded-image cache not written: {exc}", stacklevel=2)
    return data
