"""The data and mix sections: where the images come from, how they are decoded and augmented, and
how batches are mixed; each with its own rules (`check`) and the rules it has with the run's facts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from multicard.base.config.rules import choice, positive, within
from multicard.base.errors import UserError

# or package.module:function (data/sources/user.py)
DATASETS = ("synthetic", "cifar10", "imagefolder", "shards", "hf")
READS_ROOT = ("cifar10", "imagefolder", "shards", "hf")  # the datasets data.root names
LOADERS = ("auto", "device", "workers")
DECODERS = ("cpu", "gpu", "auto")
MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 8, 4096
# images up to this side use the small-image recipe (crop with padding, data/augmentation/transforms.py)
SMALL_IMAGE_MAX = 64
POLICIES = ("none", "trivialaugment", "randaugment", "autoaugment")  # data.policy
MAX_POLICY_OPS, MAX_POLICY_MAGNITUDE = 14, 30  # RandAugment's op count and magnitude bins
MIX_MODES = ("batch", "pair", "elem")  # mix.mode


@dataclass(frozen=True)
class DataConfig:
    # synthetic (embedded) | cifar10 (cifar-10-batches-py) | imagefolder | shards (a folder `multicard pack` wrote,
    # data/sources/shards.py) | hf (a Hugging Face dataset at data.root: save_to_disk or parquet files) |
    # package.module:function (your own dataset function; docs/datasets.md, Your own data)
    name: str = "synthetic"
    kwargs: dict[str, Any] = field(default_factory=dict)  # package.module:function: its keyword arguments
    hf_image: str = "image"  # hf: the image column
    hf_label: str = "label"  # hf: the label column (integers; class names from its ClassLabel feature)
    hf_train_split: str = "train"  # hf: the training split
    hf_val_split: str | None = None  # hf: None = validation, else test, else a seeded data.val_fraction of train
    root: str | None = None  # dataset directory (cifar10, imagefolder, shards); shards: or a URL (s3://bucket/prefix)
    reads_in_flight: int = 8  # shards: reads of a batch kept in flight per loader process (shared storage)
    read_retries: int = 5  # shards at a URL: retries of a read failing transiently, 0.5 s, 1 s, 2 s, … apart
    # shards at a URL: a cache of whole shards on local disk (in cache_dir), shared by the node's processes and
    # runs, of at most this many GB, least recently used evicted (data/sources/shard_cache.py); 0 = off
    remote_cache_gb: float = 0
    # global: a full shuffle each epoch | local (opt-in): shuffled runs of 64 samples stored together, shuffled
    # within windows of 16 runs, so a batch reads few runs of a shard (docs/data.md; its shuffle quality is measured)
    order: str = "global"
    download: bool = False  # cifar10: fetch it into root through torchvision when missing
    val_root: str | None = None  # evaluate on this directory of class folders instead
    val_fraction: float = 0.1  # imagefolder without val/: seeded share of train/ held out
    split_seed: int = 0  # seed of that split; apart from `seed` so runs share one validation set
    loader: str = "auto"  # auto | device (decoded once, batches made on the device) | workers
    # Large images with the workers loader: cpu (workers decode and crop) | gpu (JPEG batches decoded on
    # CUDA with nvjpeg, crops made there) | auto (gpu where CUDA is in use, else cpu)
    decode: str = "cpu"
    num_workers: int = -1  # workers loader: processes per rank; -1 = cores per rank, at most 8; capped to those cores
    cache_dir: str | None = None  # device loader's decoded images, remote_cache_gb's shards; default ~/.cache/multicard
    image_size: int = 32  # side of training images (generated, decoded or cropped)
    eval_resize: int = 0  # large images: resize before the centre crop; 0 = eval_size × 8/7
    eval_size: int = 0  # large images: side of the evaluation crop; 0 = image_size (recipes train smaller)
    train_size: int = 20000  # synthetic: number of training images
    val_size: int = 5000  # synthetic: number of validation images
    num_classes: int = 10  # synthetic: 2..10 (other datasets: the number of class folders)
    augment: bool = True  # small images: random crop with padding + flip; large: random resized crop + flip
    # Per-sample policy after the crop and flip (torchvision's, drawn per seed, epoch and sample;
    # data/augmentation/policies.py):
    # none | trivialaugment | randaugment (policy_ops, policy_magnitude) | autoaugment (ImageNet policy)
    policy: str = "none"
    policy_ops: int = 2  # randaugment: ops per image
    policy_magnitude: int = 9  # randaugment: 0..30
    color_jitter: float = 0.0  # brightness, contrast and saturation by up to ± this fraction; 0 = off
    random_erasing: float = 0.0  # probability of erasing one rectangle of a training image; 0 = off
    # Repeated augmentation: an epoch holds 1/repeats of the samples, each `repeats` times with different
    # augmentations, its copies spread over the global batch (MixConfig.check_repeats, docs/recipes.md); 1 = off
    repeats: int = 1
    # Progressive resizing (data/augmentation/progressive.py): training images of this side until
    # progressive_start_epoch, growing to image_size by progressive_end_epoch in steps of progressive_multiple; 0 = off
    progressive_min_size: int = 0
    progressive_start_epoch: int = 0
    progressive_end_epoch: int = 0
    progressive_multiple: int = 32
    progressive_recompile: bool = False  # let compile's CUDA-graph modes re-record for every training size
    crop_padding: int = 4
    crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])  # large images: area range
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list[float] = field(default_factory=lambda: [0.25, 0.25, 0.25])
    eval_batch_size: int = 500  # per process

    def files_root(self) -> str:
        """data.root of a dataset that reads files (READS_ROOT), which check() requires."""
        assert self.root, f"data.name={self.name} has no data.root: the config was not checked"
        return self.root

    def check(self) -> None:
        """Range and choice checks of the data section."""
        if ":" not in self.name and self.name not in DATASETS:  # a function is checked when it is imported
            raise UserError(f"data.name={self.name} is not one of {', '.join(DATASETS)}, or package.module:function")
        choice(self.loader, "data.loader", LOADERS)
        choice(self.decode, "data.decode", DECODERS)
        if self.name in READS_ROOT and not self.root:
            raise UserError(f"data.name={self.name} reads files: set data.root=DIR")
        if not 0 < self.val_fraction < 1:
            raise UserError(f"data.val_fraction={self.val_fraction} must be between 0 and 1")
        positive(self.reads_in_flight, "data.reads_in_flight")
        positive(self.read_retries, "data.read_retries", zero_ok=True)
        positive(self.remote_cache_gb, "data.remote_cache_gb", zero_ok=True)
        choice(self.order, "data.order", ("global", "local"))
        if self.num_workers < -1:
            raise UserError(f"data.num_workers={self.num_workers} must be -1 (auto) or >= 0")
        lo, hi = self.crop_scale if len(self.crop_scale) == 2 else (0, 0)
        if not 0 < lo <= hi <= 1:
            raise UserError("data.crop_scale needs 2 values with 0 < min <= max <= 1, e.g. [0.08,1.0]")
        within(self.image_size, "data.image_size", MIN_IMAGE_SIZE, MAX_IMAGE_SIZE, hi_open=False)
        positive(self.train_size, "data.train_size")
        positive(self.val_size, "data.val_size")
        positive(self.eval_batch_size, "data.eval_batch_size")
        positive(self.crop_padding, "data.crop_padding", zero_ok=True)
        positive(self.eval_resize, "data.eval_resize", zero_ok=True)
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise UserError("data.mean and data.std need 3 values each, std > 0")
        self.check_augmentation()
        positive(self.repeats, "data.repeats")
        self.check_eval_size()

    def check_eval_size(self) -> None:
        if self.eval_size:
            within(self.eval_size, "data.eval_size", MIN_IMAGE_SIZE, MAX_IMAGE_SIZE, hi_open=False)
            if self.image_size <= SMALL_IMAGE_MAX or self.eval_size <= SMALL_IMAGE_MAX:
                raise UserError(
                    f"data.eval_size={self.eval_size} applies to images larger than {SMALL_IMAGE_MAX} px (small "
                    f"images are evaluated at data.image_size={self.image_size}); set data.eval_size=0"
                )

    def check_augmentation(self) -> None:
        """The per-sample policy options and progressive resizing."""
        choice(self.policy, "data.policy", POLICIES)
        within(self.policy_ops, "data.policy_ops", 1, MAX_POLICY_OPS, hi_open=False)
        within(self.policy_magnitude, "data.policy_magnitude", 0, MAX_POLICY_MAGNITUDE, hi_open=False)
        within(self.color_jitter, "data.color_jitter", 0, 1)
        within(self.random_erasing, "data.random_erasing", 0, 1, hi_open=False)
        if self.progressive_min_size:
            within(self.progressive_min_size, "data.progressive_min_size", MIN_IMAGE_SIZE, self.image_size,
                   hi_open=False)  # fmt: skip
            positive(self.progressive_multiple, "data.progressive_multiple")
            if not 0 <= self.progressive_start_epoch <= self.progressive_end_epoch:
                raise UserError(
                    f"data.progressive_start_epoch={self.progressive_start_epoch} and data.progressive_end_epoch="
                    f"{self.progressive_end_epoch} must satisfy 0 <= start <= end"
                )

    def check_compile(self, compile_mode: str | None) -> None:
        """CUDA graphs (compile's reduce-overhead and max-autotune modes) hold one input shape: a size
        that changes with the epoch re-records them, which is refused unless asked for."""
        if self.progressive_min_size and compile_mode in ("reduce-overhead", "max-autotune"):
            if not self.progressive_recompile:
                raise UserError(
                    f"progressive resizing changes the input shape that compile_mode={compile_mode}'s CUDA graphs "
                    f"hold; set data.progressive_recompile=true to re-record them at each size, or "
                    f"compile_mode=max-autotune-no-cudagraphs"
                )


def check_decode(decode: str, cuda: bool) -> None:
    """data.decode=gpu needs a CUDA device; checked before anything is read (and before launch)."""
    if decode == "gpu" and not cuda:
        raise UserError(
            "data.decode=gpu decodes JPEGs on a CUDA GPU (nvjpeg) but this run uses none; "
            "use data.decode=cpu, or data.decode=auto (gpu where CUDA is in use, else cpu)"
        )


@dataclass(frozen=True)
class MixConfig:
    """Mixup and CutMix of training batches, on the device (data/augmentation/mixing.py); both alphas 0 = off."""

    mixup_alpha: float = 0.0  # λ ~ Beta(alpha, alpha); timm's recipes use 0.8 (0.2 for ResNets)
    cutmix_alpha: float = 0.0  # the same for CutMix's box; 1.0 in timm's recipes
    prob: float = 1.0  # probability that a batch / pair / sample is mixed at all
    switch_prob: float = 0.5  # with both alphas > 0: probability of CutMix rather than mixup
    mode: str = "batch"  # batch (one draw per global batch) | pair | elem (one per sample)

    def check(self) -> None:
        positive(self.mixup_alpha, "mix.mixup_alpha", zero_ok=True)
        positive(self.cutmix_alpha, "mix.cutmix_alpha", zero_ok=True)
        within(self.prob, "mix.prob", 0, 1, hi_open=False)
        within(self.switch_prob, "mix.switch_prob", 0, 1, hi_open=False)
        choice(self.mode, "mix.mode", MIX_MODES)

    def check_repeats(self, repeats: int, global_batch: int) -> None:
        """Repeated augmentation (data.repeats) fills each global batch with whole sets of copies, and its
        copies never form a mixing pair: copies stand B/repeats positions apart (data/loading/sampling.py's
        repeated_order) and a pair is positions 2k, 2k+1 (data/augmentation/mixing.py), so only a global
        batch of copies of one sample (B/repeats = 1) pairs a sample with itself. Whatever the world size."""
        if global_batch % repeats:
            raise UserError(
                f"data.repeats={repeats} copies of each sample share a global batch: make "
                f"train.global_batch_size={global_batch} a multiple of it"
            )
        if repeats > 1 and global_batch == repeats and (self.mixup_alpha or self.cutmix_alpha):
            raise UserError(
                f"data.repeats={repeats} fills each global batch of {global_batch} with copies of one sample, which "
                f"mixup and CutMix would mix with itself; lower data.repeats to at most {global_batch // 2} "
                f"or raise train.global_batch_size to {2 * global_batch}"
            )

    def check_pairs(self, micro_batch: int, global_batch: int, world_size: int, grad_accum: int) -> None:
        """Pairs never straddle two processes or micro-steps: every micro-batch is even."""
        if (self.mixup_alpha or self.cutmix_alpha) and micro_batch % 2:
            raise UserError(
                f"mixup and CutMix pair neighbouring samples, so each process's micro-batch must be even, but "
                f"train.global_batch_size={global_batch} over {world_size} process(es) × "
                f"train.grad_accum={grad_accum} gives {micro_batch}; make it even"
            )
