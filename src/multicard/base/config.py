"""Typed configuration: dataclass defaults < YAML file < dotted KEY=VALUE overrides.

OmegaConf does the merging and type checking; this module turns its errors into one-line
`UserError`s and checks the value ranges it cannot express. The result is read-only.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from multicard.base.errors import UserError
from multicard.base.storage import URL, check_url, is_url

STRATEGIES = ("auto", "single", "dp", "ddp", "fsdp")
PRECISIONS = ("fp32", "bf16", "fp16", "fp64")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("cosine", "linear", "step", "constant")
LR_SCALING = ("none", "linear", "sqrt")
# or package.module:function (data/sources/user.py)
DATASETS = ("synthetic", "cifar10", "imagefolder", "shards", "hf")
READS_ROOT = ("cifar10", "imagefolder", "shards", "hf")  # the datasets data.root names
LOADERS = ("auto", "device", "workers")
DECODERS = ("cpu", "gpu", "auto")
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
REPLICATE = ("none", "nodes")
CHECKPOINT_FORMATS = ("auto", "file", "sharded")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
MAX_THREADS = 256  # per process; beyond this torch itself fails (and no node has that many cores per process)
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
    cache_dir: str | None = None  # device loader's decoded-image cache; default ~/.cache/multicard
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
    # augmentations, its copies spread over the global batch (config.check_repeats, docs/recipes.md); 1 = off
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


@dataclass(frozen=True)
class ModelConfig:
    name: str = "resnet18"  # torchvision name, resnet18_cifar, smallcnn, or package.module:function
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments for the builder
    channels_last: bool = False
    # Initial weights (fine-tuning): a multicard checkpoint or a state dict file; tensors load by name
    # where shapes agree, the rest keep their initialisation. A resumed run takes its checkpoint's instead.
    weights: str | None = None


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 10
    max_steps: int = 0  # stop after this many optimizer steps in total; 0 = no limit
    global_batch_size: int = 256  # samples per optimizer step, across all devices and micro-steps
    grad_accum: int = 1  # micro-steps per optimizer step
    label_smoothing: float = 0.0  # training loss only; evaluation reports plain cross-entropy
    resume: str = "auto"  # auto: continue from out_dir's newest valid checkpoint | never | PATH


@dataclass(frozen=True)
class MixConfig:
    """Mixup and CutMix of training batches, on the device (data/augmentation/mixing.py); both alphas 0 = off."""

    mixup_alpha: float = 0.0  # λ ~ Beta(alpha, alpha); timm's recipes use 0.8 (0.2 for ResNets)
    cutmix_alpha: float = 0.0  # the same for CutMix's box; 1.0 in timm's recipes
    prob: float = 1.0  # probability that a batch / pair / sample is mixed at all
    switch_prob: float = 0.5  # with both alphas > 0: probability of CutMix rather than mixup
    mode: str = "batch"  # batch (one draw per global batch) | pair | elem (one per sample)


@dataclass(frozen=True)
class EMAConfig:
    """An exponential moving average of the weights (ema.py), validated beside the model and kept in
    checkpoints; `multicard eval --ema` and `multicard export --ema` use it."""

    decay: float = 0.0  # weight of the old average at each update; 0 = off
    every: int = 1  # optimizer steps between updates
    start_epoch: float = 0.0  # until then an update copies the model (torchvision's recipes: the warm-up)


@dataclass(frozen=True)
class OptimConfig:
    name: str = "sgd"
    lr: float = 0.1  # peak learning rate at base_batch_size (see lr_scaling)
    lr_scaling: str = "none"  # none | linear | sqrt: lr × (global_batch_size / base_batch_size)^p
    base_batch_size: int = 256
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    decay_bias_and_norm: bool = False  # also decay 1-D parameters (biases, norm weights), as older recipes do
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw
    fused: bool = True  # one fused kernel per step where torch has it (same update, far less memory traffic)


@dataclass(frozen=True)
class SchedConfig:
    name: str = "cosine"  # cosine | linear (to final_lr_ratio) | step | constant, after the warm-up
    warmup_epochs: float = 0.0  # linear warm-up from 0, counted in (fractional) epochs
    warmup_start: float = 0.0  # the warm-up's first lr as a fraction of the peak (torchvision's recipes: 0.01)
    per_epoch: bool = False  # the lr changes once an epoch (torchvision's reference scripts), not every step
    final_lr_ratio: float = 0.0  # cosine, linear: last lr as a fraction of the peak
    step_epochs: int = 30  # step: decay every this many epochs
    gamma: float = 0.1  # step: decay factor


@dataclass(frozen=True)
class DDPConfig:
    bucket_cap_mb: float = 25.0  # gradients are all-reduced in buckets of about this size, during backward
    static_graph: bool = False  # the graph is the same every step: lets DDP skip per-step bookkeeping
    # Gradients live in the all-reduce buckets: one copy of them fewer per step, and their memory
    # (same maths; on by default: ddp×2 resnet18 steps 5% faster on CPU, docs/benchmarks.md)
    gradient_as_bucket_view: bool = True
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    # Opt-in gradient compression; changes the maths (see docs/benchmarks.md for its accuracy effect):
    # none | fp16 | bf16 (all-reduce in 16 bits) | powersgd (low-rank, with error feedback; CUDA only)
    comm_hook: str = "none"
    powersgd_rank: int = 1  # powersgd: rank of the gradient approximation
    powersgd_start_step: int = 10  # powersgd: plain all-reduce before this optimizer step
    # ZeRO-1: each rank keeps the optimizer state of its share of the parameters (torch's
    # ZeroRedundancyOptimizer); checkpoints still hold the whole optimizer state
    shard_optimizer: bool = False


@dataclass(frozen=True)
class FSDPConfig:
    """strategy=fsdp: parameters, gradients and optimizer state sharded over ranks (FSDP2's fully_shard)."""

    # true: ZeRO-3 (parameters gathered again for backward: least memory); false: ZeRO-2 (kept from
    # forward to backward: one all-gather fewer per step)
    reshard_after_forward: bool = True
    # Module class names sharded as units (then the root), e.g. [BasicBlock]; [] = chosen per model family
    units: list[str] = field(default_factory=list)
    # Models of no known family: every module of at least this many parameters whose children are all
    # smaller becomes a unit
    min_unit_params: int = 1_000_000
    # nodes: HSDP — shard inside each node, replicate across nodes (a 2-D device mesh); none: shard over all
    replicate: str = "none"
    # CPU only: true hands freed unit-sized buffers back to the system at once (least memory; each
    # step's buffers then fault their pages in anew: slower); false lets glibc keep them (faster, more
    # resident); auto: true where the process runs under a memory limit (a cgroup's), else false
    cpu_release_memory: str = "auto"


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 0  # also save inside epochs, every this many optimizer steps; 0 = epoch ends only
    keep_last: int = 3  # step checkpoints kept (best and last are kept besides)
    # file: step-N.pt written by rank 0; sharded: step-N/ with one shard per rank (torch.distributed.checkpoint);
    # auto: sharded under fsdp, else file. Any strategy and world size reads either.
    format: str = "auto"
    # sharded: write in the background while training goes on (costs one CPU copy of each rank's state)
    async_save: bool = False
    # A signal to multicard's launcher: seconds the workers get to write the stop's checkpoint and
    # exit before they are killed (torch's agent alone would give 30)
    stop_timeout_s: float = 300.0
    # Where checkpoints go: None = out_dir/checkpoints; a local path, or a URL (s3://bucket/run1/checkpoints,
    # any fsspec protocol): there a checkpoint exists once its commit object, written last, says so
    dir: str | None = None


@dataclass(frozen=True)
class DebugConfig:
    # Seconds without progress on any rank before a stall is reported (stacks of every rank in
    # out_dir/stall/); auto: the larger of 120 s and 20 × the median step, from the first step on; 0: off
    stall_s: Any = "auto"
    on_stall: str = "report"  # report: say it and keep waiting | abort: end the job (exit 5)


@dataclass(frozen=True)
class LogConfig:
    tensorboard: bool = False  # scalars in out_dir/tensorboard (rank 0; pip install 'multicard[tensorboard]')
    # Experiment trackers, rank 0, TensorBoard's scalars at its steps plus config, final metrics, report
    # figure (docs/tracking.md). MLflow: pip install 'multicard[mlflow]'
    mlflow: bool = False
    mlflow_uri: str | None = None  # tracking URI; None: MLFLOW_TRACKING_URI, else out_dir/mlruns
    mlflow_experiment: str | None = None  # None: MLFLOW_EXPERIMENT_NAME, else multicard
    wandb: bool = False  # Weights & Biases in out_dir/wandb: pip install 'multicard[wandb]'
    wandb_project: str | None = None  # None: WANDB_PROJECT, else multicard
    wandb_mode: str = "auto"  # auto: WANDB_MODE, else offline (sync later: wandb sync) | offline | online
    on_tracker_error: str = "warn"  # warn: one warning, train on without that tracker | fail: end the run (exit 2)


@dataclass(frozen=True)
class NetConfig:
    # Interface(s) for gloo/NCCL traffic between nodes, e.g. eth1 or ib0 (exact names, comma-separated
    # for several): sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME unless they are exported already
    # (the exported value wins). None = the libraries choose (the host name's address for gloo).
    socket_ifname: str | None = None


@dataclass(frozen=True)
class Config:
    strategy: str = "auto"  # single | dp | ddp | fsdp; auto: ddp when a launcher started the process, else single
    devices: Any = "auto"  # auto | cpu | list of GPU ids, e.g. [0,1]
    seed: int = 0
    out_dir: str = "runs/default"
    precision: str = "fp32"
    sync_bn: bool = False  # ddp: BatchNorm statistics over the global batch (CUDA and CPU); single: no effect
    compile: bool = False  # torch.compile the model before the strategy wraps it; the first steps pay compilation
    compile_mode: str = "default"  # default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    cudnn_benchmark: bool = False  # CUDA: cuDNN picks the fastest conv algorithms by timing (not bitwise reproducible)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    eval_flip: bool = False  # evaluation averages the logits of each image and of its mirror image (test-time flip)
    train: TrainConfig = field(default_factory=TrainConfig)
    mix: MixConfig = field(default_factory=MixConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    clip_grad_norm: float = 0.0  # max global gradient norm; 0 = off
    sched: SchedConfig = field(default_factory=SchedConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    threads: int = 0  # CPU threads per process; 0 = cores / local processes
    dist_timeout_s: int = 300  # collective timeout: a stuck rank ends the job after this
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    net: NetConfig = field(default_factory=NetConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    log_every: int = 50  # optimizer steps between step records (and host syncs)
    log: LogConfig = field(default_factory=LogConfig)


def _one_line(exc: OmegaConfBaseException) -> str:
    if isinstance(exc, ConfigKeyError) and getattr(exc, "key", None) is not None:
        key = exc.full_key or exc.key
        return f"unknown key '{key}'; check its spelling against multicard's config (README, Configuration)"
    msg = str(exc).splitlines()[0].strip()
    key = getattr(exc, "full_key", None)
    if key and key not in msg:
        msg = f"{key}: {msg}"
    return msg


def load_config(
    path: str | None = None, overrides: list[str] | None = None, defaults: dict[str, Any] | None = None
) -> Config:
    """Build the frozen config from defaults, an optional YAML file and overrides.

    `defaults` (dotted keys) replace the built-in defaults and lose to the file and overrides:
    bench and verify use them for their own workload.
    """
    node = OmegaConf.structured(Config)
    if defaults:
        node = _merge(node, OmegaConf.from_dotlist([f"{k}={v}" for k, v in defaults.items()]))
    if path is not None:
        file = Path(path).expanduser()
        if file.is_dir():
            raise UserError(f"--config {path} is a directory; pass a YAML file, e.g. {path}/demo.yaml")
        if not file.is_file():
            raise UserError(f"config file not found: {path} (pass an existing YAML file to --config)")
        try:
            loaded = OmegaConf.load(file)
        except Exception as exc:  # YAML syntax errors and the like
            raise UserError(f"bad config file {path}: {_yaml_problem(exc)}") from None
        if not isinstance(loaded, DictConfig):
            raise UserError(f"config file {path} must hold a mapping of keys to values")
        node = _merge(node, loaded)
    return _finish(node, overrides)


def _yaml_problem(exc: Exception) -> str:
    """'line L, column C: what is wrong' for YAML syntax errors, else the first line."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return str(exc).splitlines()[0]


def config_from_dict(data: dict, overrides: list[str] | None = None) -> Config:
    """Rebuild a config saved in a checkpoint (or by to_dict), then apply overrides."""
    return _finish(_merge(OmegaConf.structured(Config), OmegaConf.create(data)), overrides)


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """A copy of `cfg` with dotted KEY=VALUE overrides applied and validated."""
    return config_from_dict(to_dict(cfg), overrides)


def _merge(base: DictConfig, other: DictConfig) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise UserError(f"bad config: {_one_line(exc)}") from None


def _finish(node: DictConfig, overrides: list[str] | None) -> Config:
    for item in overrides or []:
        if "=" not in item:
            raise UserError(f"override '{item}' is not KEY=VALUE (for example train.epochs=5)")
        try:
            dotlist = OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as exc:
            raise UserError(f"bad override '{item}': {_one_line(exc)}") from None
        node = _merge(node, dotlist)
    try:
        cfg: Config = OmegaConf.to_object(node)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise UserError(f"bad config: {_one_line(exc)}") from None
    validate(cfg)
    return _expand_home(cfg)


def _expand_home(cfg: Config) -> Config:
    """`~` in paths means the home directory, as in a shell (out_dir=~/runs/x)."""

    def expand(path: str | None) -> str | None:
        return os.path.expanduser(path) if path else path

    resume = cfg.train.resume if cfg.train.resume in ("auto", "never") else expand(cfg.train.resume)
    return dataclasses.replace(
        cfg,
        out_dir=expand(cfg.out_dir),
        data=dataclasses.replace(
            cfg.data,
            root=expand(cfg.data.root),
            val_root=expand(cfg.data.val_root),
            cache_dir=expand(cfg.data.cache_dir),
        ),
        model=dataclasses.replace(cfg.model, weights=expand(cfg.model.weights)),
        train=dataclasses.replace(cfg.train, resume=resume),
        checkpoint=dataclasses.replace(cfg.checkpoint, dir=expand(cfg.checkpoint.dir)),
    )


def check_local_path(value: str | None, name: str) -> None:
    """A path multicard reads or writes is a local one (a mounted filesystem counts): a URL is one
    line, never a local folder named after its scheme (s3:/bucket/... in the working directory)."""
    match = URL.match(value or "")
    if match:
        given = f"{name} {value}" if name.startswith("-") else f"{name}={value}"
        if name == "out_dir":  # the run's own files stay local; its checkpoints may go to the bucket
            raise UserError(
                f"{given} is a URL ({match[1]}://); out_dir holds the run's logs and stays local: give a local "
                f"out_dir and put the checkpoints on object storage with checkpoint.dir={value.rstrip('/')}/checkpoints"
            )
        raise UserError(
            f"{given} is a URL ({match[1]}://); multicard reads and writes local paths only (a mounted "
            f"filesystem works): copy the data or mount the bucket, and give its local path"
        )


# Keys whose value may be a URL, read (and for checkpoint.dir written) through fsspec: base/storage.py.
URL_KEYS = ("checkpoint.dir", "train.resume", "model.weights")


def check_paths(cfg: Config) -> None:
    """Every path of the config is local (check_local_path), but a pack's data.root and URL_KEYS: a URL
    there is read through fsspec (multicard/base/storage.py)."""
    resume = cfg.train.resume if cfg.train.resume not in ("auto", "never") else None
    root_url = cfg.data.name == "shards" and is_url(cfg.data.root)
    if root_url:
        check_url(cfg.data.root, "data.root")
    for name, value in zip(URL_KEYS, (cfg.checkpoint.dir, resume, cfg.model.weights), strict=True):
        if is_url(value):
            check_url(value, name)
    root = None if root_url else cfg.data.root
    for name, value in (("out_dir", cfg.out_dir), ("data.root", root), ("data.val_root", cfg.data.val_root),
                        ("data.cache_dir", cfg.data.cache_dir)):  # fmt: skip
        check_local_path(value, name)


def _choice(value: str, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"{name}={value} is not one of {', '.join(choices)}")


def _positive(value: float, name: str, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise UserError(f"{name}={value} must be {bound}")


def _finite(node: Any, name: str = "") -> None:
    """No NaN or infinity anywhere: they pass range checks (nan < 0 is False) and end runs later."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            _finite(getattr(node, f.name), f"{name}.{f.name}" if name else f.name)
    elif isinstance(node, float) and not math.isfinite(node):
        raise UserError(f"{name}={node} must be a finite number")
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            _finite(item, f"{name}[{i}]")


def _within(value: float, name: str, lo: float, hi: float, hi_open: bool = True) -> None:
    if not (lo <= value < hi if hi_open else lo <= value <= hi):
        raise UserError(f"{name}={value} must be in [{lo:g}, {hi:g}{')' if hi_open else ']'}")


def validate(cfg: Config) -> None:
    """Range and choice checks that the types alone do not express."""
    _finite(cfg)
    check_paths(cfg)
    _choice(cfg.strategy, "strategy", STRATEGIES)
    _choice(cfg.precision, "precision", PRECISIONS)
    _choice(cfg.optim.name, "optim.name", OPTIMIZERS)
    _choice(cfg.optim.lr_scaling, "optim.lr_scaling", LR_SCALING)
    _choice(cfg.sched.name, "sched.name", SCHEDULES)
    check_data(cfg.data)
    check_mix(cfg.mix)
    check_repeats(cfg)
    _within(cfg.ema.decay, "ema.decay", 0, 1)
    _positive(cfg.ema.every, "ema.every")
    _positive(cfg.ema.start_epoch, "ema.start_epoch", zero_ok=True)
    check_schedule(cfg.sched)
    check_progressive_compile(cfg)
    _choice(cfg.debug.on_stall, "debug.on_stall", ("report", "abort"))
    _choice(cfg.log.wandb_mode, "log.wandb_mode", ("auto", "offline", "online"))
    _choice(cfg.log.on_tracker_error, "log.on_tracker_error", ("warn", "fail"))
    stall_seconds(cfg.debug)
    check_parallel(cfg)
    _choice(cfg.compile_mode, "compile_mode", COMPILE_MODES)
    parse_devices(cfg.devices)
    _positive(cfg.train.global_batch_size, "train.global_batch_size")
    _positive(cfg.train.grad_accum, "train.grad_accum")
    _positive(cfg.train.epochs, "train.epochs")
    _positive(cfg.train.max_steps, "train.max_steps", zero_ok=True)
    if not 0 <= cfg.train.label_smoothing < 1:
        raise UserError(f"train.label_smoothing={cfg.train.label_smoothing} must be in [0, 1)")
    check_optim(cfg.optim)
    _positive(cfg.sched.warmup_epochs, "sched.warmup_epochs", zero_ok=True)
    _positive(cfg.sched.step_epochs, "sched.step_epochs")
    _positive(cfg.clip_grad_norm, "clip_grad_norm", zero_ok=True)
    _positive(cfg.log_every, "log_every")
    _positive(cfg.checkpoint.every_steps, "checkpoint.every_steps", zero_ok=True)
    _positive(cfg.checkpoint.keep_last, "checkpoint.keep_last")
    _positive(cfg.checkpoint.stop_timeout_s, "checkpoint.stop_timeout_s")
    _within(cfg.threads, "threads", 0, MAX_THREADS, hi_open=False)
    _positive(cfg.seed, "seed", zero_ok=True)
    _positive(cfg.dist_timeout_s, "dist_timeout_s")
    if cfg.train.global_batch_size % cfg.train.grad_accum:
        raise UserError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by "
            f"train.grad_accum={cfg.train.grad_accum}; change one of them"
        )


def check_parallel(cfg: Config) -> None:
    """The ddp, fsdp and checkpoint sections' choices and ranges (their fit with the strategy: topology)."""
    _choice(cfg.ddp.comm_hook, "ddp.comm_hook", COMM_HOOKS)
    _choice(cfg.fsdp.replicate, "fsdp.replicate", REPLICATE)
    _choice(cfg.fsdp.cpu_release_memory.lower(), "fsdp.cpu_release_memory", ("auto", "true", "false"))
    _choice(cfg.checkpoint.format, "checkpoint.format", CHECKPOINT_FORMATS)
    _positive(cfg.fsdp.min_unit_params, "fsdp.min_unit_params")
    _positive(cfg.ddp.bucket_cap_mb, "ddp.bucket_cap_mb")
    _positive(cfg.ddp.powersgd_rank, "ddp.powersgd_rank")
    if cfg.ddp.powersgd_start_step < 2:
        raise UserError(f"ddp.powersgd_start_step={cfg.ddp.powersgd_start_step} must be >= 2 (error feedback needs it)")


def check_optim(o: OptimConfig) -> None:
    """The optim section's ranges."""
    _positive(o.lr, "optim.lr")
    _positive(o.base_batch_size, "optim.base_batch_size")
    _positive(o.weight_decay, "optim.weight_decay", zero_ok=True)
    _within(o.momentum, "optim.momentum", 0, 1)
    for i, beta in enumerate(o.betas):
        _within(beta, f"optim.betas[{i}]", 0, 1)
    if len(o.betas) != 2:
        raise UserError("optim.betas needs 2 values, e.g. optim.betas=[0.9,0.999]")


def check_data(d: DataConfig) -> None:
    """Range and choice checks of the data section."""
    if ":" not in d.name and d.name not in DATASETS:  # a function is checked when it is imported
        raise UserError(f"data.name={d.name} is not one of {', '.join(DATASETS)}, or package.module:function")
    _choice(d.loader, "data.loader", LOADERS)
    _choice(d.decode, "data.decode", DECODERS)
    if d.name in READS_ROOT and not d.root:
        raise UserError(f"data.name={d.name} reads files: set data.root=DIR")
    if not 0 < d.val_fraction < 1:
        raise UserError(f"data.val_fraction={d.val_fraction} must be between 0 and 1")
    _positive(d.reads_in_flight, "data.reads_in_flight")
    _positive(d.read_retries, "data.read_retries", zero_ok=True)
    _choice(d.order, "data.order", ("global", "local"))
    if d.num_workers < -1:
        raise UserError(f"data.num_workers={d.num_workers} must be -1 (auto) or >= 0")
    lo, hi = d.crop_scale if len(d.crop_scale) == 2 else (0, 0)
    if not 0 < lo <= hi <= 1:
        raise UserError("data.crop_scale needs 2 values with 0 < min <= max <= 1, e.g. [0.08,1.0]")
    _within(d.image_size, "data.image_size", MIN_IMAGE_SIZE, MAX_IMAGE_SIZE, hi_open=False)
    _positive(d.train_size, "data.train_size")
    _positive(d.val_size, "data.val_size")
    _positive(d.eval_batch_size, "data.eval_batch_size")
    _positive(d.crop_padding, "data.crop_padding", zero_ok=True)
    _positive(d.eval_resize, "data.eval_resize", zero_ok=True)
    if len(d.mean) != 3 or len(d.std) != 3 or min(d.std) <= 0:
        raise UserError("data.mean and data.std need 3 values each, std > 0")
    check_augmentation(d)
    _positive(d.repeats, "data.repeats")
    if d.eval_size:
        _within(d.eval_size, "data.eval_size", MIN_IMAGE_SIZE, MAX_IMAGE_SIZE, hi_open=False)
        if d.image_size <= SMALL_IMAGE_MAX or d.eval_size <= SMALL_IMAGE_MAX:
            raise UserError(
                f"data.eval_size={d.eval_size} applies to images larger than {SMALL_IMAGE_MAX} px (small images are "
                f"evaluated at data.image_size={d.image_size}); set data.eval_size=0"
            )


def check_schedule(s: SchedConfig) -> None:
    """The warm-up's start and the schedule's floor, as fractions of the peak lr."""
    _within(s.warmup_start, "sched.warmup_start", 0, 1)
    _within(s.final_lr_ratio, "sched.final_lr_ratio", 0, 1, hi_open=False)


def check_mix(m: MixConfig) -> None:
    """Mixup and CutMix options."""
    _positive(m.mixup_alpha, "mix.mixup_alpha", zero_ok=True)
    _positive(m.cutmix_alpha, "mix.cutmix_alpha", zero_ok=True)
    _within(m.prob, "mix.prob", 0, 1, hi_open=False)
    _within(m.switch_prob, "mix.switch_prob", 0, 1, hi_open=False)
    _choice(m.mode, "mix.mode", MIX_MODES)


def check_repeats(cfg: Config) -> None:
    """Repeated augmentation fills each global batch with whole sets of copies, and its copies
    never form a mixing pair: copies stand B/repeats positions apart (data/loading/sampling.py's
    repeated_order) and a pair is positions 2k, 2k+1 (data/augmentation/mixing.py), so only a global batch of
    copies of one sample (B/repeats = 1) pairs a sample with itself. Whatever the world size."""
    batch, repeats = cfg.train.global_batch_size, cfg.data.repeats
    if batch % repeats:
        raise UserError(
            f"data.repeats={repeats} copies of each sample share a global batch: make "
            f"train.global_batch_size={batch} a multiple of it"
        )
    if repeats > 1 and batch == repeats and (cfg.mix.mixup_alpha or cfg.mix.cutmix_alpha):
        raise UserError(
            f"data.repeats={repeats} fills each global batch of {batch} with copies of one sample, which mixup and "
            f"CutMix would mix with itself; lower data.repeats to at most {batch // 2} "
            f"or raise train.global_batch_size to {2 * batch}"
        )


def check_augmentation(d: DataConfig) -> None:
    """The per-sample policy options of the data section."""
    _choice(d.policy, "data.policy", POLICIES)
    _within(d.policy_ops, "data.policy_ops", 1, MAX_POLICY_OPS, hi_open=False)
    _within(d.policy_magnitude, "data.policy_magnitude", 0, MAX_POLICY_MAGNITUDE, hi_open=False)
    _within(d.color_jitter, "data.color_jitter", 0, 1)
    _within(d.random_erasing, "data.random_erasing", 0, 1, hi_open=False)
    if d.progressive_min_size:
        _within(d.progressive_min_size, "data.progressive_min_size", MIN_IMAGE_SIZE, d.image_size, hi_open=False)
        _positive(d.progressive_multiple, "data.progressive_multiple")
        if not 0 <= d.progressive_start_epoch <= d.progressive_end_epoch:
            raise UserError(
                f"data.progressive_start_epoch={d.progressive_start_epoch} and data.progressive_end_epoch="
                f"{d.progressive_end_epoch} must satisfy 0 <= start <= end"
            )


def check_progressive_compile(cfg: Config) -> None:
    """CUDA graphs (compile's reduce-overhead and max-autotune modes) hold one input shape: a size
    that changes with the epoch re-records them, which is refused unless asked for."""
    d = cfg.data
    if d.progressive_min_size and cfg.compile and cfg.compile_mode in ("reduce-overhead", "max-autotune"):
        if not d.progressive_recompile:
            raise UserError(
                f"progressive resizing changes the input shape that compile_mode={cfg.compile_mode}'s CUDA graphs "
                f"hold; set data.progressive_recompile=true to re-record them at each size, or "
                f"compile_mode=max-autotune-no-cudagraphs"
            )


def stall_seconds(debug: DebugConfig) -> float | None:
    """debug.stall_s as seconds; None for auto (decided from step times), 0 for off."""
    if debug.stall_s == "auto":
        return None
    if isinstance(debug.stall_s, bool) or not isinstance(debug.stall_s, (int, float)) or debug.stall_s < 0:
        raise UserError(f"debug.stall_s={debug.stall_s} must be auto, 0 (off) or a number of seconds")
    return float(debug.stall_s)


def parse_devices(devices: Any) -> list[int] | None:
    """None for CPU, [] for 'all GPUs present' (auto), else the listed GPU ids."""
    if isinstance(devices, str):
        if devices == "cpu":
            return None
        if devices == "auto":
            return []
    if isinstance(devices, int) and not isinstance(devices, bool):
        devices = [devices]
    if isinstance(devices, (list, tuple, ListConfig)) and len(devices) > 0:
        ids = list(devices)
        if all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            if len(set(ids)) != len(ids):
                raise UserError(f"devices={ids} lists a GPU twice; list each GPU id once")
            return ids
    raise UserError(f"devices={devices} must be auto, cpu, or a list of GPU ids like [0,1]")


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))
