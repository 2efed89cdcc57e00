"""Everything one training process builds from the config, ready to run.

`train`, `multicard bench` and `multicard verify` all build their runs here and drive the same
`Trainer.fit`, so they measure and check the very objects a training run uses.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from multicard.base.config import Config, ModelConfig, stall_seconds, to_dict
from multicard.base.errors import MulticardError, Stopped
from multicard.checkpoint import RunFacts
from multicard.checkpoint.weights import load_weights
from multicard.data import Data, build_data
from multicard.data.augmentation.mixing import StepMix, mixing
from multicard.data.loading.loaders import EvalLoader, TrainLoader
from multicard.data.loading.sampling import BatchSplit
from multicard.engine.ema import WeightAverage
from multicard.engine.loop import Callback, Loop
from multicard.engine.trainer import Schedule, Trainer
from multicard.observe.telemetry import Reporter, TensorBoardLog, TrainingLog
from multicard.observe.tracking import TrackerLog
from multicard.observe.watchdog import Watchdog
from multicard.runtime.environment import ProcessEnv, detect_env
from multicard.runtime.process_group import ProcessContext, setup, teardown
from multicard.runtime.stopping import GracefulStop
from multicard.strategy.base import ModelSetup, Strategy
from multicard.strategy.compilation import set_cudnn_benchmark
from multicard.strategy.factory import make_strategy
from multicard.strategy.models import build_model, check_input_size
from multicard.strategy.optim import OptimizerRecipe, build_scheduler, optimizer_recipe
from multicard.strategy.precision import Precision
from multicard.strategy.topology import Topology, resolve


def seeded_model(model: ModelConfig, seed: int, num_classes: int, image_size: int) -> torch.nn.Module:
    """The untrained model, checked against the image size it will see."""
    # The same seed on every rank gives identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(seed)
    built = build_model(model.name, num_classes, dict(model.kwargs))
    check_input_size(built, model.name, image_size, num_classes)
    return built


def seed_process(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def start_process(cfg: Config, env: ProcessEnv, topology: Topology) -> tuple[ProcessContext, Strategy]:
    """Join the process group (if the strategy needs one), pick the device, build the strategy."""
    trace = stall_folder(cfg) if stall_seconds(cfg.debug) != 0 else None
    ctx = setup(
        env, topology.gpus, topology.distributed, cfg.threads, cfg.dist_timeout_s, cfg.net.socket_ifname, trace
    )
    set_cudnn_benchmark(cfg.cudnn_benchmark)
    model_setup = ModelSetup(cfg.model.channels_last, cfg.compile_mode if cfg.compile else None)
    precision = Precision(cfg.precision, ctx.device.type)
    strategy = make_strategy(topology, ctx, precision, model_setup, cfg)
    return ctx, strategy


def training_schedule(cfg: Config, steps_per_epoch: int, total_steps: int, grad_accum: int | None = None,
                      log_every: int | None = None) -> Schedule:  # fmt: skip
    """The loop's settings for `cfg` (grad_accum and log_every: the config's unless given)."""
    return Schedule(
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        grad_accum=cfg.train.grad_accum if grad_accum is None else grad_accum,
        log_every=cfg.log_every if log_every is None else log_every,
        label_smoothing=cfg.train.label_smoothing,
        clip_grad_norm=cfg.clip_grad_norm,
        eval_flip=cfg.eval_flip,
    )


def assemble_trainer(
    cfg: Config, strategy: Strategy, model: torch.nn.Module, train: TrainLoader, val: EvalLoader | None,
    schedule: Schedule, stop: GracefulStop | None = None, mix: StepMix | None = None,
) -> tuple[Trainer, OptimizerRecipe]:  # fmt: skip
    """The optimizer, LR scheduler, weights' EMA (ema.decay) and Trainer of a model the strategy has
    prepared, as every run (and the plan's traced step) has them; with the optimizer's recipe."""
    bare = strategy.unwrap(model)
    recipe = optimizer_recipe(bare, cfg.optim, cfg.train.global_batch_size)
    optimizer = strategy.make_optimizer(recipe, bare)
    scheduler = build_scheduler(optimizer, cfg.sched, schedule.total_steps, schedule.steps_per_epoch)
    ema = None
    if cfg.ema.decay:
        ema = WeightAverage(bare, cfg.ema.decay, cfg.ema.every, round(cfg.ema.start_epoch * schedule.steps_per_epoch))
    return Trainer(strategy, model, optimizer, scheduler, train, val, schedule, stop, mix, ema), recipe


def watch_for_stalls(cfg: Config, ctx: ProcessContext, loop: Loop, stack: ExitStack) -> Watchdog | None:
    """Heartbeats and stall reports (debug.stall_s; 0 turns them off), for as long as the session lasts."""
    stall_s = stall_seconds(cfg.debug)
    if stall_s == 0 or ctx.store is None:
        return None
    watchdog = Watchdog(
        ctx.store,
        ctx.rank,
        ctx.world_size,
        lambda: (loop.clock.ticks, loop.position.global_step, loop.phase),
        stall_folder(cfg),
        stall_s,
        abort=cfg.debug.on_stall == "abort",
        say=lambda line: print(line, file=sys.stderr, flush=True),
    )
    stack.callback(watchdog.start().close)
    return watchdog


def start_line(strategy: Strategy, precision: str, split: BatchSplit, what: str) -> str:
    """The line every training run starts with: how it runs, what it trains, how the batch splits."""
    ctx = strategy.ctx
    return (
        f"multicard: strategy={strategy.name} world_size={ctx.world_size} device={ctx.device.type} "
        f"precision={precision} {what} global_batch={split.global_batch} "
        f"(micro-batch {split.micro_batch} × {ctx.world_size} process(es) × {split.grad_accum} accum)"
    )


def announce_start(
    reporter: Reporter, out_dir: Path, config: dict[str, Any], line: str, loop: Loop,
    resumed: tuple[Path, int] | None, notes: list[str], always: list[str] = (),
) -> None:  # fmt: skip
    """What every training run writes and says as it starts: metrics.jsonl (continued after the
    checkpoint it resumed, `resumed` = (path, step)) and config.yaml, both once it has trained a
    step (a run refused before then leaves out_dir as it found it); its start line, the notes said
    fresh or resumed (`always`), where it resumed (or its `notes`), and that nothing is left to
    train when it is complete."""
    resumed_at = resumed[1] if resumed is not None else None
    reporter.run_files(out_dir / "metrics.jsonl", resumed_at, {out_dir / "config.yaml": OmegaConf.to_yaml(config)})
    reporter.print(line)
    for note in always:
        reporter.print(note)
    if resumed is None:
        for note in notes:
            reporter.print(note)
    else:
        restart = detect_env().restart
        again = f" (after restart {restart})" if restart else ""
        reporter.print(
            f"resumed from {resumed[0]}{again}: epoch {loop.position.epoch}, "
            f"step {loop.position.global_step} of {loop.schedule.total_steps}"
        )
    if loop.finished:
        reporter.print(
            f"nothing to train: this run is complete ({loop.position.global_step} steps); "
            f"set train.resume=never or another out_dir to train again"
        )


def run_logs(
    cfg: Config, out_dir: Path, reporter: Reporter, is_main: bool, resumed_at: int | None, loader: str
) -> list[Callback]:
    """Every logging callback of a training run (console and metrics.jsonl, TensorBoard, trackers),
    as train attaches them and `multicard bench --logging` times them; `loader`: device, workers
    or user (a user's loop)."""
    logs: list[Callback] = [TrainingLog(reporter, cfg.data, loader)]
    if cfg.log.tensorboard:
        logs.append(TensorBoardLog(out_dir / "tensorboard", is_main, resumed_at))
    if cfg.log.mlflow or cfg.log.wandb:
        logs.append(TrackerLog(cfg, out_dir, is_main, resumed_at))
    return logs


def stall_folder(cfg: Config) -> Path:
    return Path(cfg.out_dir) / "stall"


@dataclass
class Session:
    cfg: Config
    ctx: ProcessContext
    strategy: Strategy
    batch_split: BatchSplit
    data: Data
    trainer: Trainer
    run: RunFacts  # what checkpoints of this run record
    notes: list[str]  # lines for the run's console (what model.weights loaded)
    watchdog: Watchdog | None  # heartbeats and stall reports (None: debug.stall_s=0 or one process)


@contextmanager
def open_session(cfg: Config, env: ProcessEnv) -> Iterator[Session]:
    """Set up the process group, data, model, optimizer and trainer, with graceful-stop signal
    handling; tear all down on exit."""
    topology = resolve(cfg, env.world_size, env.local_world_size, env.launched)
    ctx, strategy = start_process(cfg, env, topology)
    keep_group = False
    try:
        with ExitStack() as stack:
            stop = stack.enter_context(GracefulStop(strategy.start_max, announce=ctx.is_main))
            batch_split = BatchSplit(cfg.train.global_batch_size, cfg.train.grad_accum, ctx.world_size)
            data = build_data(cfg.data, cfg.seed, batch_split, ctx)
            stack.callback(data.close)
            assert data.train is not None
            steps_per_epoch = batch_split.steps_per_epoch(data.train.num_samples)
            bare = seeded_model(cfg.model, cfg.seed, data.num_classes, cfg.data.image_size)
            bare = bare.to(dtype=strategy.precision.param_dtype)  # weights load at the run's precision
            notes = [load_weights(bare, cfg.model.weights)] if cfg.model.weights else []
            model = strategy.prepare(bare)
            seed_process(cfg.seed + ctx.rank)  # per-rank streams for anything stochastic in the model
            schedule = training_schedule(cfg, steps_per_epoch, cfg.train.run_length(steps_per_epoch))
            mix = mixing(cfg.mix, batch_split, ctx.rank, cfg.seed, data.num_classes)
            trainer, _ = assemble_trainer(cfg, strategy, model, data.train, data.val, schedule, stop, mix)
            watchdog = watch_for_stalls(cfg, ctx, trainer.loop, stack)
            run = RunFacts(to_dict(cfg), data.classes, steps_per_epoch, ctx.world_size, data.fingerprint)
            yield Session(cfg, ctx, strategy, batch_split, data, trainer, run, notes, watchdog)
    except MulticardError as exc:
        # An error of this rank alone: leave the process group open on the way out, so peers see
        # its connections close only once it has exited (cli.main exits right after the message)
        # and the launcher reports this rank's exit code, not a peer's "connection closed".
        # A graceful stop is every rank's decision: it tears down as usual.
        keep_group = ctx.world_size > 1 and not isinstance(exc, Stopped)
        raise
    finally:
        if not keep_group:
            teardown()
