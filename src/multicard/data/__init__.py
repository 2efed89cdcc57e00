"""Datasets and loaders: `build_data` is the one entry point a run uses (the classifier recipe).

This package is the data layer's public surface (`__all__`): the tools and the command line import
from `multicard.data` only, never its stage folders (sources, decoding, augmentation, loading), so
that those can change behind it (tests/test_structure.py checks it).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from multicard.base.config import DataConfig, check_decode
from multicard.base.errors import UserError
from multicard.base.host_memory import available_memory
from multicard.base.store import open_store
from multicard.data.augmentation.device_transform import Augment, DeviceTransform, Finish
from multicard.data.augmentation.mixing import mixing
from multicard.data.augmentation.policies import sample_policy
from multicard.data.augmentation.progressive import ProgressiveSize, progressive_size
from multicard.data.augmentation.transforms import FitSquare, RandomResizedCropFlip, is_small
from multicard.data.decoding.choice import choose_decode
from multicard.data.decoding.decode import decoded, default_cache_dir, fit_square
from multicard.data.decoding.gpu_decode import GpuDecode
from multicard.data.decoding.jpeg_crop import JpegTransform, collate_encoded
from multicard.data.loading.device import DeviceEvalLoader, DeviceTrainLoader, TensorImages
from multicard.data.loading.loaders import Batch, EvalLoader, GeneratedBatches, TrainLoader
from multicard.data.loading.sampling import BatchSplit, ShardedBatchSampler, repeats_note
from multicard.data.loading.transfer import to_device
from multicard.data.loading.workers import Transform, WorkerEvalLoader, WorkerTrainLoader
from multicard.data.sources import shard_format
from multicard.data.sources.encoded import EncodedImage
from multicard.data.sources.folders import (
    Files,
    InMemory,
    Items,
    Source,
    Splits,
    check_same_classes,
    cifar10,
    image_folder,
    scan_folder,
)
from multicard.data.sources.ranks import check_same_across_ranks
from multicard.data.sources.samples import encoded_sample, image_header
from multicard.data.sources.shard_cache import GB, ShardCache
from multicard.data.sources.shards import ShardSamples, order_of, prefetch_items, shard_splits
from multicard.data.sources.synthetic import CLASSES, make_synthetic
from multicard.data.sources.user import decode_items, function_splits, to_picture
from multicard.runtime.process_group import ProcessContext, cpu_cores

__all__ = [
    # a config's sources, and their samples
    "read_splits", "Splits", "Source", "Files", "Items", "InMemory", "sample_list_fingerprint", "EncodedImage",
    "encoded_sample", "image_header", "to_picture", "prefetch_items",
    # packs: the shard format (data/sources/shard_format.py: reading and publishing, any store)
    "shard_format",
    # loaders
    "build_data", "Data", "BatchSplit", "repeats_note", "loader_processes", "loader_for", "capped_to_cores",
    "to_device", "is_small", "default_cache_dir", "generated_data",
    # what a recipe does with a loader's batches: mixup and CutMix, per global batch
    "mixing",
]  # fmt: skip

VAL_SEED_OFFSET = 7919  # the synthetic validation set is drawn from a stream apart from training's
MEMORY_SHARE = 4  # auto uses the device loader when the decoded data takes at most 1/4 of memory
SYNTHETIC_OVERHEAD = 2  # generating takes about twice the images' bytes (float work arrays per chunk)


@dataclass
class Data:
    train: TrainLoader | None
    val: EvalLoader
    num_classes: int
    classes: list[str]
    loader: str  # device | workers
    fingerprint: str | None = None  # of the training samples (sample_list_fingerprint): what a checkpoint records

    def close(self) -> None:
        """Release loader processes (the workers loader's); safe to call more than once."""
        for loader in (self.train, self.val):
            if loader is not None:
                loader.close()


def generated_data(make: Callable[[], Batch], batch: int, steps: int, num_classes: int) -> Data:
    """A run's data of generated micro-batches (GeneratedBatches), its validation the same batches;
    classes named by their index."""
    batches = GeneratedBatches(make, batch, steps)
    return Data(batches, batches, num_classes, [str(c) for c in range(num_classes)], "device")


def read_splits(d: DataConfig, seed: int, need_train: bool = True) -> Splits:
    """Training and validation sources named by the config (nothing decoded yet for folders).

    Evaluating on data.val_root needs no training data: its class folders define the labels.
    """
    if d.val_root and not need_train:
        val, classes = scan_folder(Path(d.val_root), "data.val_root")
        empty = InMemory(torch.empty(0, 3, d.image_size, d.image_size, dtype=torch.uint8), torch.empty(0).long())
        return Splits(empty, val, classes)
    if d.name == "synthetic":
        if not 2 <= d.num_classes <= len(CLASSES):
            raise UserError(f"data.num_classes={d.num_classes} must be in 2..{len(CLASSES)} for synthetic data")
        check_synthetic_fits(d)
        splits = Splits(
            InMemory(*make_synthetic(d.train_size, d.image_size, seed, d.num_classes)),
            InMemory(*make_synthetic(d.val_size, d.image_size, seed + VAL_SEED_OFFSET, d.num_classes)),
            list(CLASSES[: d.num_classes]),
        )
    elif d.name == "cifar10":
        splits = cifar10(Path(d.files_root()), d.download)
    elif ":" in d.name:
        splits = function_splits(d.name, dict(d.kwargs), d.val_fraction, d.split_seed)
    elif d.name == "shards":
        cache = ShardCache(cache_folder(d), round(d.remote_cache_gb * GB)) if d.remote_cache_gb else None
        splits = shard_splits(open_store(d.files_root(), "data.root", d.read_retries), d.reads_in_flight, cache)
    elif d.name == "hf":
        from multicard.data.sources.hf import hf_splits  # imports the optional datasets package

        splits = hf_splits(d)
    else:
        splits = image_folder(Path(d.files_root()), d.val_fraction, d.split_seed)
    if d.val_root:
        val, classes = scan_folder(Path(d.val_root), "data.val_root")
        check_same_classes(splits.classes, classes, Path(d.val_root))
        splits = Splits(splits.train, val, splits.classes)
    return splits


def cache_folder(d: DataConfig) -> Path:
    """Where decoded images and remote shards are cached (data.cache_dir, default ~/.cache/multicard)."""
    return Path(d.cache_dir) if d.cache_dir else default_cache_dir()


def sample_list_fingerprint(source: Source) -> str | None:
    """A cheap digest of a training split's sample list (which samples, in which order, with
    which labels): a resume onto another list is refused (checkpoint/compat.py). Image folders:
    relative paths, sizes and labels (the same files elsewhere match); packed shards: each
    sample's label, length and size from the index (another path or shard size match); in-memory
    data (synthetic, CIFAR-10): labels and shape, the pixels being what the config or the fixed
    files define. A dataset function's or Hugging Face dataset's items are not read twice: None."""
    h = hashlib.sha256(type(source).__name__.encode())
    if isinstance(source, Files):
        h.update("\0".join(source.paths).encode())
        h.update(source.labels.numpy().tobytes())
        if source.sizes is not None:
            h.update(source.sizes.numpy().tobytes())
    elif isinstance(source, InMemory):
        h.update(repr(tuple(source.images.shape)).encode())
        h.update(source.labels.numpy().tobytes())
    elif isinstance(source, Items) and isinstance(source.dataset, ShardSamples):
        h.update(source.dataset.sample_list(source.indices.numpy()))
    else:
        return None
    return h.hexdigest()[:32]


def check_synthetic_fits(d: DataConfig) -> None:
    """The embedded dataset is generated in every process's memory: refuse sizes that would not fit."""
    needed = (d.train_size + d.val_size) * 3 * d.image_size**2 * SYNTHETIC_OVERHEAD
    available = available_memory()
    if needed > available // MEMORY_SHARE:
        raise UserError(
            f"data.train_size={d.train_size} synthetic images of {d.image_size} px take about {needed / 2**30:.1f} GiB "
            f"per process to generate, more than a quarter of the memory available; lower data.train_size "
            f"or data.image_size"
        )


def choose_loader(d: DataConfig, splits: Splits, device: torch.device, local_world_size: int) -> str:
    """This rank's loader: data.loader, or auto's choice (loader_for) for this device's memory."""
    if d.loader == "device" and not is_small(d.image_size):
        raise UserError(
            f"data.loader=device keeps images of up to 64 px decoded; data.image_size={d.image_size} "
            f"needs data.loader=workers (or auto)"
        )
    if d.loader != "auto" or not is_small(d.image_size):
        return loader_for(d, 0, 0)  # the rule needs no sizes here
    needed = (len(splits.train) + len(splits.val)) * 3 * d.image_size**2
    if device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory
    else:
        budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local_world_size
    return loader_for(d, needed, budget)


def loader_for(d: DataConfig, decoded_bytes: float, device_bytes: float) -> str:
    """data.loader=auto's rule: the device loader when images are small and the decoded set
    (`decoded_bytes`) fits a share of the device's memory (`device_bytes`); else the workers."""
    if d.loader != "auto":
        return d.loader
    if not is_small(d.image_size):
        return "workers"
    return "device" if decoded_bytes * MEMORY_SHARE <= device_bytes else "workers"


def _in_memory(source: Source, size: int, cache_dir: Path | None, write: bool, role: str) -> InMemory:
    if isinstance(source, Files):
        return decoded(source, size, cache_dir, write, role)
    if isinstance(source, Items):  # no cheap key to cache by: decoded afresh each run
        return decode_items(source, size)
    if source.images.shape[-2:] != (size, size):
        return InMemory(fit_square(source.images, size), source.labels)
    return source


def loader_processes(requested: int, ctx: ProcessContext) -> int:
    """Loader processes per rank: data.num_workers, or for -1 the rank's share of the cores (at
    most 8), capped to that share (capped_to_cores)."""
    if requested < 0:
        return min(8, max(1, cpu_cores() // ctx.local_world_size))
    return capped_to_cores(requested, f"data.num_workers={requested}", ctx.local_world_size, ctx.is_main)


def capped_to_cores(requested: int, setting: str, local_processes: int, say: bool) -> int:
    """`requested` processes for each of `local_processes` on this machine (data.num_workers, pack
    --workers). More than a process's share of the cores only compete for those cores (and each
    holds memory of its own): capped, said once (`say`: every rank caps alike, one says it)."""
    share = max(1, cpu_cores() // local_processes)
    if requested > share and say:
        print(
            f"multicard: {setting} is more than the {share} core(s) each of the "
            f"{local_processes} process(es) on this machine may use; starting {share} per process",
            file=sys.stderr,
        )
    return min(requested, share)


def worker_transforms(
    d: DataConfig, seed: int, sizes: ProgressiveSize | None
) -> tuple[RandomResizedCropFlip | FitSquare, FitSquare]:
    """What the workers loader's processes do to each training and evaluation image."""
    eval_size = d.eval_size or d.image_size
    small = is_small(d.image_size)
    eval_tf = FitSquare(d.image_size) if small else FitSquare(eval_size, d.eval_resize or round(eval_size * 8 / 7))
    if small or (not d.augment and eval_size == d.image_size):
        return eval_tf, eval_tf
    if not d.augment:  # training images at their own size, though evaluated at another
        return FitSquare(d.image_size, round(d.image_size * 8 / 7)), eval_tf
    scale = (d.crop_scale[0], d.crop_scale[1])  # two numbers (DataConfig.check)
    return RandomResizedCropFlip(d.image_size, scale, flip=True, seed=seed, sizes=sizes), eval_tf


def build_data(d: DataConfig, seed: int, batch_split: BatchSplit | None, ctx: ProcessContext) -> Data:
    """Training (when `batch_split` is given) and validation loaders for this rank.

    The device loader decodes image files once per machine: local rank 0 decodes (or reads the
    cache) and fills the cache first, then the other local ranks read it.
    """
    check_decode(d.decode, ctx.device.type == "cuda")  # before reading anything
    splits = read_splits(d, seed, need_train=batch_split is not None)
    check_same_across_ranks(splits, ctx)  # before anything waits on a peer with other data
    kind = choose_loader(d, splits, ctx.device, ctx.local_world_size)
    small = is_small(d.image_size)
    augment = Augment(d.crop_padding, flip=True) if d.augment and small else None
    sizes = progressive_size(d)
    train_finish: Finish = DeviceTransform(d.mean, d.std, ctx.device, augment, seed, sample_policy(d, seed), sizes)
    eval_finish: Finish = DeviceTransform(d.mean, d.std, ctx.device, None, seed)
    order = order_of(splits.train, d.order)  # data.order=local: runs of neighbours (data/sources/shards.py)
    sampler = (
        ShardedBatchSampler(len(splits.train), batch_split, ctx.rank, seed, d.repeats, order) if batch_split else None
    )
    classes, num_classes = splits.classes, len(splits.classes)
    fingerprint = sample_list_fingerprint(splits.train) if batch_split is not None else None

    if kind == "device":
        loaders = _device_loaders(d, splits, sampler, ctx, train_finish, eval_finish)
        return Data(*loaders, num_classes, classes, kind, fingerprint)

    workers = loader_processes(d.num_workers, ctx)
    cpu_train, cpu_eval = worker_transforms(d, seed, sizes)
    train_tf: Transform = cpu_train
    eval_tf: Transform = cpu_eval
    collate = None
    if choose_decode(d.decode, kind, splits, d.image_size, ctx.device) == "gpu":
        # Workers read the files and plan the crops; nvjpeg decodes and the GPU crops (data/decoding/gpu_decode.py).
        train_tf, eval_tf = JpegTransform(cpu_train), JpegTransform(cpu_eval)
        train_finish = GpuDecode(
            d.mean, d.std, ctx.device, seed, d.image_size, policy=sample_policy(d, seed), sizes=sizes
        )
        eval_finish = GpuDecode(d.mean, d.std, ctx.device, seed, d.eval_size or d.image_size)
        collate = collate_encoded
    val = WorkerEvalLoader(
        splits.val, eval_tf, d.eval_batch_size, ctx.rank, ctx.world_size, eval_finish, workers, seed, collate
    )
    train = None
    if sampler is not None:
        train = WorkerTrainLoader(splits.train, train_tf, sampler, train_finish, workers, seed, ctx.rank, collate)
    return Data(train, val, num_classes, classes, kind, fingerprint)


def _device_loaders(
    d: DataConfig, splits: Splits, sampler: ShardedBatchSampler | None, ctx: ProcessContext,
    train_finish: Finish, eval_finish: Finish,
) -> tuple[DeviceTrainLoader | None, DeviceEvalLoader]:  # fmt: skip
    """The device loader's training (with a sampler) and validation loaders: decoded images in memory."""
    cache_dir = cache_folder(d)
    parts = {"val": splits.val} if sampler is None else {"train": splits.train, "val": splits.val}
    # Local rank 0 fills the cache of decoded files first; items have no cache: every rank decodes at once.
    cached = any(isinstance(src, Files) for src in parts.values())
    with ctx.local_main_first() if cached else contextlib.nullcontext():
        arrays = {role: _in_memory(src, d.image_size, cache_dir, ctx.is_local_main, role)
                  for role, src in parts.items()}  # fmt: skip
    val = DeviceEvalLoader(TensorImages(arrays["val"], ctx.device), d.eval_batch_size, ctx.rank, ctx.world_size,
                           eval_finish)  # fmt: skip
    train = None
    if sampler is not None:
        train = DeviceTrainLoader(TensorImages(arrays["train"], ctx.device), sampler, train_finish)
    return train, val
