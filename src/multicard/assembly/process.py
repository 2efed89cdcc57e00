"""How the assembly (parts.py) makes a run's process and what watches it: the process group and
device, the strategy, the stall watchdog, and the lines a training run starts with."""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path

from multicard.base.config import Config, stall_seconds
from multicard.data import BatchSplit, repeats_note
from multicard.engine.loop import Loop
from multicard.observe.telemetry import Reporter
from multicard.observe.watchdog import Watchdog
from multicard.runtime.environment import ProcessEnv, detect_env
from multicard.runtime.process_group import ProcessContext, setup
from multicard.strategy.base import ModelSetup, Strategy
from multicard.strategy.compilation import set_cudnn_benchmark
from multicard.strategy.factory import make_strategy
from multicard.strategy.precision import Precision
from multicard.strategy.topology import Topology


def start_process(cfg: Config, env: ProcessEnv, topology: Topology) -> tuple[ProcessContext, Strategy]:
    """Join the process group (if the strategy needs one), pick the device, build the strategy."""
    trace = stall_folder(cfg) if stall_seconds(cfg.debug) != 0 else None
    ctx = setup(env, topology.gpus, topology.distributed, cfg.threads, cfg.dist_timeout_s, cfg.net.socket_ifname, trace)
    set_cudnn_benchmark(cfg.cudnn_benchmark)
    model_setup = ModelSetup(cfg.model.channels_last, cfg.compile_mode if cfg.compile else None)
    precision = Precision(cfg.precision, ctx.device.type)
    strategy = make_strategy(topology, ctx, precision, model_setup, cfg)
    return ctx, strategy


def watch_for_stalls(cfg: Config, ctx: ProcessContext, loop: Loop, stack: ExitStack) -> Watchdog | None:
    """Heartbeats and stall reports (debug.stall_s; 0 turns them off), for as long as the run lasts."""
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


def announce_start(reporter: Reporter, strategy: Strategy, cfg: Config, split: BatchSplit, what: str, loop: Loop,
                   resumed: tuple[Path | str, int] | None) -> None:  # fmt: skip
    """What every training run says as it starts (its records are opened first: parts.Assembly.announce):
    how it runs, what it trains (`what`) and how the batch splits; this world size's layout of
    data.repeats; where it resumed (`resumed` = (path, step)); that nothing is left to train."""
    ctx = strategy.ctx
    reporter.print(
        f"multicard: strategy={strategy.name} world_size={ctx.world_size} device={ctx.device.type} "
        f"precision={cfg.precision} {what} global_batch={split.global_batch} "
        f"(micro-batch {split.micro_batch} × {ctx.world_size} process(es) × {split.grad_accum} accum)"
    )
    note = repeats_note(split, cfg.data.repeats)
    if note:
        reporter.print(note)
    if resumed is not None:
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
