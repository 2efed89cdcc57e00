"""data.decode=gpu, the workers' side: read each file, choose its crop, pass the JPEG on undecoded.

A worker parses the file's header (size, format), draws the crop and flip exactly as the CPU
transform would from (seed, epoch, index), and hands over the file's bytes with that crop; the
training process decodes the batch with nvjpeg and crops, resizes and flips on the GPU
(gpu_decode.py). Files nvjpeg is not given — other formats (PNG, ...) and JPEGs that are not RGB or
greyscale (CMYK) — are decoded, cropped and resized by the worker with the CPU transform itself, as
under data.decode=cpu, and travel as pixels.

A batch travels as one tensor of concatenated bytes plus offsets: one shared-memory block per batch
rather than one per image.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from multicard.data.augmentation.transforms import FitSquare, Picture, RandomResizedCropFlip
from multicard.data.decoding.crops import Box, crop_uniforms, flips, random_resized_box, resized_size
from multicard.data.sources.encoded import EncodedImage

NVJPEG_MODES = ("RGB", "L")  # JPEG colour modes nvjpeg decodes to RGB


@dataclass(frozen=True)
class Crop:
    """What the device makes of a decoded image: take `box`, resize it to height × width (bilinear,
    antialiased), centre-crop to the output size (a no-op when it already has it), flip if asked."""

    box: Box
    height: int
    width: int
    flip: bool


def plan_crop(transform: RandomResizedCropFlip | FitSquare, width: int, height: int, epoch: int, index: int) -> Crop:
    """The crop `transform` takes of a width × height image, as a plan for the device."""
    if isinstance(transform, RandomResizedCropFlip):
        uniforms = crop_uniforms(transform.seed, epoch, index)
        box = random_resized_box(width, height, transform.scale, uniforms)
        return Crop(box, transform.size, transform.size, transform.flip and flips(uniforms))
    new_width, new_height = resized_size(width, height, transform.resize)  # Resize(shorter side), then centre crop
    return Crop(Box(0, 0, width, height), new_height, new_width, flip=False)


@dataclass(frozen=True)
class JpegFile:
    """One sample on its way to the device: the file's bytes and what to make of them."""

    path: str
    data: bytes
    size: tuple[int, int]  # (width, height) from the header
    crop: Crop


class JpegTransform:
    """Worker transform under data.decode=gpu: a JpegFile for JPEGs nvjpeg decodes, else the pixels
    of the CPU transform it wraps (which also defines the crops)."""

    def __init__(self, cpu: RandomResizedCropFlip | FitSquare) -> None:
        self.cpu = cpu

    def __call__(self, image: Picture, epoch: int, index: int) -> JpegFile | torch.Tensor:
        if not (isinstance(image, EncodedImage) and image.format == "JPEG" and image.mode in NVJPEG_MODES):
            return self.cpu(image, epoch, index)
        return JpegFile(str(image.path), image.data, image.size, plan_crop(self.cpu, *image.size, epoch, index))


@dataclass
class EncodedBatch:
    """A batch of JpegFiles (their bytes concatenated) and worker-decoded pixels, with their places."""

    count: int  # samples in the batch
    data: torch.Tensor  # uint8: every JPEG's bytes, one after another
    offsets: list[int]  # JPEG j is data[offsets[j]:offsets[j + 1]]
    jpeg_positions: list[int]  # where each JPEG goes in the batch
    paths: list[str]
    sizes: list[tuple[int, int]]
    crops: list[Crop]
    pixels: torch.Tensor  # uint8 (n, 3, S, S): the samples decoded by workers
    pixel_positions: list[int]

    def jpegs(self) -> list[torch.Tensor]:
        """Each JPEG's bytes: 1-D views of `data`."""
        return [self.data[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:], strict=True)]

    def pin_memory(self) -> EncodedBatch:
        """DataLoader's pin_memory calls this: pixels then copy to the GPU without waiting."""
        self.pixels = self.pixels.pin_memory()
        return self


def collate_encoded(
    items: list[tuple[JpegFile | torch.Tensor, torch.Tensor, int]],
) -> tuple[EncodedBatch, torch.Tensor, torch.Tensor]:
    """DataLoader collate_fn (it runs in the worker): (EncodedBatch, labels, dataset indices)."""
    images, labels, indices = zip(*items, strict=True)
    jpegs = [(i, x) for i, x in enumerate(images) if isinstance(x, JpegFile)]
    decoded = [(i, x) for i, x in enumerate(images) if not isinstance(x, JpegFile)]
    offsets = [0]
    for _, jpeg in jpegs:
        offsets.append(offsets[-1] + len(jpeg.data))
    joined = bytearray(b"".join(jpeg.data for _, jpeg in jpegs))
    data = torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
    batch = EncodedBatch(
        count=len(images),
        data=data,
        offsets=offsets,
        jpeg_positions=[i for i, _ in jpegs],
        paths=[jpeg.path for _, jpeg in jpegs],
        sizes=[jpeg.size for _, jpeg in jpegs],
        crops=[jpeg.crop for _, jpeg in jpegs],
        pixels=torch.stack([x for _, x in decoded]) if decoded else torch.empty(0, dtype=torch.uint8),
        pixel_positions=[i for i, _ in decoded],
    )
    return batch, torch.stack(list(labels)), torch.tensor(indices)
