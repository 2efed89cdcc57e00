"""An image file read into memory but not yet decoded, so a transform decodes only what it needs.

Reading parses the header (size, format, mode). Decoding happens later: a crop of the full
image, or for a JPEG the whole image at 1/2, 1/4 or 1/8 scale, which libjpeg does in the DCT
domain for much less than a full decode; a transform asks for that when its output needs no
more resolution.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from multicard.base.errors import UserError
from multicard.data.decoding import jpeg
from multicard.data.decoding.crops import Box

PIL_ERRORS = (OSError, ValueError, Image.DecompressionBombError)
# Greyscale of more than 8 bits: 16-bit PNGs and TIFFs open as I;16 (older Pillow: I, 32-bit integers).
HIGH_BIT_DEPTH = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def to_rgb(image: Image.Image) -> Image.Image:
    """The image in RGB, whatever its mode: the one conversion every loader's decoding goes through.

    Pillow's own conversion of 16-bit greyscale clips it to 8 bits, so all but the darkest values
    come out white; these are scaled instead, 0..65535 → 0..255 (mode I is read as 16-bit, values
    beyond that range clipped)."""
    if image.mode in HIGH_BIT_DEPTH:
        wide = np.clip(np.asarray(image, dtype=np.float64), 0, 65535)
        image = Image.fromarray(np.rint(wide / 257).astype(np.uint8))
    return image if image.mode == "RGB" else image.convert("RGB")


@contextmanager
def opened(data: bytes) -> Iterator[Image.Image]:
    """Pillow's image of encoded bytes, without its DecompressionBombWarning: above 89 M pixels
    it warns, yet a large photo is data here, not an attack (JPEGs are decoded at reduced scale
    when the crop allows). Beyond twice that, Pillow's DecompressionBombError still refuses it
    (one of PIL_ERRORS: one line naming the file)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(io.BytesIO(data)) as image:
            yield image


def unreadable(path: Path | str, exc: BaseException) -> UserError:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return UserError(f"cannot decode image {path} ({reason}); remove or replace the file")


class EncodedImage:
    """A file's bytes and header; its methods decode them into uint8 pixels."""

    def __init__(self, path: Path | str, data: bytes, size: tuple[int, int], format: str | None, mode: str) -> None:
        self.path = path
        self.data = data
        self.size = size  # (width, height) of the full image
        self.format = format
        self.mode = mode

    @classmethod
    def read(cls, path: Path) -> EncodedImage:
        """Read the file and its header, or raise a one-line error naming it."""
        try:
            data = path.read_bytes()
            with opened(data) as image:
                return cls(path, data, image.size, image.format, image.mode)
        except PIL_ERRORS as exc:
            raise unreadable(path, exc) from None

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> EncodedImage:
        """Encoded bytes that come from no file (a dataset function's item, a Hugging Face image
        column); `name` says which sample in messages. Like `read`, only the header is parsed, and
        an unreadable header raises one of PIL_ERRORS for the caller to name the sample."""
        with opened(data) as image:
            return cls(Path(name), data, image.size, image.format, image.mode)

    @property
    def reducible(self) -> bool:
        """Whether `decode` can reduce it in the decoder (JPEG only)."""
        return self.format == "JPEG"

    def _fast_jpeg(self, reduce: int) -> np.ndarray | None:
        if not self.reducible or self.mode not in ("RGB", "L"):  # CMYK and the like: Pillow converts
            return None
        return jpeg.decode_scaled(self.data, *self.size, reduce)

    def _pillow(self, reduce: int = 1, box: Box | None = None) -> tuple[np.ndarray, int]:
        try:
            with opened(self.data) as image:
                width, height = self.size
                # draft() answers with the full image's box in reduced pixels, or None if it did nothing.
                drafted = image.draft(image.mode, (width // reduce, height // reduce)) if reduce > 1 else None
                image = to_rgb(image)
                # Crop before leaving Pillow: only the box is copied out of its 4-byte pixels.
                pixels = np.array(image if box is None else image.crop(box.corners))
        except PIL_ERRORS as exc:
            raise unreadable(self.path, exc) from None
        return pixels, round(width / drafted[1][2]) if drafted else 1

    def decode(self, reduce: int = 1) -> tuple[torch.Tensor, int]:
        """(H, W, 3) uint8 RGB of the whole image at 1/r scale, and r.

        r is `reduce` (1, 2, 4 or 8) for a JPEG, else 1. At 1/r the image measures
        ceil(width / r) × ceil(height / r), and full-size coordinate x lies at x / r.
        """
        pixels = self._fast_jpeg(reduce)
        if pixels is None:
            pixels, reduce = self._pillow(reduce)
        return torch.from_numpy(pixels), reduce

    def crop(self, box: Box) -> torch.Tensor:
        """(box.height, box.width, 3) uint8 RGB: the box of the full-size image."""
        pixels = self._fast_jpeg(1)
        if pixels is None:
            pixels = self._pillow(1, box)[0]
        else:
            pixels = pixels[box.top : box.top + box.height, box.left : box.left + box.width]
        return torch.from_numpy(pixels)

    def tensor(self) -> torch.Tensor:
        """Full-size uint8 (3, H, W): the pixels the device loader's cache and small images use."""
        try:
            with opened(self.data) as image:
                pixels = np.asarray(to_rgb(image))
        except PIL_ERRORS as exc:
            raise unreadable(self.path, exc) from None
        return torch.from_numpy(pixels.copy()).permute(2, 0, 1).contiguous()
