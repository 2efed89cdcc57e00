"""Where input time goes: `multicard input-split` — storage reads, decoding, augmentation and the
host-to-device copy of the workers loader, beside the model's own step, per rank, and what to change.

For each rank of `--world-size`, the first `--batches` micro-batches it reads in epoch 0 (the same
samples training reads: data/loading/sampling.py) go through the loader's stages one at a time, timed
apart, in this process:
- read: the sample's bytes from storage (a file, a dataset's item; packed shards read a batch's
  bytes at once, `data.reads_in_flight` reads in flight, as their loaders do);
- decode: the header and a full decode (the loaders decode JPEGs at reduced scale where a large
  image's crop allows: for large images this is an upper bound);
- augment: the per-sample transform on the pixels, then the batch's last step (crop/flip, policy,
  normalise) on the training device;
- to device: the uint8 batch's copy to the training device.
Per-sample stages run in `data.num_workers` loader processes at once, so their time per batch is
divided by that count. The model's step is `multicard train`'s own (multicard.recipes.ImageClassifier
on multicard.Run, one process), timed on random batches of the same shape.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from multicard.base.config import Config, with_overrides
from multicard.data import EncodedImage, Files, Items, Source, generated_data, prefetch_items, to_device, to_picture
from multicard.runtime.clock import sync
from multicard.runtime.process_group import ProcessContext

STAGES = ("read", "decode", "augment", "to_device")
IN_WORKERS = ("read", "decode", "augment")  # per-sample stages, shared by the loader processes
BOUND = 0.5  # the loader limits training when a batch's input time exceeds this share of the model's step


@dataclass
class RankSplit:
    rank: int
    samples: int
    micro_batch: int
    workers: int  # loader processes sharing the per-sample stages
    seconds: dict[str, float]  # STAGES → total seconds over the samples, as measured one at a time
    step_s: float  # one training step of the model on a micro-batch
    device_augment_s: float = 0.0  # of seconds["augment"]: the batches' last step, on the device (not shared)

    def per_batch(self) -> dict[str, float]:
        """Seconds per micro-batch of each stage, per-sample stages shared by the loader processes."""
        batches = self.samples / self.micro_batch
        out = {
            stage: total / batches / (self.workers if stage in IN_WORKERS else 1)
            for stage, total in self.seconds.items()
        }
        out["augment"] += self.device_augment_s / batches * (1 - 1 / self.workers)  # not shared after all
        return out

    def input_s(self) -> float:
        return sum(self.per_batch().values())

    def largest(self) -> str:
        per = self.per_batch()
        return max(per, key=per.__getitem__)


def _read(source: Source, i: int) -> Any:
    """The storage read alone: the bytes (or the dataset's item, or the pixels in memory) of sample i."""
    if isinstance(source, Files):
        return (source.root / source.paths[i]).read_bytes()
    if isinstance(source, Items):
        return source.dataset[int(source.indices[i])]
    return source.images[i]


def _decode(source: Source, raw: Any, i: int) -> torch.Tensor:
    if isinstance(source, Files):
        return EncodedImage.from_bytes(raw, str(source.root / source.paths[i])).tensor()
    if isinstance(source, Items):
        picture = to_picture(raw[0], f"{source.name} item {i}")  # a dataset's item: (image, label)
        return picture.tensor() if isinstance(picture, EncodedImage) else picture
    return raw


def measure_rank(cfg: Config, rank: int, world_size: int, batches: int, ctx: ProcessContext) -> RankSplit:
    """Time the stages over this rank's first `batches` micro-batches of epoch 0."""
    from multicard.data import BatchSplit, build_data, loader_processes

    d = dataclasses.replace(cfg.data, loader="workers", num_workers=0)  # stages run here, one at a time
    split = BatchSplit(cfg.train.global_batch_size, cfg.train.grad_accum, world_size)
    here = dataclasses.replace(ctx, rank=rank, world_size=world_size, local_world_size=world_size)
    data = build_data(d, cfg.seed, split, here)
    try:
        train: Any = data.train  # the workers loader (loader=workers above), whose stages are timed one by one
        images, finish, sampler = train.loader.dataset, train.finish, train.sampler
        seconds = dict.fromkeys(STAGES, 0.0)
        samples, device_augment = 0, 0.0
        sampler.set_epoch(0)
        for k, indices in enumerate(sampler):
            if k == 0:  # untimed: the first call of each stage loads libraries and kernels
                _time_batch(images, finish, indices[:2], ctx.device, dict.fromkeys(STAGES, 0.0))
            if k == batches:
                break
            device_augment += _time_batch(images, finish, indices, ctx.device, seconds)
            samples += len(indices)
        seconds["augment"] += device_augment
        step = step_seconds(cfg, split.micro_batch, len(data.classes), here)
        workers = loader_processes(cfg.data.num_workers, here)
        return RankSplit(rank, samples, split.micro_batch, max(1, workers), seconds, step, device_augment)
    finally:
        data.close()


def _time_batch(
    images: Any, finish: Callable[..., Any], indices: torch.Tensor, device: torch.device, seconds: dict[str, float]
) -> float:
    """Add the batch's stage times to `seconds`; the seconds of its last step on the device. `images`: the
    workers loader's dataset (its source and per-image transform), `finish`: its step on the device."""
    pixels = []
    t0 = time.perf_counter()
    samples = (indices % len(images.source)).tolist()  # a repeated copy (data.repeats) reads its sample
    prefetch_items(images.source, samples)  # packed shards read a batch at once, as their loaders do
    seconds["read"] += time.perf_counter() - t0
    for i, sample in zip(indices.tolist(), samples, strict=True):
        t0 = time.perf_counter()
        raw = _read(images.source, sample)
        t1 = time.perf_counter()
        decoded = _decode(images.source, raw, sample)
        t2 = time.perf_counter()
        pixels.append(images.transform(decoded, 0, i))
        seconds["read"] += t1 - t0
        seconds["decode"] += t2 - t1
        seconds["augment"] += time.perf_counter() - t2
    t0 = time.perf_counter()
    on_device = to_device(torch.stack(pixels), device)
    sync(device)
    t1 = time.perf_counter()
    finish(on_device, torch.zeros(len(indices), dtype=torch.long), indices, 0)
    sync(device)
    seconds["to_device"] += t1 - t0
    return time.perf_counter() - t1


def step_seconds(cfg: Config, batch: int, num_classes: int, ctx: ProcessContext, steps: int = 5) -> float:
    """Seconds of one training step of the configured model on a micro-batch of random images: the
    step of `multicard train` (its recipe on multicard.Run) in this one process, after 2 untimed."""
    from multicard.recipes import ImageClassifier
    from multicard.tools.bench.probes import StepTimer

    timer = StepTimer(warmup=2)
    shape, device = (batch, 3, cfg.data.image_size, cfg.data.image_size), ctx.device

    def random_batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(shape, device=device), torch.randint(0, num_classes, (batch,), device=device)

    data = generated_data(random_batch, batch, steps + 2, num_classes)
    with tempfile.TemporaryDirectory(prefix="multicard-input-split-") as tmp:
        one = with_overrides(cfg, [
            "strategy=single", f"devices={'cpu' if ctx.device.type == 'cpu' else cfg.devices}",
            f"train.global_batch_size={batch}", "train.grad_accum=1", f"train.max_steps={steps + 2}",
            "train.resume=never", "checkpoint.dir=null", "debug.stall_s=0", "log.tensorboard=false",
            "log.mlflow=false", "log.wandb=false", f"out_dir={tmp}",
        ])  # fmt: skip
        with ImageClassifier(one, callbacks=[timer], evaluate=False, records=False, checkpoints=False,
                             data=data) as recipe:  # fmt: skip
            recipe.train()
    return statistics.mean(timer.times)


def recommend(split: RankSplit, data_name: str, small: bool, cuda: bool) -> str:
    """What to change, in one line."""
    per, total = split.per_batch(), split.input_s()
    shares = {stage: seconds / total if total else 0.0 for stage, seconds in per.items()}
    if total <= BOUND * split.step_s:
        return f"input is not the limit ({total * 1e3:.1f} ms of input per {split.step_s * 1e3:.1f} ms step): keep it"
    largest = split.largest()
    lead = f"{largest.replace('_', ' ')} takes {shares[largest]:.0%} of the input time"
    if largest == "read":
        if data_name == "shards":
            return f"{lead}: raise data.reads_in_flight or data.num_workers, or copy the shards to local disk"
        return f"{lead}: pack the dataset into shards (multicard pack) and train with data.name=shards"
    if largest == "to_device":
        return f"{lead}: keep the data on the device (data.loader=device)" if small else f"{lead}: use a GPU with DMA"
    if small:
        return f"{lead}: use the device loader (data.loader=device), which decodes once and augments on the device"
    if largest == "decode" and cuda:
        return f"{lead}: decode JPEGs on the GPU (data.decode=gpu)"
    return f"{lead}: more loader processes (data.num_workers={split.workers} now) or more cores per rank"


def describe(split: RankSplit) -> str:
    per, total = split.per_batch(), split.input_s()
    parts = ", ".join(f"{s.replace('_', ' ')} {per[s] * 1e3:.2f} ms ({per[s] / total:.0%})" for s in STAGES)
    return (
        f"rank {split.rank}: per micro-batch of {split.micro_batch} with {split.workers} loader process(es): {parts}; "
        f"input {total * 1e3:.2f} ms against a model step of {split.step_s * 1e3:.2f} ms"
    )


def run_input_split(config: str | None, overrides: list[str], world_size: int, batches: int) -> list[str]:
    """The lines `multicard input-split` prints: one per rank, then the recommendation (for the slowest rank)."""
    from multicard.base.config import load_config
    from multicard.base.errors import UserError
    from multicard.data import is_small

    if world_size < 1 or batches < 1:
        raise UserError(f"--world-size {world_size} and --batches {batches} must be >= 1")
    cfg = load_config(config, overrides)
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.devices != "cpu" else "cpu")
    ctx = ProcessContext(0, 0, world_size, world_size, device, distributed=False)
    splits = [measure_rank(cfg, rank, world_size, batches, ctx) for rank in range(world_size)]
    slowest = max(splits, key=RankSplit.input_s)
    where = f"data.root={Path(cfg.data.root)}" if cfg.data.root else f"data.name={cfg.data.name}"
    advice = recommend(slowest, cfg.data.name, is_small(cfg.data.image_size), device.type == "cuda")
    return [*map(describe, splits), f"{where}: {advice}"]
