"""Which strategy runs on which devices: decided once per process, before anything starts.

`resolve` is the only place that turns `strategy=auto` into a strategy and picks the GPUs;
`check_options` (which it calls) holds the rules on which options go together with the strategy,
the GPUs present and the process count. The launcher calls it before starting
workers (so bad input costs no start-up), and each worker once more for its own process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from multicard.base.config import Config, DDPConfig, FSDPConfig, parse_devices
from multicard.base.errors import UserError
from multicard.data.augmentation.mixing import check_pairs
from multicard.data.decoding.choice import check_decode
from multicard.data.loading.sampling import BatchSplit
from multicard.runtime.process_group import resolve_gpus

ONE_PROCESS = ("single", "dp")  # strategies that run in one process


@dataclass(frozen=True)
class Topology:
    strategy: str  # single | dp | ddp
    gpus: list[int]  # GPU ids in use; [] = CPU
    world_size: int
    local_world_size: int

    @property
    def distributed(self) -> bool:
        """A process group is needed (ddp), even with one process."""
        return self.strategy not in ONE_PROCESS


def resolve_strategy(requested: str, launched: bool, world_size: int) -> str:
    """auto → ddp under a launcher (torchrun, srun, --nproc-per-node; even with one process),
    else single. single and dp cannot run as several processes."""
    if requested == "auto":
        return "ddp" if launched else "single"
    if requested in ONE_PROCESS and world_size > 1:
        raise UserError(
            f"strategy={requested} runs in one process but the launcher starts {world_size}; use strategy=ddp (or auto)"
        )
    return requested


def check_fsdp(cfg: Config, world_size: int, local_world_size: int) -> None:
    """Options that mean nothing under fsdp are refused rather than silently ignored."""
    if cfg.ddp.comm_hook != "none":
        raise UserError(
            f"ddp.comm_hook={cfg.ddp.comm_hook} compresses DDP's all-reduce; strategy=fsdp reduce-scatters instead "
            f"and takes no hook: remove ddp.comm_hook, or use strategy=ddp"
        )
    defaults = DDPConfig()
    changed = [f.name for f in dataclasses.fields(DDPConfig) if getattr(cfg.ddp, f.name) != getattr(defaults, f.name)]
    if changed:
        raise UserError(
            f"ddp.{changed[0]} is a DDP option and has no effect under strategy=fsdp; remove it, or use strategy=ddp"
        )
    if cfg.fsdp.replicate == "nodes" and world_size // max(1, local_world_size) < 2:
        raise UserError(
            "fsdp.replicate=nodes (HSDP) replicates across nodes, but this job runs on one node; "
            "remove it (fsdp shards over all ranks), or start several nodes"
        )


def check_ddp(cfg: Config) -> None:
    """check_fsdp's mirror: fsdp.* options changed from their defaults mean nothing under ddp."""
    defaults = FSDPConfig()
    changed = [f.name for f in dataclasses.fields(FSDPConfig) if getattr(cfg.fsdp, f.name) != getattr(defaults, f.name)]
    if changed:
        raise UserError(
            f"fsdp.{changed[0]} is an FSDP option and has no effect under strategy=ddp; remove it, or use strategy=fsdp"
        )


def resolve(cfg: Config, world_size: int, local_world_size: int, launched: bool, training: bool = True) -> Topology:
    """The strategy and GPUs for `world_size` processes, or a one-line UserError saying what to change."""
    strategy = resolve_strategy(cfg.strategy, launched, world_size)
    gpus = resolve_gpus(parse_devices(cfg.devices))
    check_options(cfg, strategy, gpus, world_size, local_world_size, training)
    return Topology(strategy, gpus, world_size, local_world_size)


def check_checkpoint_format(cfg: Config, strategy: str) -> None:
    """checkpoint.format goes with async saving and ZeRO-1 (the strategy decides `auto`)."""
    sharded = cfg.checkpoint.format == "sharded" or (cfg.checkpoint.format == "auto" and strategy == "fsdp")
    if cfg.checkpoint.async_save and not sharded:
        raise UserError(
            "checkpoint.async_save=true writes sharded checkpoints in the background; set checkpoint.format=sharded "
            "(fsdp's default) or drop checkpoint.async_save"
        )
    if cfg.ddp.shard_optimizer and cfg.checkpoint.format == "sharded":
        raise UserError(
            "ddp.shard_optimizer=true gathers the whole optimizer state on rank 0 for a checkpoint file; "
            "use checkpoint.format=file (or auto), or strategy=fsdp for sharded checkpoints"
        )


def check_options(cfg: Config, strategy: str, gpus: list[int], world_size: int, local_world_size: int,
                  training: bool) -> None:  # fmt: skip
    """The config's options go together with the strategy, the GPUs in use and the process count."""
    check_decode(cfg.data.decode, cuda=bool(gpus))
    if training:
        check_pairs(cfg.mix, BatchSplit(cfg.train.global_batch_size, cfg.train.grad_accum, world_size))
    if strategy == "fsdp":
        check_fsdp(cfg, world_size, local_world_size)
    if strategy == "ddp" and training:  # eval runs a checkpoint's config, fsdp's included, under ddp
        check_ddp(cfg)
    check_checkpoint_format(cfg, strategy)
    if cfg.ddp.shard_optimizer and strategy != "ddp":
        raise UserError(
            f"ddp.shard_optimizer=true (ZeRO-1) shards optimizer state over DDP ranks but strategy={strategy}; "
            f"use strategy=ddp, or strategy=fsdp, which shards parameters and gradients too"
        )
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
    if cfg.ddp.comm_hook == "powersgd" and strategy == "ddp" and not gpus:
        # torch's PowerSGD hook waits for a second all-reduce inside gloo's worker threads: with
        # several gradient buckets those threads block each other and the job hangs.
        raise UserError(
            "ddp.comm_hook=powersgd needs CUDA GPUs (NCCL); on CPU (gloo) it can deadlock. "
            "Use ddp.comm_hook=fp16 or bf16 on CPU"
        )
    if cfg.sync_bn and strategy == "dp":
        raise UserError("sync_bn=true is not supported by strategy=dp (each replica normalises its chunk); use ddp")
    if cfg.compile and strategy == "dp" and len(gpus) > 1:
        # DataParallel copies the model to every GPU at each step, and a compiled forward stays
        # bound to the original, on the first GPU.
        raise UserError(f"compile=true is not supported by strategy=dp over {len(gpus)} GPUs; use strategy=ddp")
    if training:
        split = BatchSplit(cfg.train.global_batch_size, cfg.train.grad_accum, world_size)
        if strategy == "dp" and split.micro_batch % len(gpus):
            raise UserError(
                f"strategy=dp splits each micro-batch of {split.micro_batch} over {len(gpus)} GPUs; "
                f"make train.global_batch_size / train.grad_accum a multiple of {len(gpus)}"
            )
