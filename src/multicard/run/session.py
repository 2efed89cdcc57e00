"""The recipes of a run's parts: the process and its strategy, the model, the optimizer, schedule
and Trainer, the stall watchdog, and the lines a run starts with.

`assembly.Assembly` builds each part of a run from these (for `train`, `eval`, `bench`, `verify`,
`plan` and a user's loop alike), and `multicard plan` traces a step of a Trainer built by the same
`assemble_trainer`, so every tool measures and checks the very objects a training run uses.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from multicard.base.config import Config, ModelConfig, stall_seconds
from multicard.data.augmentation.mixing import StepMix
from multicard.data.loading.loaders import EvalLoader, TrainLoader
from multicard.data.loading.sampling import BatchSplit
from multicard.engine.ema import WeightAverage
from multicard.engine.loop import Loop
from multicard.engine.trainer import Schedule, Trainer
from multicard.observe.telemetry import Reporter
from multicard.observe.watchdog import Watchdog
from multicard.runtime.environment import ProcessEnv, detect_env
from multicard.runtime.process_group import ProcessContext, setup
from multicard.runtime.stopping import GracefulStop
from multicard.strategy.base import ModelSetup, Strategy
from multicard.strategy.compilation import set_cudnn_benchmark
from multicard.strategy.factory import make_strategy
from multicard.strategy.models import build_model, check_input_size
from multicard.strategy.optim import OptimizerRecipe, build_scheduler, optimizer_recipe
from multicard.strategy.precision import Precision
from multicard.strategy.topology import Topology


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
    ctx = setup(env, topology.gpus, topology.distributed, cfg.threads, cfg.dist_timeout_s, cfg.net.socket_ifname, trace)
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
    reporter: Reporter, line: str, loop: Loop, resumed: tuple[Path | str, int] | None, notes: list[str],
    always: Sequence[str] = (),
) -> None:  # fmt: skip
    """What every training run says as it starts (its records are opened first: Assembly.announce):
    its start line, the notes said fresh or resumed (`always`), where it resumed (`resumed` =
    (path, step); or its `notes`), and that nothing is left to train when it is complete."""
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


def stall_folder(cfg: Config) -> Path:
    return Path(cfg.out_dir) / "stall"
