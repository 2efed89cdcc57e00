"""One object that builds everything a run needs from its config: `Assembly`.

`multicard train` and `eval`, the workers of `bench`, `verify` and `plan`, and the library's
`multicard.Run` all take their parts from an Assembly: the process (group, device, strategy,
graceful stop), the data, the model, the optimizer, schedule and Trainer, the sinks (console,
metrics.jsonl and config.yaml, TensorBoard and trackers) and the checkpointer. Each part is built
where it is first asked for, so eval builds no optimizer and a user's loop no data, by the
recipes in session.py; the sinks and the checkpointer are made here only.

The checks made before a run starts, and out_dir's lock, are preflight.py's: the launcher's,
or a training process's when no launcher of multicard's started it.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from functools import cached_property
from pathlib import Path
from typing import Any

import torch.nn as nn
from omegaconf import OmegaConf

from multicard.base.config import Config, check_world_sizes, to_dict
from multicard.base.errors import MulticardError, Stopped
from multicard.checkpoint import Checkpointer, RunFacts
from multicard.checkpoint.weights import load_weights
from multicard.data import Data, build_data
from multicard.data.augmentation.mixing import mixing
from multicard.data.loading.sampling import BatchSplit
from multicard.engine.loop import Callback, Loop
from multicard.engine.trainer import Trainer
from multicard.observe.membership import Membership
from multicard.observe.telemetry import Reporter, TensorBoardLog, TrainingLog
from multicard.observe.tracking import TrackerLog
from multicard.observe.watchdog import Watchdog
from multicard.run.session import (
    announce_start,
    assemble_trainer,
    seed_process,
    seeded_model,
    start_process,
    training_schedule,
    watch_for_stalls,
)
from multicard.runtime.environment import ProcessEnv, parent_agent_folder
from multicard.runtime.process_group import ProcessContext, teardown
from multicard.runtime.stopping import POLL_EVERY, GracefulStop
from multicard.strategy.base import Strategy
from multicard.strategy.topology import resolve


class Assembly:
    """The parts of one run of `cfg` in this process (`env`), each built on first use.

    `training=False`: an evaluation (its topology and data need no batch split). Parts that need
    undoing (signal handlers, loader processes, files, the watchdog) register it on `stack` (the
    caller's, as a user's loop holds its own; else the Assembly's, closed by `with`).
    """

    def __init__(self, cfg: Config, env: ProcessEnv, *, training: bool = True, stack: ExitStack | None = None) -> None:
        self.cfg, self.env, self.training = cfg, env, training
        self.stack = stack if stack is not None else ExitStack()
        self.notes: list[str] = []  # lines for the run's console (what model.weights loaded)
        self.watchdog: Watchdog | None = None  # heartbeats and stall reports, once a loop is watched

    # ------------------------------------------------------------ the process

    @cached_property
    def _process(self) -> tuple[ProcessContext, Strategy]:
        env = self.env
        topology = resolve(self.cfg, env.world_size, env.local_world_size, env.launched, training=self.training)
        return start_process(self.cfg, env, topology)

    ctx = property(lambda self: self._process[0], doc="rank, world size, device (process_group.setup)")
    strategy = property(lambda self: self._process[1], doc="single, dp, ddp or fsdp, as resolved")
    out_dir = property(lambda self: Path(self.cfg.out_dir))

    @cached_property
    def stop(self) -> GracefulStop:
        """Graceful-stop signal handling, from here until the run ends. One process agrees with itself
        at every step (an elastic job shrunk to one stops at once when a node joins)."""
        every = 1 if self.ctx.world_size == 1 else POLL_EVERY
        return self.stack.enter_context(GracefulStop(self.strategy.start_max, every, announce=self.ctx.is_main))

    @cached_property
    def batch_split(self) -> BatchSplit:
        """The global batch over this world size; an elastic job's must split at every size it may run at."""
        train = self.cfg.train
        if self.env.nnodes is not None:
            check_world_sizes(train.global_batch_size, train.grad_accum, self.env.world_sizes, self.env.nnodes)
        return BatchSplit(train.global_batch_size, train.grad_accum, self.ctx.world_size)

    # ------------------------------------------------------------ data, model, trainer

    @cached_property
    def data(self) -> Data:
        """Training and validation data (an evaluation's: validation, in batches of its own)."""
        split = None
        if self.training:
            split = self.batch_split
            self.stop  # noqa: B018 -- signals are handled from here on (a stop while loading is graceful)
        data = build_data(self.cfg.data, self.cfg.seed, split, self.ctx)
        self.stack.callback(data.close)
        return data

    @cached_property
    def steps_per_epoch(self) -> int:
        assert self.data.train is not None
        return self.batch_split.steps_per_epoch(self.data.train.num_samples)

    def bare_model(self) -> nn.Module:
        """The untrained model for this data (the same weights on every rank)."""
        cfg = self.cfg
        return seeded_model(cfg.model, cfg.seed, self.data.num_classes, cfg.data.image_size)

    @cached_property
    def model(self) -> nn.Module:
        """The model at the run's precision with model.weights loaded, as the strategy runs it."""
        bare = self.bare_model().to(dtype=self.strategy.precision.param_dtype)  # weights load at the run's precision
        if self.cfg.model.weights:
            self.notes.append(load_weights(bare, self.cfg.model.weights))
        model = self.strategy.prepare(bare)
        seed_process(self.cfg.seed + self.ctx.rank)  # per-rank streams for anything stochastic in the model
        return model

    @cached_property
    def trainer(self) -> Trainer:
        """The optimizer, schedule, EMA and Trainer of the model, with its loop watched for stalls."""
        cfg, spe = self.cfg, self.steps_per_epoch
        model, data, stop = self.model, self.data, self.stop
        schedule = training_schedule(cfg, spe, cfg.train.run_length(spe))
        mix = mixing(cfg.mix, self.batch_split, self.ctx.rank, cfg.seed, data.num_classes)
        assert data.train is not None
        trainer, _ = assemble_trainer(cfg, self.strategy, model, data.train, data.val, schedule, stop, mix)
        self.watch(trainer.loop)
        return trainer

    def watch(self, loop: Loop) -> None:
        """Heartbeats and stall reports for `loop` (debug.stall_s) for as long as the run lasts."""
        self.watchdog = watch_for_stalls(self.cfg, self.ctx, loop, self.stack)

    # ------------------------------------------------------------ checkpoints and sinks

    @cached_property
    def facts(self) -> RunFacts:
        """What checkpoints of this run record about it (a user's loop sets its own)."""
        data = self.data
        return RunFacts(to_dict(self.cfg), data.classes, self.steps_per_epoch, self.ctx.world_size, data.fingerprint)

    @cached_property
    def checkpointer(self) -> Checkpointer:
        """The one owner of the run's checkpoint folder."""
        folder = self.out_dir / "checkpoints"
        agent = parent_agent_folder(self.env) if self.cfg.checkpoint.local_copy else None  # where the node's copies go
        copies = agent / "checkpoints" if agent is not None else None
        return Checkpointer(folder, self.strategy, self.cfg.checkpoint, self.facts, self.reporter.print, copies)

    @cached_property
    def reporter(self) -> Reporter:
        """The console (rank 0's) and the run's files: metrics.jsonl, config.yaml."""
        reporter = Reporter(self.ctx.is_main)
        self.stack.callback(reporter.close)
        return reporter

    def open_records(self, resumed_at: int | None, config: dict[str, Any] | None = None) -> None:
        """metrics.jsonl (continued after step `resumed_at` of a resumed run) and config.yaml
        (`config`, else the run's), both written once the run has trained a step."""
        text = OmegaConf.to_yaml(config if config is not None else to_dict(self.cfg))
        self.reporter.run_files(self.out_dir / "metrics.jsonl", resumed_at, {self.out_dir / "config.yaml": text})

    def announce(
        self, line: str, loop: Loop, resumed: tuple[Path | str, int] | None, always: Sequence[str] = (),
        config: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """The run's records opened (`open_records`) and its start said (session.announce_start)."""
        self.open_records(resumed[1] if resumed is not None else None, config)
        announce_start(self.reporter, line, loop, resumed, self.notes, always)

    def logs(self, resumed_at: int | None, loader: str | None = None) -> list[Callback]:
        """Every logging callback of a training run (console and metrics.jsonl, TensorBoard,
        trackers), as train attaches them and `multicard bench --logging` times them; `loader`:
        device, workers or user (a user's loop; default: the data's)."""
        cfg, is_main = self.cfg, self.ctx.is_main
        logs: list[Callback] = [TrainingLog(self.reporter, cfg.data, loader or self.data.loader)]
        if self.env.source == "torchrun":  # an agent's workers: it may start them again as nodes come and go
            logs.insert(0, Membership(self.ctx, self.env, self.reporter, self.out_dir / "metrics.jsonl"))
        if cfg.log.tensorboard:
            logs.append(TensorBoardLog(self.out_dir / "tensorboard", is_main, resumed_at))
        if cfg.log.mlflow or cfg.log.wandb:
            logs.append(TrackerLog(cfg, self.out_dir, is_main, resumed_at))
        return logs

    # ------------------------------------------------------------ the end

    def __enter__(self) -> Assembly:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        """Undo what was built, then leave the process group, except after an error of this rank
        alone: the group stays open on the way out, so peers see its connections close only once
        it has exited (cli.main exits right after the message) and the launcher reports this
        rank's exit code, not a peer's "connection closed". A graceful stop is every rank's
        decision: it tears down as usual. No exception is swallowed (nothing the stack holds does)."""
        try:
            self.stack.__exit__(kind, exc, tb)
        finally:
            started = "_process" in self.__dict__
            alone = isinstance(exc, MulticardError) and not isinstance(exc, Stopped)
            if started and not (alone and self.ctx.world_size > 1):
                teardown()
