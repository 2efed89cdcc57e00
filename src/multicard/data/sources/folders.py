"""Where images come from: in-memory arrays, lists of image files, or a dataset's items.

A source is `InMemory` (uint8 N×3×H×W already decoded: synthetic, CIFAR-10 batches), `Files`
(paths to decode: image folders) or `Items` (a map-style dataset of (image, label) items: a
dataset function's, data/sources/user.py, or a Hugging Face dataset's, data/sources/hf.py). Loaders accept
each; this module only finds, reads and splits them, and turns bad layouts into one-line errors.
"""

from __future__ import annotations

import os
import pickle
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from multicard.base.errors import UserError

CIFAR_DIR = "cifar-10-batches-py"
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST = "test_batch"


@dataclass
class InMemory:
    images: torch.Tensor  # uint8 (N, 3, H, W)
    labels: torch.Tensor  # int64 (N,)

    def __len__(self) -> int:
        return self.labels.numel()

    def subset(self, indices: torch.Tensor) -> InMemory:
        return InMemory(self.images[indices], self.labels[indices])


@dataclass
class Files:
    root: Path  # paths are relative to it (that keeps cache keys movable)
    paths: list[str]
    labels: torch.Tensor  # int64 (N,)
    sizes: torch.Tensor | None = None  # int64 (N,): each file's bytes when scanned (a run's data fingerprint)

    def __len__(self) -> int:
        return self.labels.numel()

    def subset(self, indices: torch.Tensor) -> Files:
        sizes = self.sizes[indices] if self.sizes is not None else None
        return Files(self.root, [self.paths[i] for i in indices.tolist()], self.labels[indices], sizes)


@dataclass
class Items:
    """Items of a map-style dataset, read only when a loader asks for one (data/sources/user.py read_item)."""

    dataset: Any  # len(dataset), and dataset[i] → (image, label)
    indices: torch.Tensor  # int64: the dataset's items this source holds, in order (all, or a split's share)
    num_classes: int  # labels must lie in 0..num_classes-1
    name: str  # what messages call it, e.g. "data.name=mydata:photos (train)"

    def __len__(self) -> int:
        return self.indices.numel()

    def subset(self, indices: torch.Tensor) -> Items:
        return Items(self.dataset, self.indices[indices], self.num_classes, self.name)


Source = InMemory | Files | Items


@dataclass
class Splits:
    train: Source
    val: Source
    classes: list[str]


def seeded_split(n: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, val indices), both sorted; a pure function of (n, fraction, seed)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, round(n * fraction))
    return perm[n_val:].sort().values, perm[:n_val].sort().values


# ---------------------------------------------------------------- image folders


def _hidden(name: str) -> bool:
    return name.startswith(".")  # .ipynb_checkpoints, .DS_Store, .git: never classes or images


def _class_images(directory: Path, class_dir: str) -> list[tuple[str, int]]:
    """(path relative to directory, bytes) of the image files under directory/class_dir (any
    depth, links followed), in a stable order.

    Anything that is not a regular file behind an image name (a FIFO, a socket, a link to
    nothing) is an error naming it: reading it would hang or fail mid-epoch. So is a link to a
    folder that holds it (`ln -s .. loop`): following it would loop, every image again under
    another path and other classes' images with this label.
    """
    from torchvision.datasets.folder import IMG_EXTENSIONS  # imported where used: see models.py

    found = []
    start = directory / class_dir
    # Each walked folder's real path, and the real folders that hold it: a link into one of them loops.
    walked = {str(start): (os.path.realpath(start), _real_holders(start) | _real_holders(directory))}
    for root, dirs, files in os.walk(start, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not _hidden(d))  # hidden folders: never images, never walked
        for d in dirs:
            walked[os.path.join(root, d)] = _entered(Path(root) / d, *walked[root])
        for name in sorted(files):
            if _hidden(name) or not name.lower().endswith(IMG_EXTENSIONS):
                continue
            path = Path(root) / name
            try:
                st = path.stat()
            except FileNotFoundError:
                raise UserError(f"{path} is a broken symbolic link; remove it or fix its target") from None
            if not stat.S_ISREG(st.st_mode):
                raise UserError(f"{path} is not a regular file (a FIFO, socket or device); remove it from the folder")
            found.append((root, name, str(path.relative_to(directory)), st.st_size))
    return [(relative, size) for _, _, relative, size in sorted(found)]  # by folder, then name


def _real_holders(folder: Path) -> set[str]:
    """The real path of `folder` and of every folder above it."""
    real = Path(os.path.realpath(folder))
    return {str(real), *map(str, real.parents)}


def _entered(folder: Path, parent_real: str, holders: set[str]) -> tuple[str, set[str]]:
    """(real path, real folders holding it) of `folder`, a subfolder of a walked one whose real
    path and holders are given; a link that leads back into a folder holding it is refused."""
    if not folder.is_symlink():
        return os.path.join(parent_real, folder.name), holders | {parent_real}
    real = os.path.realpath(folder)
    if real in holders or real == parent_real:
        raise UserError(
            f"{folder} is a symbolic link to {real}, a folder that holds it: following it would loop "
            f"(the images under it again, with this class's label); remove the link"
        )
    return real, holders | {parent_real} | _real_holders(Path(real)) - {real}


