"""A run's plan: what is decided about it before any of its parts is built, and never changed after.

`plan_run` decides, from the config and this process's environment, the topology (the strategy
and its GPUs, with the config's rules for them: strategy/topology.py), the batch split, who made
the run's checks (multicard's launcher, or this process: preflight.py) and what the run writes
(its records, its checkpoints). The run's length follows once, when its loop begins
(`RunPlan.length`): an epoch's steps are the training data's, and a script says how many epochs
(or steps) it trains only to run.epochs(n) (run.steps(n)); the schedule and the facts its
checkpoints record are made from it there. The parts (parts.py) are built from the plan; nothing
writes into it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from multicard.base.config import Config, TrainConfig, check_world_sizes, to_dict
from multicard.base.errors import UserError
from multicard.checkpoint import RunFacts
from multicard.data import BatchSplit
from multicard.engine.loop import Schedule
from multicard.runtime.environment import ProcessEnv
from multicard.strategy.topology import Topology, resolve

# Config sections that describe the command line's classifier runs (its data, model, optimizer and
# recipe): a user's loop brings its own, so its checkpoints and config.yaml do not hold them.
NOT_A_RUN_SETTING = ("data", "model", "optim", "sched", "mix", "ema", "eval_flip", "train.label_smoothing")


def saved_config(cfg: Config, script: str | None) -> dict[str, Any]:
    """What a run's config.yaml and checkpoints hold: the whole config (a run of multicard train's,
    whose model and data `multicard eval` rebuilds from it), or a script's own settings."""
    data = to_dict(cfg)
    if script is None:
        return data
    for key in NOT_A_RUN_SETTING:
        section, _, field = key.partition(".")
        if field:
            data[section].pop(field, None)
        else:
            data.pop(section, None)
    return data


@dataclass(frozen=True)
class DataFacts:
    """What checkpoints record of the training data (the data layer's, given to run.loader)."""

    classes: tuple[str, ...] = ()
    fingerprint: str | None = None  # of the sample list (data.sample_list_fingerprint)


@dataclass(frozen=True)
class RunLength:
    """The run's length and what follows from it, decided when its loop begins."""

    train: TrainConfig  # train.epochs and train.max_steps as the run trains them
    schedule: Schedule
    facts: RunFacts


@dataclass(frozen=True)
class RunPlan:
    cfg: Config
    env: ProcessEnv
    topology: Topology
    split: BatchSplit | None  # None: an evaluation (no training, no batch split)
    script: str | None = None  # a user's script (multicard.Run); None: a run of a config (multicard train)
    checked: bool = False  # multicard's launcher made the run's checks and holds out_dir (preflight.py)
    records: bool = True  # the console, metrics.jsonl, config.yaml, TensorBoard and trackers
    checkpoints: bool = True

    @property
    def training(self) -> bool:
        return self.split is not None

    def length(self, n: int, what: str, steps_per_epoch: int, data: DataFacts) -> RunLength:
        """The length of run.epochs(n) or run.steps(n) (`what`) over epochs of `steps_per_epoch`."""
        cfg = self.cfg
        train = run_length(cfg.train, n, what, steps_per_epoch)
        schedule = Schedule(
            steps_per_epoch, train.run_length(steps_per_epoch), cfg.train.grad_accum, cfg.log_every,
            clip_grad_norm=cfg.clip_grad_norm, epochs=n if what == "run.epochs" else 0,
        )  # fmt: skip
        saved = saved_config(dataclasses.replace(cfg, train=train), self.script)
        world = self.topology.world_size
        facts = RunFacts(saved, list(data.classes), steps_per_epoch, world, data.fingerprint, self.script)
        return RunLength(train, schedule, facts)


def run_length(train: TrainConfig, n: int, what: str, steps_per_epoch: int) -> TrainConfig:
    """train.epochs and train.max_steps of run.epochs(n) or run.steps(n) (its epochs: as many as it takes)."""
    if what == "run.epochs":
        return dataclasses.replace(train, epochs=n)
    if train.max_steps and train.max_steps != n:
        raise UserError(f"run.steps({n}) with Run(max_steps={train.max_steps}): give the steps once, to run.steps")
    return dataclasses.replace(train, epochs=-(-n // steps_per_epoch), max_steps=n)


def batch_split(train: TrainConfig, env: ProcessEnv) -> BatchSplit:
    """The global batch over this world size; an elastic job's must split at every size it may run at."""
    if env.nnodes is not None:
        check_world_sizes(train.global_batch_size, train.grad_accum, env.world_sizes, env.nnodes)
    return BatchSplit(train.global_batch_size, train.grad_accum, env.world_size)


def plan_run(
    cfg: Config, env: ProcessEnv, *, script: str | None = None, checked: bool = False, training: bool = True,
    records: bool = True, checkpoints: bool = True,
) -> RunPlan:  # fmt: skip
    """The plan of a run of `cfg` in this process: its topology and batch split decided (a one-line
    error if the config does not fit them), nothing built yet."""
    topology = resolve(cfg, env.world_size, env.local_world_size, env.launched, training=training)
    split = batch_split(cfg.train, env) if training else None
    return RunPlan(cfg, env, topology, split, script, checked, records, checkpoints)
