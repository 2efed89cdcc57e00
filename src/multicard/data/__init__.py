"""Datasets and loaders: `build_data` is the one entry point the engine uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from multicard.data.loader import Augment, EvalLoader, TensorImages, TrainLoader
from multicard.data.sampling import BatchPlan, ShardedBatchSampler
from multicard.data.synthetic import CLASSES, make_synthetic
from multicard.errors import UserError

DATASETS = ("synthetic",)
VAL_SEED_OFFSET = 7919  # the validation set is drawn from a stream apart from training's


@dataclass
class Data:
    train: TrainLoader | None
    val: EvalLoader
    num_classes: int


def _synthetic(cfg: DictConfig, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    d = cfg.data
    if not 2 <= d.num_classes <= len(CLASSES):
        raise UserError(f"data.num_classes={d.num_classes} must be in 2..{len(CLASSES)} for synthetic data")
    if split == "train":
        return make_synthetic(d.train_size, d.image_size, cfg.seed, d.num_classes)
    return make_synthetic(d.val_size, d.image_size, cfg.seed + VAL_SEED_OFFSET, d.num_classes)


def build_data(
    cfg: DictConfig, plan: BatchPlan | None, rank: int, world_size: int, device: torch.device
) -> Data:
    """Training (when `plan` is given) and validation loaders for this rank."""
    if cfg.data.name not in DATASETS:
        raise UserError(f"data.name={cfg.data.name} is not one of {', '.join(DATASETS)}")
    d = cfg.data
    val = TensorImages(*_synthetic(cfg, "val"), d.mean, d.std, device)
    train = None
    if plan is not None:
        images = TensorImages(*_synthetic(cfg, "train"), d.mean, d.std, device)
        sampler = ShardedBatchSampler(len(images), plan, rank, cfg.seed)
        augment = Augment(d.crop_padding, flip=True) if d.augment else None
        train = TrainLoader(images, sampler, augment, cfg.seed)
    return Data(
        train=train,
        val=EvalLoader(val, d.eval_batch_size, rank, world_size),
        num_classes=d.num_classes,
    )
