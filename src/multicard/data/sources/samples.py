"""Any source's samples as encoded images: the bytes of an image file unchanged, pixels as PNG
(lossless), with the header a reader needs (what `multicard pack` stores: tools/pack.py)."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from multicard.data.sources.encoded import PIL_ERRORS, EncodedImage, opened
from multicard.data.sources.folders import Files, Items, Source
from multicard.data.sources.user import read_item

EXTENSIONS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tiff"}


def extension(format: str) -> str:
    """The image member's extension for Pillow's format name."""
    return EXTENSIONS.get(format, (format or "img").lower())


def png(pixels: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    hwc = np.ascontiguousarray(pixels.numpy().transpose(1, 2, 0))  # numpy: no torch thread pool in a forked process
    Image.fromarray(hwc).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def encoded_sample(source: Source, i: int) -> tuple[bytes, str, int, int, int, str, str]:
    """(encoded bytes, extension, label, width, height, format, mode) of sample i; only a file's header is parsed."""
    image: torch.Tensor | EncodedImage
    if isinstance(source, Files):
        image, label = EncodedImage.read(source.root / source.paths[i]), int(source.labels[i])
    elif isinstance(source, Items):
        image, target = read_item(source, i)
        label = int(target)
    else:
        image, label = source.images[i], int(source.labels[i])
    if isinstance(image, EncodedImage):
        return image.data, extension(image.format or ""), label, *image.size, image.format or "", image.mode
    return png(image), "png", label, image.shape[-1], image.shape[-2], "PNG", "RGB"


def image_header(data: bytes) -> tuple[int, int, str, str, str]:
    """(width, height, Pillow's format, mode, extension) of an encoded image; a ValueError where it is no
    readable image."""
    try:
        with opened(data) as image:
            return (*image.size, image.format or "", image.mode, extension(image.format or ""))
    except PIL_ERRORS as exc:
        raise ValueError(str(exc) or type(exc).__name__) from exc
