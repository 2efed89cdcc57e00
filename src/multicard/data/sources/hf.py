"""Hugging Face datasets from a local path: `data.name=hf data.root=PATH` (`pip install 'multicard[hf]'`).

PATH holds a dataset written by `save_to_disk` (a Dataset or a DatasetDict), or parquet files (one
file, or a folder of them whose names say their split: train-*.parquet, validation-*.parquet...).
Nothing is fetched from a hub. The image column (data.hf_image) is read undecoded, so JPEGs keep
the loaders' reduced-scale decoding; the label column (data.hf_label) holds integers, its
ClassLabel feature gives the class names. Items then go through the same reading as a dataset
function's (data/sources/user.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from multicard.base.config import DataConfig
from multicard.base.errors import UserError
from multicard.data.sources.folders import Splits
from multicard.data.sources.user import user_splits

VAL_SPLITS = ("validation", "test")  # tried in this order when data.hf_val_split is not set
SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes (DatasetDict, Dataset)


def import_datasets() -> Any:
    # Local paths only: never ask a hub for anything (set before the import, which reads them).
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise UserError(
            "data.name=hf needs the Hugging Face datasets package, an optional extra: pip install 'multicard[hf]'"
        ) from None
    datasets.logging.disable_progress_bar()
    return datasets


def _parquet_files(root: Path) -> list[Path]:
    return [root] if root.suffix == ".parquet" and root.is_file() else sorted(root.rglob("*.parquet"))


def load(root: Path) -> dict[str, Any]:
    """{split name: datasets.Dataset} of the dataset at `root`."""
    datasets = import_datasets()
    layout = "expected a folder written by save_to_disk, or parquet files"
    if not root.exists():
        raise UserError(f"data.root={root} does not exist; {layout}")
    try:
        if root.is_dir() and any((root / marker).is_file() for marker in SAVED_MARKERS):
            loaded = datasets.load_from_disk(str(root))
        elif files := _parquet_files(root):
            if root.is_file() or len(files) == 1:
                loaded = datasets.load_dataset("parquet", data_files={"train": [str(f) for f in files]})
            else:  # the split of each file from its name, as on the hub
                loaded = datasets.load_dataset("parquet", data_dir=str(root))
        else:
            raise UserError(
                f"data.root={root} holds no Hugging Face dataset; expected a folder written by save_to_disk, "
                f"or parquet files"
            )
    except UserError:
        raise
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"data.root={root}: cannot read its Hugging Face dataset ({reason}); {layout}") from None
    return {"train": loaded} if isinstance(loaded, datasets.Dataset) else dict(loaded)


class HFItems:
    """A Hugging Face split as (image, label) items; images as their encoded bytes where stored so.
    `labels`: the label column, read once (checks and the ranks' fingerprint need no image)."""

    def __init__(self, dataset: Any, image: str, label: str, labels: np.ndarray, name: str) -> None:
        datasets = import_datasets()
        dataset = dataset.select_columns([image, label])
        if isinstance(dataset.features[image], datasets.Image):
            dataset = dataset.cast_column(image, datasets.Image(decode=False))  # {"bytes", "path"}: undecoded
        else:
            dataset = dataset.with_format("numpy")  # arrays of pixels
        self.dataset, self.image, self.label, self.labels, self.name = dataset, image, label, labels, name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        row = self.dataset[index]
        image = row[self.image]
        if isinstance(image, dict):  # an Image feature, undecoded: its bytes, or the file they live in
            image = image["bytes"] if image.get("bytes") is not None else self._file(index, image["path"])
        return image, row[self.label]

    def _file(self, index: int, path: str | None) -> bytes:
        """The bytes of the image file a row names (parquet files may hold paths, not bytes)."""
        try:
            return Path(path or "").read_bytes()
        except OSError as exc:
            raise UserError(
                f"{self.name} item {index} names image file {path}, which cannot be read "
                f"({exc.strerror or type(exc).__name__}); restore the file or store the images' bytes in the dataset"
            ) from None


def _check_columns(d: DataConfig, split: str, dataset: Any) -> None:
    for key, column in (("hf_image", d.hf_image), ("hf_label", d.hf_label)):
        if column not in dataset.column_names:
            raise UserError(
                f"data.{key}={column}: split {split} of data.root={d.root} has no column {column} (its columns: "
                f"{', '.join(dataset.column_names)}); set data.hf_image and data.hf_label to its image and label "
                f"columns"
            )


def label_column(d: DataConfig, split: str, dataset: Any) -> np.ndarray:
    """The split's labels as int64 (that column alone is read), or a one-line error unless they are
    integers: a ClassLabel feature or a plain integer Value."""
    datasets = import_datasets()
    feature = dataset.features[d.hf_label]
    plain = isinstance(feature, datasets.Value) and feature.dtype.startswith(("int", "uint"))
    if not (isinstance(feature, datasets.ClassLabel) or plain):
        raise UserError(
            f"data.hf_label={d.hf_label}: split {split} of data.root={d.root} holds {feature}, not integer labels; "
            f"encode it first (dataset.class_encode_column('{d.hf_label}')) or name another column"
        )
    column = dataset.select_columns([d.hf_label]).with_format("numpy")[:][d.hf_label]
    return np.asarray(column, dtype=np.int64)


def class_names(d: DataConfig, dataset: Any, plain_count: int) -> list[str]:
    """The label column's ClassLabel names; plain integers are named by their value, 0..plain_count-1."""
    feature = dataset.features[d.hf_label]
    if isinstance(feature, import_datasets().ClassLabel):
        return list(feature.names)
    return [str(i) for i in range(plain_count)]


def check_labels(d: DataConfig, split: str, labels: np.ndarray, classes: list[str]) -> None:
    """Every label names a class: said at start-up, not when a loader first reads the row."""
    if len(labels) and (labels.min() < 0 or labels.max() >= len(classes)):
        bad = labels.min() if labels.min() < 0 else labels.max()
        raise UserError(
            f"data.hf_label={d.hf_label}: split {split} of data.root={d.root} holds label {bad}, outside "
            f"0..{len(classes) - 1} ({len(classes)} classes); fix or drop those rows (a ClassLabel's -1 marks a "
            f"missing label)"
        )


def hf_splits(d: DataConfig) -> Splits:
    root = Path(d.files_root())
    splits = load(root)
    names = ", ".join(splits)
    if d.hf_train_split not in splits:
        raise UserError(f"data.hf_train_split={d.hf_train_split}: data.root={root} has no such split (it has {names})")
    if d.hf_val_split is not None and d.hf_val_split not in splits:
        raise UserError(f"data.hf_val_split={d.hf_val_split}: data.root={root} has no such split (it has {names})")
    val_name = d.hf_val_split or next((s for s in VAL_SPLITS if s in splits), None)
    used = [d.hf_train_split, *([val_name] if val_name is not None else [])]
    for split in used:
        _check_columns(d, split, splits[split])
    labels = {split: label_column(d, split, splits[split]) for split in used}
    plain_count = max((int(v.max()) + 1 for v in labels.values() if len(v)), default=0)  # plain labels: 0..the largest

    def items(split: str) -> tuple[HFItems, list[str]]:
        classes = class_names(d, splits[split], plain_count)
        check_labels(d, split, labels[split], classes)
        name = f"data.name=hf data.root={root} split {split}"
        return HFItems(splits[split], d.hf_image, d.hf_label, labels[split], name), classes

    train, classes = items(d.hf_train_split)
    val = items(val_name) if val_name is not None else None
    return user_splits(f"data.name=hf data.root={root}", train, classes, val, d.val_fraction, d.split_seed)
