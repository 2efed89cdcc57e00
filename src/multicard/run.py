"""What one process does for `train` and `eval`: set up, build from the config, run, tear down."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from multicard import checkpoint, dist, resume
from multicard.config import config_from_dict, parse_devices, to_yaml
from multicard.data import Data, build_data
from multicard.data.sampling import BatchPlan
from multicard.engine import EvalResult, Trainer, evaluate, total_steps
from multicard.errors import MulticardError, UserError
from multicard.kernels import set_cudnn_benchmark
from multicard.models import build_model
from multicard.optim import build_optimizer, build_scheduler
from multicard.precision import Precision
from multicard.stopping import GracefulStop, Stopped
from multicard.strategy import Strategy, make_strategy
from multicard.telemetry import Reporter


def resolve_strategy(name: str, env: dist.ProcessEnv) -> str:
    """auto → ddp under a launcher, else single; single/dp cannot run as several processes."""
    if name == "auto":
        return "ddp" if env.launched else "single"
    if name in ("single", "dp") and env.world_size > 1:
        raise UserError(
            f"strategy={name} runs in one process but the launcher started {env.world_size}; "
            f"use strategy=ddp (or auto)"
        )
    return name


def check_topology(
    cfg: DictConfig, strategy: str, world_size: int, local_world_size: int, training: bool = True
) -> list[int]:
    """Checks that need the process count, made before any worker starts; returns GPU ids."""
    gpus = dist.resolve_gpus(parse_devices(cfg.devices))
    if strategy == "ddp" and gpus and local_world_size > len(gpus):
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
    if not training:
        return gpus
    plan = BatchPlan(cfg.train.global_batch_size, cfg.train.grad_accum, world_size)
    if strategy == "dp" and plan.micro_batch % len(gpus):
        raise UserError(
            f"strategy=dp splits each micro-batch of {plan.micro_batch} over {len(gpus)} GPUs; "
            f"make train.global_batch_size / train.grad_accum a multiple of {len(gpus)}"
        )
    return gpus


def prepare_out_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"out_dir={path} cannot be created ({exc.strerror}); choose a writable out_dir") from None
    if not os.access(out, os.W_OK):
        raise UserError(f"out_dir={path} is not writable; choose a writable out_dir")
    return out


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _build_model(cfg: DictConfig, num_classes: int) -> torch.nn.Module:
    # The same seed on every rank gives identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(cfg.seed)
    return build_model(cfg.model.name, num_classes, dict(cfg.model.kwargs))


def _start(
    cfg: DictConfig, env: dist.ProcessEnv, strategy_name: str, training: bool
) -> tuple[dist.DistContext, Strategy]:
    gpus = check_topology(cfg, strategy_name, env.world_size, env.local_world_size, training)
    ctx = dist.setup(env, gpus, strategy_name == "ddp", cfg.threads, cfg.dist_timeout_s, cfg.net.socket_ifname)
    set_cudnn_benchmark(cfg.cudnn_benchmark)
    precision = Precision(cfg.precision, ctx.device.type)
    return ctx, make_strategy(strategy_name, ctx, precision, gpus)


@dataclass
class Session:
    """Everything one training process builds from the config, ready to run."""

    cfg: DictConfig
    ctx: dist.DistContext
    strategy: Strategy
    plan: BatchPlan
    data: Data
    trainer: Trainer
    reporter: Reporter


@contextmanager
def session(cfg: DictConfig, env: dist.ProcessEnv, quiet: bool = False) -> Iterator[Session]:
    """Set up the process group, data, model, optimizer and trainer; tear all down on exit.

    `train`, `multicard bench` and `multicard verify` all build their runs here, so they
    measure and check the very objects a training run uses. `quiet` keeps the run directory
    and console untouched (bench and verify write their own outputs).
    """
    strategy_name = resolve_strategy(cfg.strategy, env)
    out_dir = prepare_out_dir(cfg.out_dir)
    ctx, strategy = _start(cfg, env, strategy_name, training=True)
    reporter = Reporter(ctx.is_main and not quiet, None)
    data = None
    keep_group = False
    try:
        plan = BatchPlan(cfg.train.global_batch_size, cfg.train.grad_accum, ctx.world_size)
        data = build_data(
            cfg, plan, ctx.rank, ctx.world_size, ctx.device, ctx.local_rank, ctx.local_world_size, strategy.barrier
        )
        steps_per_epoch = plan.steps_per_epoch(data.train.num_samples)
        model = strategy.prepare(_build_model(cfg, data.num_classes), cfg)
        _seed_everything(cfg.seed + ctx.rank)  # per-rank streams for anything stochastic in the model
        optimizer = build_optimizer(strategy.unwrap(model), cfg)
        scheduler = build_scheduler(optimizer, cfg, total_steps(cfg, steps_per_epoch), steps_per_epoch)
        trainer = Trainer(
            cfg, strategy, model, optimizer, scheduler, data.train, data.val, steps_per_epoch, reporter, out_dir
        )
        yield Session(cfg, ctx, strategy, plan, data, trainer, reporter)
    except MulticardError as exc:
        # An error of this rank alone: leave the process group open on the way out, so peers see
        # its connections close only once it has exited (cli.main exits right after the message)
        # and the launcher reports this rank's exit code, not a peer's "connection closed".
        # A graceful stop is every rank's decision: it tears down as usual.
        keep_group = ctx.world_size > 1 and not isinstance(exc, Stopped)
        raise
    finally:
        if data is not None:
            data.close()
        reporter.close()
        if not keep_group:
            dist.teardown()


def train(cfg: DictConfig, env: dist.ProcessEnv) -> EvalResult | None:
    """Train in this process (one rank of a DDP job, or the whole single/dp job)."""
    with session(cfg, env) as s, GracefulStop(s.strategy.start_max) as stop:
        trainer, reporter, out_dir = s.trainer, s.reporter, Path(cfg.out_dir)
        trainer.stop = stop
        resume_from = resume.choose(cfg, out_dir / "checkpoints", s.strategy, reporter.print)
        reporter.open_metrics(out_dir / "metrics.jsonl", append=resume_from is not None)
        reporter.write_text(out_dir / "config.yaml", to_yaml(cfg))
        state = resume.load(resume_from, cfg, trainer.steps_per_epoch) if resume_from is not None else None
        plan = s.plan
        reporter.print(
            f"multicard: strategy={s.strategy.name} world_size={s.ctx.world_size} device={s.ctx.device.type} "
            f"precision={cfg.precision} model={cfg.model.name} data={cfg.data.name} loader={s.data.loader} "
            f"global_batch={plan.global_batch} "
            f"(micro-batch {plan.micro_batch} × {s.ctx.world_size} process(es) × {plan.grad_accum} accum)"
        )
        if state is not None:
            trainer.restore(state, resume_from)
            restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            again = f" (after restart {restarts})" if restarts != "0" else ""
            reporter.print(
                f"resumed from {resume_from}{again}: epoch {trainer.pos.epoch}, "
                f"step {trainer.pos.global_step} of {trainer.total_steps}"
            )
        if trainer.finished:
            reporter.print(
                f"nothing to train: this run is complete ({trainer.pos.global_step} steps); "
                f"set train.resume=never or another out_dir to train again"
            )
            val = state["val"] if state is not None else None
            return EvalResult(**val) if val else None
        result = trainer.fit()
        if result is not None:
            reporter.print(
                f"final validation accuracy: top-1 {result.top1:.2f}%, top-5 {result.top5:.2f}% "
                f"({result.samples} images)"
            )
        return result


def evaluate_checkpoint(path: str, overrides: list[str], env: dist.ProcessEnv, as_json: bool) -> EvalResult:
    """Exact evaluation of a checkpoint on the configured validation data, any world size."""
    state = checkpoint.load(path)
    cfg = config_from_dict(state["config"], overrides)
    strategy_name = "ddp" if env.launched else "single"
    ctx, strategy = _start(cfg, env, strategy_name, training=False)
    try:
        data = build_data(
            cfg, None, ctx.rank, ctx.world_size, ctx.device, ctx.local_rank, ctx.local_world_size, strategy.barrier
        )
        model = _build_model(cfg, data.num_classes)
        checkpoint.load_model_state(Strategy.unwrap(model), state["model"], path)
        # Eager even when the config says compile: one pass over the data would not repay compiling.
        model = model.to(ctx.device, dtype=strategy.precision.param_dtype)
        result = evaluate(model, data.val, strategy, cfg.model.channels_last)
        data.close()
        if ctx.is_main:
            if as_json:
                print(json.dumps(result.as_dict()))
            else:
                print(
                    f"top-1 {result.top1:.2f}%  top-5 {result.top5:.2f}%  loss {result.loss:.4f}  "
                    f"({result.samples} images, {ctx.world_size} process(es))"
                )
        return result
    finally:
        dist.teardown()
