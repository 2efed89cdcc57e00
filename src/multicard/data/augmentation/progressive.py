"""Progressive resizing: the training image size as a function of the epoch only.

Small images for the first epochs, growing linearly to data.image_size between two epochs, in
steps of a multiple (32 by default, so kernels meet few shapes): the rule of ffcv's ImageNet
recipes. Evaluation always runs at data.image_size. A function of the epoch alone, it is the
same on every rank and after a resume.
"""

from __future__ import annotations

from dataclasses import dataclass

from multicard.base.config import DataConfig


@dataclass(frozen=True)
class ProgressiveSize:
    min_size: int
    max_size: int
    start_epoch: int
    end_epoch: int
    multiple: int

    def __call__(self, epoch: int) -> int:
        if epoch <= self.start_epoch:
            return self.min_size
        if epoch >= self.end_epoch:
            return self.max_size
        share = (epoch - self.start_epoch) / (self.end_epoch - self.start_epoch)
        size = self.min_size + share * (self.max_size - self.min_size)
        return min(self.max_size, max(self.min_size, round(size / self.multiple) * self.multiple))

    def sizes(self, epochs: int) -> list[int]:
        """The distinct training sizes of a run of `epochs` epochs, in order."""
        return list(dict.fromkeys(self(e) for e in range(epochs)))


def progressive_size(d: DataConfig) -> ProgressiveSize | None:
    """data.progressive_min_size > 0 turns it on; None otherwise."""
    if not d.progressive_min_size:
        return None
    return ProgressiveSize(
        d.progressive_min_size, d.image_size, d.progressive_start_epoch, d.progressive_end_epoch, d.progressive_multiple
    )
