"""The whole config: the run's top-level options and its sections, and the rules that join them:
`check` (the values alone, when the config is loaded) and `check_run` (with the strategy, GPUs and
process count the run resolved to: strategy/topology.py calls it, the launcher before it starts
workers and each worker once more)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import ListConfig

from multicard.base.config.data import DataConfig, MixConfig, check_decode
from multicard.base.config.observing import DebugConfig, LogConfig
from multicard.base.config.parallel import CheckpointConfig, DDPConfig, FSDPConfig, NetConfig
from multicard.base.config.rules import choice, finite, positive, within
from multicard.base.config.training import EMAConfig, ModelConfig, OptimConfig, SchedConfig, TrainConfig
from multicard.base.errors import UserError
from multicard.base.locations import check_location

STRATEGIES = ("auto", "single", "dp", "ddp", "fsdp")
PRECISIONS = ("fp32", "bf16", "fp16", "fp64")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Keys whose value may be a URL, read (and for checkpoint.dir written) through fsspec: base/store.py; and
# data.root of a pack (data.name=shards). Every other path is local.
URL_KEYS = ("checkpoint.dir", "train.resume", "model.weights")
PATH_KEYS = ("out_dir", "data.root", "data.val_root", "data.cache_dir", *URL_KEYS)
MAX_THREADS = 256  # per process; beyond this torch itself fails (and no node has that many cores per process)


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

    def check(self) -> None:
        """Range and choice checks that the types alone do not express: each section's own, then
        those between options."""
        finite(self)
        self.check_paths()
        choice(self.strategy, "strategy", STRATEGIES)
        choice(self.precision, "precision", PRECISIONS)
        choice(self.compile_mode, "compile_mode", COMPILE_MODES)
        parse_devices(self.devices)
        for section in (self.data, self.train, self.mix, self.ema, self.optim, self.sched, self.ddp, self.fsdp,
                        self.checkpoint, self.debug, self.log):  # fmt: skip
            section.check()
        positive(self.clip_grad_norm, "clip_grad_norm", zero_ok=True)
        positive(self.log_every, "log_every")
        within(self.threads, "threads", 0, MAX_THREADS, hi_open=False)
        positive(self.seed, "seed", zero_ok=True)
        positive(self.dist_timeout_s, "dist_timeout_s")
        self.mix.check_repeats(self.data.repeats, self.train.global_batch_size)
        self.data.check_compile(self.compile_mode if self.compile else None)

    def check_paths(self) -> None:
        """Every path of the config is local (check_local_path), but a pack's data.root and URL_KEYS: a
        URL there is read through fsspec (multicard/base/store.py)."""
        for key in PATH_KEYS:
            value = self.path(key)
            check_location(value, key, key in URL_KEYS or (key == "data.root" and self.data.name == "shards"))

    def path(self, key: str) -> str | None:
        """The path or URL a key of PATH_KEYS holds (train.resume: None for auto and never)."""
        section, _, name = key.rpartition(".")
        value = getattr(getattr(self, section) if section else self, name)
        return None if key == "train.resume" and value in ("auto", "never") else value

    def check_run(self, strategy: str, gpus: list[int], world_size: int, local_world_size: int,
                  training: bool) -> None:  # fmt: skip
        """The options go together with the strategy, the GPUs in use and the process count."""
        check_decode(self.data.decode, cuda=bool(gpus))
        micro_batch = self.train.micro_batch(world_size) if training else 0
        if training:
            self.mix.check_pairs(micro_batch, self.train.global_batch_size, world_size, self.train.grad_accum)
        if strategy == "fsdp":
            self.check_fsdp(world_size, local_world_size)
        if strategy == "ddp" and training:  # eval runs a checkpoint's config, fsdp's included, under ddp
            self.fsdp.check_under_ddp()
        self.checkpoint.check_under(strategy, self.ddp.shard_optimizer)
        self.ddp.check_under(strategy, cuda=bool(gpus))
        self.check_devices(strategy, gpus, local_world_size)
        if training and strategy == "dp" and micro_batch % len(gpus):
            raise UserError(
                f"strategy=dp splits each micro-batch of {micro_batch} over {len(gpus)} GPUs; "
                f"make train.global_batch_size / train.grad_accum a multiple of {len(gpus)}"
            )

    def check_fsdp(self, world_size: int, local_world_size: int) -> None:
        """strategy=fsdp: no DDP option is set, and HSDP has several nodes to replicate over."""
        self.ddp.check_under_fsdp()
        self.fsdp.check_nodes(world_size, local_world_size)

    def check_devices(self, strategy: str, gpus: list[int], local_world_size: int) -> None:
        """The strategy, sync_bn and compile go with the GPUs in use."""
        if strategy in ("ddp", "fsdp") and gpus and local_world_size > len(gpus):
            raise UserError(
                f"{local_world_size} processes per node but only {len(gpus)} GPU(s) in use; "
                f"lower --nproc-per-node to {len(gpus)} or set devices=cpu"
            )
        if strategy == "dp" and not gpus:
            raise UserError(
                "strategy=dp needs CUDA GPUs and none is in use; use strategy=ddp with "
                "--nproc-per-node N for several CPU processes, or strategy=single"
            )
        if self.sync_bn and strategy == "dp":
            raise UserError("sync_bn=true is not supported by strategy=dp (each replica normalises its chunk); use ddp")
        if self.compile and strategy == "dp" and len(gpus) > 1:
            # DataParallel copies the model to every GPU at each step, and a compiled forward stays
            # bound to the original, on the first GPU.
            raise UserError(f"compile=true is not supported by strategy=dp over {len(gpus)} GPUs; use strategy=ddp")


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
