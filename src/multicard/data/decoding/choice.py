"""Where large JPEGs are decoded: `data.decode` = cpu (loader workers), gpu (nvjpeg), or auto."""

from __future__ import annotations

import torch

from multicard.base.config import check_decode
from multicard.base.errors import UserError
from multicard.data.augmentation.transforms import is_small
from multicard.data.sources.folders import Files, Items, Splits


def choose_decode(decode: str, loader: str, splits: Splits, image_size: int, device: torch.device) -> str:
    """cpu or gpu for this run.

    GPU decoding applies to image files of more than 64 px read by the workers loader; auto takes
    it there when the device is CUDA, and the CPU everywhere else.
    """
    check_decode(decode, device.type == "cuda")
    # Items (a dataset function, a Hugging Face dataset) may hold encoded JPEGs too
    files = any(isinstance(source, (Files, Items)) for source in (splits.train, splits.val))
    applies = loader == "workers" and not is_small(image_size) and files
    if decode == "auto":
        return "gpu" if applies and device.type == "cuda" else "cpu"
    if decode == "gpu" and not applies:
        raise UserError(
            f"data.decode=gpu decodes image files of more than 64 px read by the workers loader; this run has "
            f"data.image_size={image_size}, data.loader={loader}{'' if files else ', images in memory'}: "
            f"use data.decode=cpu or auto"
        )
    return decode
