"""Your own data: `data.name=package.module:function`, like `model.name`.

The function is called once per split, `function(split, **data.kwargs)` with split "train" or
"val", and returns a map-style dataset (`len(d)`, `d[i]`) whose items are (image, label) and
the class names, as either
- a pair `(dataset, classes)`, or
- a dataset with a `classes` attribute (torchvision's datasets have one).
For "val" it may return None: a seeded data.val_fraction of training is then held out, as for
an image folder without val/.

An image is encoded bytes (JPEG, PNG, WebP...: decoded by the loaders, JPEGs at reduced scale
where a crop allows), a PIL image, or a uint8 array or tensor, HWC or CHW (CHW when the first
axis has 1 or 3 entries and the last does not), greyscale or RGB. A label is an integer in
0..len(classes)-1. Items are read by the loaders, one index at a time, so every guarantee of
image folders holds: randomness keyed by (seed, epoch, index), any world size, exact resume.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from multicard.base.errors import UserError
from multicard.data.augmentation.transforms import Picture
from multicard.data.decoding.decode import fit_square
from multicard.data.sources.encoded import PIL_ERRORS, EncodedImage, to_rgb
from multicard.data.sources.folders import InMemory, Items, Splits, seeded_split
from multicard.runtime.user_code import check_arguments, import_function, noted, user_code

SPLITS = ("train", "val")
ITEM_FORMS = "an (image, label) pair, the image as encoded bytes, a PIL image or a uint8 array/tensor (HWC or CHW)"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _call(spec: str, function: Callable[..., Any], split: str, kwargs: dict[str, Any]) -> tuple[Any, list[str]] | None:
    """(dataset, class names) for one split, or None (no such split). What the function raises
    is its own, with its traceback (a note names the split and data.kwargs)."""
    check_arguments(function, f"data.name={spec} cannot take data.kwargs={kwargs}", split, **kwargs)
    with user_code(f"data.name={spec} for split {split} (data.kwargs={kwargs})"):
        result = function(split, **kwargs)
    if result is None:
        return None
    if isinstance(result, tuple) and len(result) == 2 and _is_names(result[1]):
        dataset, classes = result
    else:
        dataset, classes = result, getattr(result, "classes", None)
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise UserError(
            f"data.name={spec} returned {type(dataset).__name__} for split {split}; return a map-style dataset "
            f"(len(d) and d[i]) and its class names, as (dataset, classes)"
        )
    if not _is_names(classes):
        raise UserError(
            f"data.name={spec}: split {split} comes without class names; return (dataset, classes) with classes "
            f"a list of strings, or give the dataset a classes attribute"
        )
    return dataset, [str(c) for c in classes]


def _is_names(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(c, str) for c in value)


def items_of(dataset: Any, num_classes: int, name: str) -> Items:
    return Items(dataset, torch.arange(len(dataset)), num_classes, name)


def function_splits(spec: str, kwargs: dict[str, Any], val_fraction: float, split_seed: int) -> Splits:
    """The training and validation sources of a dataset function (nothing read but their lengths)."""
    function = import_function(spec, "data.name", _first_line)
    train = _call(spec, function, "train", kwargs)
    if train is None:
        raise UserError(f"data.name={spec} returned None for split train; return the training dataset and classes")
    val = _call(spec, function, "val", kwargs)
    return user_splits(f"data.name={spec}", *train, val, val_fraction, split_seed)


def user_splits(
    what: str,
    train: Any,
    classes: list[str],
    val: tuple[Any, list[str]] | None,
    val_fraction: float,
    split_seed: int,
) -> Splits:
    """Splits of a training dataset and an optional validation one (else a seeded share of training)."""
    if len(classes) < 2:
        raise UserError(f"{what} has {len(classes)} class name(s) {classes}; a classifier needs at least 2")
    if len(train) == 0:
        raise UserError(f"{what}: the training dataset is empty; give it some items")
    source = items_of(train, len(classes), f"{what} (train)")
    if val is None:
        train_idx, val_idx = seeded_split(len(source), val_fraction, split_seed)
        return Splits(source.subset(train_idx), Items(train, val_idx, len(classes), f"{what} (val)"), classes)
    val_dataset, val_classes = val
    if val_classes != classes:
        differ = sorted(set(classes) ^ set(val_classes))[:3] or ["their order"]
        raise UserError(
            f"{what}: the val split has {len(val_classes)} classes that differ from train's {len(classes)} "
            f"(e.g. {', '.join(differ)}); give both splits the same class names in the same order"
        )
    if len(val_dataset) == 0:
        raise UserError(f"{what}: the val dataset is empty; give it some items or return None for a held-out share")
    return Splits(source, items_of(val_dataset, len(classes), f"{what} (val)"), classes)


# ---------------------------------------------------------------- reading one item


def read_item(items: Items, index: int) -> tuple[Picture, torch.Tensor]:
    """(picture, int64 label) of the source's item `index`, or a one-line error naming the item."""
    i = int(items.indices[index])
    where = f"{items.name} item {i}"
    try:
        item = items.dataset[i]
    except Exception as exc:  # the dataset's own (a multicard error passes unnoted): its traceback stays
        noted(exc, f"reading {where}")
        raise
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise UserError(f"{where} is {_describe(item)}; each item must be {ITEM_FORMS}")
    image, label = item
    return to_picture(image, where), torch.tensor(_label(label, items.num_classes, where))


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _label(label: Any, num_classes: int, where: str) -> int:
    if isinstance(label, torch.Tensor) and label.numel() == 1 and not label.is_floating_point():
        label = label.item()
    elif isinstance(label, np.ndarray) and label.size == 1:
        label = label.item()
    if isinstance(label, bool) or not isinstance(label, (int, np.integer)):
        raise UserError(
            f"{where} has label {label!r} ({type(label).__name__}); labels are integers 0..{num_classes - 1}"
        )
    if not 0 <= label < num_classes:
        raise UserError(
            f"{where} has label {label}, outside 0..{num_classes - 1} ({num_classes} classes); fix the label "
            f"or the class names"
        )
    return int(label)


