"""Per-image transforms run inside loader workers; randomness keyed by (seed, epoch, index).

Small images are only brought to a fixed size here (their crop/flip runs batched on the
device, the same code as the device loader). Large images follow the usual recipe: random
resized crop + flip for training, resize + centre crop for evaluation, made cheap by
- choosing the crop from the image's header, before decoding, so a JPEG can be decoded at 1/2,
  1/4 or 1/8 scale when the crop still has the output's resolution there (the crop's corners,
  mapped onto the reduced image, are then resampled exactly by Pillow);
- otherwise cropping first and resampling only the crop, in uint8, with torch's antialiased
  bilinear kernel on the decoder's interleaved (channels-last) pixels: Pillow's filter, ~3× faster;
- handing over uint8: normalisation runs on the training device (DeviceTransform).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from multicard.base.config import SMALL_IMAGE_MAX
from multicard.data.augmentation.progressive import ProgressiveSize
from multicard.data.decoding.crops import Box, centre_region, crop_uniforms, flips, random_resized_box, resized_size
from multicard.data.decoding.decode import fit_square, resize_ops
from multicard.data.sources.encoded import EncodedImage

MAX_REDUCE = 8  # libjpeg scales by 1/2, 1/4 or 1/8 in the DCT domain

# What a source hands a transform: pixels (3, H, W) of an in-memory set, or a file not yet decoded.
Picture = torch.Tensor | EncodedImage


def is_small(image_size: int) -> bool:
    return image_size <= SMALL_IMAGE_MAX


def picture_size(image: Picture) -> tuple[int, int]:
    """(width, height) of the full image, known before decoding."""
    return image.size if isinstance(image, EncodedImage) else (image.shape[-1], image.shape[-2])


def reduction(image: Picture, spare: float) -> int:
    """The decoding scale 1/r (r = 1, 2, 4, 8) that shrinks a side by no more than `spare`."""
    r = 1
    while isinstance(image, EncodedImage) and image.reducible and r < MAX_REDUCE and 2 * r <= spare:
        r *= 2
    return r


def whole(image: Picture) -> torch.Tensor:
    """(H, W, 3) uint8 pixels of the whole image at full size."""
    return image.decode()[0] if isinstance(image, EncodedImage) else image.permute(1, 2, 0)


def crop(image: Picture, box: Box) -> torch.Tensor:
    """(box.height, box.width, 3) uint8 pixels of the box, cropped before anything else is copied."""
    if isinstance(image, EncodedImage):
        return image.crop(box)
    return image.permute(1, 2, 0)[box.top : box.top + box.height, box.left : box.left + box.width]


def resample(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(H, W, 3) uint8 → (3, height, width) uint8, bilinear and antialiased like Pillow's resize."""
    # A channels-last view, not a copy: torch's vectorised uint8 kernel reads interleaved RGB.
    return F.interpolate(pixels.permute(2, 0, 1)[None], size=(height, width), mode="bilinear", antialias=True)[0]


def resample_region(
    pixels: torch.Tensor, region: tuple[float, float, float, float], height: int, width: int
) -> torch.Tensor:
    """Like `resample`, of a region with fractional corners (left, top, right, bottom): Pillow can."""
    image = Image.fromarray(pixels.numpy()).resize((width, height), Image.Resampling.BILINEAR, box=region)
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


def reduced(corners: tuple[float, float, float, float], reduce: int) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) of the full-size image, in pixels of its 1/reduce decode (exactly)."""
    left, top, right, bottom = corners
    return left / reduce, top / reduce, right / reduce, bottom / reduce


class FitSquare:
    """Resize the shorter side and centre-crop: small images (any split), large evaluation images."""

    def __init__(self, size: int, resize: int | None = None) -> None:
        self.size = size
        self.resize = resize or size
        # Loaded here, in the process that starts the loader's processes, so that they inherit it
        # instead of each importing torchvision on its first image after the fork.
        resize_ops()

    def __call__(self, image: Picture, epoch: int, index: int) -> torch.Tensor:
        TF = resize_ops()
        if is_small(self.size):  # the device loader's pixels exactly: decoded in full, then fit
            pixels = image.tensor() if isinstance(image, EncodedImage) else image
            if self.resize == self.size:
                return fit_square(pixels, self.size)
            return TF.center_crop(TF.resize(pixels, [self.resize], antialias=True), [self.size])
        width, height = picture_size(image)
        # A reduced decode must still cover the crop, which it does unless the crop pads.
        reduce = reduction(image, min(width, height) / self.resize) if self.resize >= self.size else 1
        if reduce > 1 and isinstance(image, EncodedImage):  # only an encoded image decodes reduced
            pixels, reduce = image.decode(reduce)
            region = reduced(centre_region(width, height, self.resize, self.size), reduce)
            return resample_region(pixels, region, self.size, self.size)
        new_width, new_height = resized_size(width, height, self.resize)
        return TF.center_crop(resample(whole(image), new_height, new_width), [self.size, self.size])


class RandomResizedCropFlip:
    """Training transform for large images, reproducible per (seed, epoch, index)."""

    def __init__(
        self, size: int, scale: tuple[float, float], flip: bool, seed: int, sizes: ProgressiveSize | None = None
    ) -> None:
        self.size = size
        self.scale = (float(scale[0]), float(scale[1]))
        self.flip = flip
        self.seed = seed
        self.sizes = sizes  # progressive resizing: the epoch's size instead of `size`

    def __call__(self, image: Picture, epoch: int, index: int) -> torch.Tensor:
        size = self.sizes(epoch) if self.sizes is not None else self.size
        uniforms = crop_uniforms(self.seed, epoch, index)
        box = random_resized_box(*picture_size(image), self.scale, uniforms)
        reduce = reduction(image, min(box.width, box.height) / size)
        if reduce > 1 and isinstance(image, EncodedImage):  # its corners fall between reduced pixels: map them exactly
            pixels, reduce = image.decode(reduce)
            out = resample_region(pixels, reduced(box.corners, reduce), size, size)
        else:
            out = resample(crop(image, box), size, size)
        return out.flip(-1) if self.flip and flips(uniforms) else out
