"""JPEG photos for the GPU check's decoding rows: the ImageNet sample where it is at hand, else
photo-like JPEGs written here (../shared does not travel to a GPU machine).

Generated photos are smooth colour fields with texture and edges, 500×375 like a typical
ImageNet photo, at quality 90: what nvjpeg and Pillow meet in practice, not noise (which no
camera writes and which decodes several times slower).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "data" / "imagenet-sample"


def photo_like(rng: np.random.Generator, width: int = 500, height: int = 375) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    fx, fy, phase = rng.uniform(0.005, 0.05, size=3)
    base = rng.uniform(40, 215, size=3)
    field = np.stack([b + 40 * np.sin(fx * x * (i + 1) + fy * y + phase * 9) for i, b in enumerate(base)], axis=-1)
    field += rng.normal(0, 12, size=field.shape)  # sensor-like texture
    box = rng.integers(0, [width // 2, height // 2, width // 2, height // 2])
    field[box[1] : box[1] + box[3], box[0] : box[0] + box[2]] *= 0.6  # an edge or two
    return Image.fromarray(field.clip(0, 255).astype(np.uint8))


def make_photos(folder: Path, classes: int = 4, per_class: int = 128, seed: int = 0) -> Path:
    """folder/class_k/k_i.jpg, written once (kept if already there)."""
    rng = np.random.default_rng(seed)
    for k in range(classes):
        class_dir = folder / f"class_{k}"
        class_dir.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            path = class_dir / f"{k}_{i}.jpg"
            if not path.exists():
                photo_like(rng).save(path, "JPEG", quality=90)
    return folder


def photos(root: Path | None, fallback: Path) -> tuple[Path, str]:
    """(class folders of JPEGs, where they come from): `root` or the sample if present, else generated."""
    for candidate in (root, SAMPLE):
        if candidate is not None and candidate.is_dir():
            return candidate, str(candidate)
    return make_photos(fallback), "generated in the run (no photos at hand)"


def linked_folder(photos: Path, tmp: Path) -> Path:
    """tmp/train and tmp/val: links to the photos' class folders (read in place)."""
    tmp.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        if not (tmp / split).exists():
            (tmp / split).symlink_to(photos.resolve(), target_is_directory=True)
    return tmp


def jpeg_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*/*") if p.suffix.lower() in (".jpg", ".jpeg"))