def to_picture(image: Any, where: str) -> Picture:
    """What the transforms take: encoded bytes stay encoded (decoded later, JPEGs at reduced scale
    where the crop allows); pixels become a uint8 (3, H, W) tensor."""
    if isinstance(image, EncodedImage):  # packed shards: bytes with the header their index holds (sources/shards.py)
        return image
    if isinstance(image, (bytes, bytearray, memoryview)):
        try:
            return EncodedImage.from_bytes(bytes(image), where)
        except PIL_ERRORS as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UserError(f"{where}: cannot decode its image bytes ({reason}); fix or drop the item") from None
    if isinstance(image, Image.Image):
        try:
            return torch.from_numpy(np.asarray(to_rgb(image)).copy()).permute(2, 0, 1).contiguous()
        except PIL_ERRORS as exc:
            raise UserError(
                f"{where}: cannot decode its PIL image ({_first_line(exc)}); fix or drop the item"
            ) from None
    if isinstance(image, np.ndarray):
        image = torch.from_numpy(np.ascontiguousarray(image) if image.flags.writeable else image.copy())
    if isinstance(image, torch.Tensor):
        return _pixels(image, where)
    raise UserError(f"{where} has an image of type {type(image).__name__}; each item must be {ITEM_FORMS}")


def _pixels(image: torch.Tensor, where: str) -> torch.Tensor:
    """uint8 HW, HWC or CHW with 1 or 3 channels → contiguous uint8 (3, H, W)."""
    shape = tuple(image.shape)
    if image.dtype != torch.uint8:
        dtype = str(image.dtype).removeprefix("torch.")
        raise UserError(f"{where} has a {dtype} image {shape}; images are uint8 (0..255): convert it")
    if image.ndim == 2:
        image = image[None]
    elif image.ndim == 3 and image.shape[-1] in (1, 3):
        image = image.permute(2, 0, 1)  # HWC
    elif not (image.ndim == 3 and image.shape[0] in (1, 3)):
        raise UserError(f"{where} has an image of shape {shape}; give H×W, H×W×C or C×H×W with C = 1 or 3")
    if image.shape[-1] == 0 or image.shape[-2] == 0:
        raise UserError(f"{where} has an empty image of shape {shape}")
    return image.expand(3, -1, -1).contiguous() if image.shape[0] == 1 else image.contiguous()


def decode_items(items: Items, size: int) -> InMemory:
    """Every item decoded to size × size, as decode.decode_files does for files (the device loader)."""
    images = torch.empty(len(items), 3, size, size, dtype=torch.uint8)
    labels = torch.empty(len(items), dtype=torch.int64)
    for i in range(len(items)):
        picture, labels[i] = read_item(items, i)
        images[i] = fit_square(picture.tensor() if isinstance(picture, EncodedImage) else picture, size)
    return InMemory(images, labels)
