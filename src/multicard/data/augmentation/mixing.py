"""Mixup and CutMix on the device, after the loader, the same at every world size.

Each sample mixes with its neighbour in the global batch: positions 2k and 2k+1 form a pair, and a
pair never straddles two ranks or micro-steps (every per-process micro-batch is even, and holds
a contiguous slice of the global batch: data/loading/sampling.py). The draws (whether to mix, mixup or
CutMix, λ, the box) come from a generator keyed by (seed, epoch, step) that draws them for the
whole global batch; each rank takes its pairs' share. So a global batch holds the same mixed
images and soft targets however many processes or micro-steps share it.

Modes, as timm's Mixup offers them: `batch` (one draw for the global batch), `pair` (one per pair,
both members alike) and `elem` (one per sample, each mixing its partner into itself). Label
smoothing is applied by the loss to the soft targets (torch's cross_entropy does), which equals
smoothing each one-hot target before mixing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from multicard.base.config import MixConfig
from multicard.data.loading.sampling import BatchSplit

MIX_STREAM = 0x6D6978  # keeps these draws apart from any other generator keyed by (seed, epoch, step)


@dataclass(frozen=True)
class Draws:
    """One mixing decision per unit (the batch, a pair or a sample), as float64 arrays."""

    apply: np.ndarray
    cut: np.ndarray
    lam: np.ndarray
    centre_y: np.ndarray
    centre_x: np.ndarray


def mixing(cfg: MixConfig, split: BatchSplit, rank: int, seed: int, num_classes: int) -> StepMix | None:
    """This rank's mixing of its micro-batches; None when both alphas are 0."""
    if cfg.mixup_alpha == 0 and cfg.cutmix_alpha == 0:
        return None  # (a dataset of one class, which mixing could not blend, is refused when it is read)
    return StepMix(BatchMix(cfg), split, rank, seed, num_classes)


class StepMix:
    """BatchMix of this rank's micro-batches, each placed in its global batch."""

    def __init__(self, mix: BatchMix, split: BatchSplit, rank: int, seed: int, num_classes: int) -> None:
        self.mix, self.split, self.rank, self.seed, self.num_classes = mix, split, rank, seed, num_classes

    def __call__(
        self, x: torch.Tensor, labels: torch.Tensor, epoch: int, step_in_epoch: int, micro: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.split
        # data/loading/sampling.py's layout
        first = micro * (s.global_batch // s.grad_accum) + self.rank * s.micro_batch
        return self.mix(x, labels, self.num_classes, (self.seed, epoch, step_in_epoch), s.global_batch, first)


class BatchMix:
    """(x, labels) of one micro-batch → (mixed x, soft targets)."""

    def __init__(self, cfg: MixConfig) -> None:
        self.cfg = cfg

    def draws(self, seed: int, epoch: int, step: int, global_batch: int) -> Draws:
        c = self.cfg
        units = {"batch": 1, "pair": global_batch // 2, "elem": global_batch}[c.mode]
        g = np.random.default_rng([seed, epoch, step, MIX_STREAM])
        apply = g.random(units) < c.prob
        if c.mixup_alpha > 0 and c.cutmix_alpha > 0:
            cut = g.random(units) < c.switch_prob
        else:
            cut = np.full(units, c.cutmix_alpha > 0)
        mix_lam = g.beta(c.mixup_alpha, c.mixup_alpha, units) if c.mixup_alpha > 0 else np.ones(units)
        cut_lam = g.beta(c.cutmix_alpha, c.cutmix_alpha, units) if c.cutmix_alpha > 0 else np.ones(units)
        lam = np.where(apply, np.where(cut, cut_lam, mix_lam), 1.0)
        return Draws(apply, cut, lam, g.random(units), g.random(units))

    def per_sample(self, d: Draws, first: int, n: int) -> Draws:
        """The draws of global positions first..first+n-1, one entry per sample."""
        positions = np.arange(first, first + n)
        unit = {"batch": positions * 0, "pair": positions // 2, "elem": positions}[self.cfg.mode]
        return Draws(d.apply[unit], d.cut[unit], d.lam[unit], d.centre_y[unit], d.centre_x[unit])

    def __call__(
        self, x: torch.Tensor, labels: torch.Tensor, num_classes: int, key: tuple[int, int, int], global_batch: int,
        first: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """`key` is (seed, epoch, step); `first` the global position of x[0] in its global batch."""
        n, _, height, width = x.shape
        d = self.per_sample(self.draws(*key, global_batch), first, n)
        partner = torch.arange(n, device=x.device) ^ 1  # 2k ↔ 2k+1
        boxes, area = cutmix_boxes(d, height, width)
        lam = np.where(d.cut, 1.0 - area / (height * width), d.lam)  # CutMix: the share of pixels kept
        lam_t = torch.as_tensor(lam, dtype=x.dtype, device=x.device)
        mixed = lam_t.view(n, 1, 1, 1) * x + (1 - lam_t.view(n, 1, 1, 1)) * x[partner]
        if d.cut.any():
            inside = box_masks(boxes, height, width, x.device)
            cut = torch.as_tensor(d.cut, device=x.device).view(n, 1, 1, 1)
            mixed = torch.where(cut, torch.where(inside, x[partner], x), mixed)
        onehot = torch.nn.functional.one_hot(labels, num_classes).to(x.dtype)
        targets = lam_t.view(n, 1) * onehot + (1 - lam_t.view(n, 1)) * onehot[partner]
        return mixed, targets


def cutmix_boxes(d: Draws, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(top, bottom, left, right) per sample, a box of area ≈ (1 - λ) × the image's around the drawn
    centre, clipped to the image; and its area after clipping."""
    ratio = np.sqrt(1.0 - np.where(d.cut, d.lam, 1.0))
    cut_h, cut_w = (height * ratio).astype(np.int64), (width * ratio).astype(np.int64)
    cy, cx = (d.centre_y * height).astype(np.int64), (d.centre_x * width).astype(np.int64)
    top, bottom = np.clip(cy - cut_h // 2, 0, height), np.clip(cy + cut_h // 2, 0, height)
    left, right = np.clip(cx - cut_w // 2, 0, width), np.clip(cx + cut_w // 2, 0, width)
    boxes = np.stack([top, bottom, left, right], axis=1)
    return boxes, ((bottom - top) * (right - left)).astype(np.float64)


def box_masks(boxes: np.ndarray, height: int, width: int, device: torch.device) -> torch.Tensor:
    """(n, 1, H, W) booleans: inside each sample's box."""
    b = torch.as_tensor(boxes, device=device)
    rows = torch.arange(height, device=device).view(1, height, 1)
    cols = torch.arange(width, device=device).view(1, 1, width)
    inside_rows = (rows >= b[:, 0].view(-1, 1, 1)) & (rows < b[:, 1].view(-1, 1, 1))
    inside_cols = (cols >= b[:, 2].view(-1, 1, 1)) & (cols < b[:, 3].view(-1, 1, 1))
    return (inside_rows & inside_cols).unsqueeze(1)
