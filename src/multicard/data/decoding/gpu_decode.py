"""data.decode=gpu, the training process's side: nvjpeg decodes a batch of JPEGs on the GPU, where
each is cropped, resized, centre-cropped and flipped as its worker chose (jpeg_crop.py).

Resizing is bilinear and antialiased (torch's kernel, as the CPU path's), in float, so the batch
never leaves the GPU between decoding and normalisation. A batch nvjpeg refuses (it decodes
nothing of a batch with one file it cannot read) is decoded on the CPU instead, with a warning the
first time; a file that Pillow cannot read either is a one-line error naming it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from multicard.data.augmentation.device_transform import DeviceTransform
from multicard.data.augmentation.policies import SamplePolicy
from multicard.data.augmentation.progressive import ProgressiveSize
from multicard.data.decoding.decode import resize_ops
from multicard.data.decoding.jpeg_crop import Crop, EncodedBatch
from multicard.data.sources.encoded import EncodedImage

# torchvision 0.29 deprecates its image decoders in favour of TorchCodec's; its nvjpeg path is the
# one every CUDA build of torchvision ships, so it is used with exactly that warning silenced.
TORCHVISION_DEPRECATION = "The image decoding and encoding capabilities of TorchVision are deprecated"

Decoder = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]


def nvjpeg(jpegs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """(3, H, W) uint8 RGB on `device` for each JPEG's bytes (CPU tensors), decoded as one batch."""
    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TORCHVISION_DEPRECATION, category=DeprecationWarning)
        return decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device)


def pillow(jpegs: list[torch.Tensor], paths: Sequence[str], sizes: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """The CPU's decoding of the same files (uint8 (3, H, W)), or a UserError naming a bad one."""
    return [
        EncodedImage(Path(path), data.numpy().tobytes(), size, "JPEG", "RGB").tensor()
        for data, path, size in zip(jpegs, paths, sizes, strict=True)
    ]


def apply_crop(image: torch.Tensor, crop: Crop, size: int) -> torch.Tensor:
    """uint8 (3, H, W) → float (3, size, size) holding 0..255: the box, resized, centre-cropped.

    The flip is left to the caller, which flips all flipped samples of a batch at once.
    """
    box = crop.box
    region = image[:, box.top : box.top + box.height, box.left : box.left + box.width].float()
    if (crop.height, crop.width) != (box.height, box.width):
        region = F.interpolate(region[None], size=(crop.height, crop.width), mode="bilinear", antialias=True)[0]
    return resize_ops().center_crop(region, [size, size]) if (crop.height, crop.width) != (size, size) else region


class GpuDecode:
    """Turns an EncodedBatch into normalised training input on the device (`decode` is nvjpeg;
    tests give a CPU decoder to run the same arithmetic without a GPU): the batch's pixels assembled,
    then finished by a DeviceTransform."""

    def __init__(
        self, mean: Sequence[float], std: Sequence[float], device: torch.device, seed: int, size: int,
        decode: Decoder = nvjpeg, policy: SamplePolicy | None = None, sizes: ProgressiveSize | None = None,
    ) -> None:  # fmt: skip
        self.finish = DeviceTransform(mean, std, device, None, seed, policy, sizes)
        self.device = device
        self.size = size
        self.decode = decode
        self.fell_back = False

    def __call__(
        self, x: EncodedBatch, y: torch.Tensor, indices: torch.Tensor, epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.finish(self.assemble(x), y, indices, epoch)

    def assemble(self, batch: EncodedBatch) -> torch.Tensor:
        """float (N, 3, S, S) of uint8 values on the device, in the batch's order."""
        out = torch.empty(batch.count, 3, self.size, self.size, device=self.device)
        if batch.pixel_positions:  # decoded, cropped and flipped by the workers already
            out[batch.pixel_positions] = batch.pixels.to(self.device, non_blocking=True).float()
        if batch.jpeg_positions:
            images = self._decoded(batch)
            for position, image, crop in zip(batch.jpeg_positions, images, batch.crops, strict=True):
                out[position] = apply_crop(image, crop, self.size)
            flipped = [p for p, crop in zip(batch.jpeg_positions, batch.crops, strict=True) if crop.flip]
            if flipped:
                out[flipped] = out[flipped].flip(-1)
            out.round_().clamp_(0, 255)  # the CPU path hands over uint8: the same values
        return out

    def _decoded(self, batch: EncodedBatch) -> list[torch.Tensor]:
        jpegs = batch.jpegs()
        try:
            images = self.decode(jpegs, self.device)
            for image, (width, height) in zip(images, batch.sizes, strict=True):
                if tuple(image.shape) != (3, height, width):
                    raise RuntimeError(f"decoded {tuple(image.shape)} for a {width}×{height} header")
            return images
        except RuntimeError as exc:
            if not self.fell_back:
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                message = f"nvjpeg could not decode a batch ({reason}); such batches are decoded on the CPU"
                warnings.warn(message, stacklevel=2)
                self.fell_back = True
            return [image.to(self.device) for image in pillow(jpegs, batch.paths, batch.sizes)]
