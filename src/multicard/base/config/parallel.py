"""The sections of how the processes share the work and save it: ddp, fsdp, checkpoint and net, each
with its own rules (`check`) and its rules with the strategy the run resolved to (`check_under`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from multicard.base.config.rules import changed_fields, choice, positive
from multicard.base.errors import UserError

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
REPLICATE = ("none", "nodes")
CHECKPOINT_FORMATS = ("auto", "file", "sharded")


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

    def check(self) -> None:
        choice(self.comm_hook, "ddp.comm_hook", COMM_HOOKS)
        positive(self.bucket_cap_mb, "ddp.bucket_cap_mb")
        positive(self.powersgd_rank, "ddp.powersgd_rank")
        if self.powersgd_start_step < 2:
            raise UserError(
                f"ddp.powersgd_start_step={self.powersgd_start_step} must be >= 2 (error feedback needs it)"
            )

    def check_under_fsdp(self) -> None:
        """Options that mean nothing under fsdp are refused rather than silently ignored."""
        if self.comm_hook != "none":
            raise UserError(
                f"ddp.comm_hook={self.comm_hook} compresses DDP's all-reduce; strategy=fsdp reduce-scatters instead "
                f"and takes no hook: remove ddp.comm_hook, or use strategy=ddp"
            )
        changed = changed_fields(self)
        if changed:
            raise UserError(
                f"ddp.{changed[0]} is a DDP option and has no effect under strategy=fsdp; remove it, or use "
                f"strategy=ddp"
            )

    def check_under(self, strategy: str, cuda: bool) -> None:
        """ZeRO-1 shards over DDP ranks; PowerSGD needs NCCL."""
        if self.shard_optimizer and strategy != "ddp":
            raise UserError(
                f"ddp.shard_optimizer=true (ZeRO-1) shards optimizer state over DDP ranks but strategy={strategy}; "
                f"use strategy=ddp, or strategy=fsdp, which shards parameters and gradients too"
            )
        if self.comm_hook == "powersgd" and strategy == "ddp" and not cuda:
            # torch's PowerSGD hook waits for a second all-reduce inside gloo's worker threads: with
            # several gradient buckets those threads block each other and the job hangs.
            raise UserError(
                "ddp.comm_hook=powersgd needs CUDA GPUs (NCCL); on CPU (gloo) it can deadlock. "
                "Use ddp.comm_hook=fp16 or bf16 on CPU"
            )


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

    def check(self) -> None:
        choice(self.replicate, "fsdp.replicate", REPLICATE)
        choice(self.cpu_release_memory.lower(), "fsdp.cpu_release_memory", ("auto", "true", "false"))
        positive(self.min_unit_params, "fsdp.min_unit_params")

    def check_nodes(self, world_size: int, local_world_size: int) -> None:
        """strategy=fsdp: HSDP replicates across nodes, so it needs several."""
        if self.replicate == "nodes" and world_size // max(1, local_world_size) < 2:
            raise UserError(
                "fsdp.replicate=nodes (HSDP) replicates across nodes, but this job runs on one node; "
                "remove it (fsdp shards over all ranks), or start several nodes"
            )

    def check_under_ddp(self) -> None:
        """check_under_fsdp's mirror: fsdp.* options changed from their defaults mean nothing under ddp."""
        changed = changed_fields(self)
        if changed:
            raise UserError(
                f"fsdp.{changed[0]} is an FSDP option and has no effect under strategy=ddp; remove it, or use "
                f"strategy=fsdp"
            )


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 0  # also save inside epochs, every this many optimizer steps; 0 = epoch ends only
    keep_last: int = 3  # step checkpoints kept (best and last are kept besides)
    # file: step-N.pt written by rank 0; sharded: step-N/ with one shard per rank (torch.distributed.checkpoint);
    # auto: sharded under fsdp, else file. Any strategy and world size reads either.
    format: str = "auto"
    # Write in the background while training goes on (costs one CPU copy of each rank's state, taken
    # at the step: a file's bytes, or a rank's shard); the next save, a stop and the run's end wait for it
    async_save: bool = False
    # Elastic jobs: each node also keeps the newest single-file checkpoints on its own disk, in its agent's
    # folder (under the temp dir, for the job's life): after a loss, the nodes resume from their own copy
    # when the durable write (async_save, an upload) had not finished. Needs a launcher's agent.
    local_copy: bool = False
    # A signal to multicard's launcher: seconds the workers get to write the stop's checkpoint and
    # exit before they are killed (torch's agent alone would give 30)
    stop_timeout_s: float = 300.0
    # Where checkpoints go: None = out_dir/checkpoints; a local path, or a URL (s3://bucket/run1/checkpoints,
    # any fsspec protocol): there a checkpoint exists once its commit object, written last, says so
    dir: str | None = None

    def check(self) -> None:
        choice(self.format, "checkpoint.format", CHECKPOINT_FORMATS)
        positive(self.every_steps, "checkpoint.every_steps", zero_ok=True)
        positive(self.keep_last, "checkpoint.keep_last")
        positive(self.stop_timeout_s, "checkpoint.stop_timeout_s")

    def check_under(self, strategy: str, shard_optimizer: bool) -> None:
        """checkpoint.format goes with async saving and ZeRO-1 (the strategy decides `auto`)."""
        sharded = self.format == "sharded" or (self.format == "auto" and strategy == "fsdp")
        if self.local_copy and sharded:
            raise UserError(
                "checkpoint.local_copy=true keeps single-file checkpoints on each node; sharded ones (fsdp's "
                "default) are one shard per rank: set checkpoint.format=file or drop checkpoint.local_copy"
            )
        if shard_optimizer and self.format == "sharded":
            raise UserError(
                "ddp.shard_optimizer=true gathers the whole optimizer state on rank 0 for a checkpoint file; "
                "use checkpoint.format=file (or auto), or strategy=fsdp for sharded checkpoints"
            )


@dataclass(frozen=True)
class NetConfig:
    # Interface(s) for gloo/NCCL traffic between nodes, e.g. eth1 or ib0 (exact names, comma-separated
    # for several): sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME unless they are exported already
    # (the exported value wins). None = the libraries choose (the host name's address for gloo).
    socket_ifname: str | None = None