def scan_folder(directory: Path, what: str) -> tuple[Files, list[str]]:
    """All images under directory/<class>/..., classes sorted by name (hidden folders skipped)."""
    layout = f"expected {directory}/<class>/<image files>"
    if not directory.is_dir():
        raise UserError(f"{what} {directory} is not a directory; {layout}")
    classes = sorted(e.name for e in os.scandir(directory) if e.is_dir() and not _hidden(e.name))
    if not classes:
        raise UserError(f"{what} {directory}: Couldn't find any class folder in {directory}; {layout}")
    found: list[tuple[str, int]] = []
    labels: list[int] = []
    empty = []
    for label, name in enumerate(classes):
        images = _class_images(directory, name)
        empty += [] if images else [name]
        found += images
        labels += [label] * len(images)
    if not found:
        raise UserError(f"{what} {directory} holds no images; {layout}")
    if empty:
        raise UserError(f"{what} {directory}: class folder {empty[0]} holds no images; add some or remove it")
    sizes = torch.tensor([size for _, size in found], dtype=torch.int64)
    return Files(directory, [path for path, _ in found], torch.tensor(labels, dtype=torch.int64), sizes), classes


def image_folder(root: Path, val_fraction: float, split_seed: int) -> Splits:
    """root/train/<class>/... and root/val/<class>/... (or a seeded split of train)."""
    if not (root / "train").is_dir():
        raise UserError(
            f"data.root={root} has no train/ directory; expected {root}/train/<class>/<image files> "
            f"(and optionally {root}/val/<class>/...)"
        )
    train, classes = scan_folder(root / "train", "data.root")
    if len(classes) < 2:
        raise UserError(
            f"data.root={root}/train has {len(classes)} class folder ({classes[0]}); a classifier needs at least 2 "
            f"(one class folder per label under train/)"
        )
    if (root / "val").is_dir():
        val, val_classes = scan_folder(root / "val", "data.root")
        check_same_classes(classes, val_classes, root / "val")
        return Splits(train, val, classes)
    train_idx, val_idx = seeded_split(len(train), val_fraction, split_seed)
    return Splits(train.subset(train_idx), train.subset(val_idx), classes)


def check_same_classes(train: list[str], val: list[str], val_dir: Path) -> None:
    if train != val:
        missing = sorted(set(train) ^ set(val))[:3]
        raise UserError(
            f"{val_dir} has {len(val)} classes that differ from training's {len(train)} "
            f"(e.g. {', '.join(missing)}); give it the same class folders"
        )


# ---------------------------------------------------------------- CIFAR-10 batches


def _read_cifar_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    layout = f"expected {path.parent}/ with {', '.join(CIFAR_TRAIN)}, {CIFAR_TEST}, batches.meta"
    if not path.is_file():
        raise UserError(f"CIFAR-10 file {path} is missing; {layout} (or set data.download=true)")
    try:
        with path.open("rb") as f:
            entry = pickle.load(f, encoding="bytes")  # the format is Python pickles of numpy arrays
        data = np.asarray(entry[b"data"], dtype=np.uint8)
        labels = torch.tensor(entry[b"labels"], dtype=torch.int64)
        images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())
    except Exception as exc:
        raise UserError(f"CIFAR-10 file {path} is corrupt ({type(exc).__name__}); {layout}") from None
    if images.shape[0] != labels.numel() or labels.min() < 0 or labels.max() > 9:
        raise UserError(f"CIFAR-10 file {path} is corrupt (images and labels disagree); {layout}")
    return images, labels


def cifar10(root: Path, download: bool) -> Splits:
    """The python-pickle CIFAR-10 layout torchvision downloads: train = data_batch_1..5, val = test_batch."""
    base = root / CIFAR_DIR
    if download and not base.is_dir():
        _download_cifar10(root)
    parts = [_read_cifar_batch(base / name) for name in CIFAR_TRAIN]
    train = InMemory(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    val = InMemory(*_read_cifar_batch(base / CIFAR_TEST))
    meta = base / "batches.meta"
    classes = [str(i) for i in range(10)]
    if meta.is_file():
        try:
            with meta.open("rb") as f:
                classes = [n.decode() for n in pickle.load(f, encoding="bytes")[b"label_names"]]
        except Exception:
            raise UserError(f"CIFAR-10 file {meta} is corrupt; delete it or restore it") from None
    return Splits(train, val, classes)


def _download_cifar10(root: Path) -> None:
    from torchvision.datasets import CIFAR10  # only needed for the download

    try:
        CIFAR10(str(root), train=True, download=True)
    except Exception as exc:
        raise UserError(
            f"downloading CIFAR-10 into {root} failed ({str(exc).splitlines()[0]}); "
            f"check the network or place {CIFAR_DIR}/ there yourself"
        ) from None
