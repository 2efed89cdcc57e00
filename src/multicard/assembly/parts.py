"""The one place a run's parts are built, from its frozen plan (plan.py): `Assembly`.

multicard.Run (a user's loop, and `multicard train`'s classifier recipe written on it) and
`multicard eval` take every part of a run from an Assembly: the checks and out_dir's lock
(preflight.py), the process (process group, device, strategy), graceful stop, the console and the
run's files, the stall watchdog, the checkpointer and the logging callbacks (metrics.jsonl,
TensorBoard, trackers). The sinks and the checkpointer are constructed here and nowhere else. Each
part is built where it is first asked for (an evaluation makes no stop, sinks or checkpointer);
what undoes a part (signal handlers, the watchdog, files, the lock) is registered on the
Assembly's exit stack, and closing it leaves the process group.
"""

from __future__ import annotations

from contextlib import ExitStack
from functools import cached_property
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from multicard.assembly.plan import RunPlan
from multicard.assembly.preflight import preflight
from multicard.assembly.process import announce_start, start_process, watch_for_stalls
from multicard.base.config import Config
from multicard.base.errors import MulticardError, Stopped, UserError
from multicard.checkpoint import Checkpointer, RunFacts
from multicard.data import BatchSplit, loader_processes
from multicard.engine.loop import Callback, Loop
from multicard.observe.membership import Membership
from multicard.observe.telemetry import Reporter, TensorBoardLog, TrainingLog
from multicard.observe.tracking import TrackerLog
from multicard.observe.watchdog import Watchdog
from multicard.runtime.environment import parent_agent_folder
from multicard.runtime.process_group import ProcessContext, teardown
from multicard.runtime.run_lock import RunLock
from multicard.runtime.stopping import POLL_EVERY, GracefulStop
from multicard.strategy.base import Strategy


class Assembly:
    """The parts of one run of `plan` in this process, each built on first use; `close` (or `with`)
    undoes them."""

    def __init__(self, plan: RunPlan) -> None:
        self.plan = plan
        self.stack = ExitStack()
        self.lock: RunLock | None = None  # out_dir's, where this process holds it (claim)
        self.started = False  # training began: files of this run exist beside the lock
        self.watchdog: Watchdog | None = None  # heartbeats and stall reports, once a loop is watched
        self._checkpointer: Checkpointer | None = None

    @property
    def cfg(self) -> Config:
        return self.plan.cfg

    out_dir = property(lambda self: Path(self.plan.cfg.out_dir))

    def claim(self) -> None:
        """The run's checks and out_dir (its lock held by rank 0): preflight.py, unless multicard's
        launcher made them. Before the process group starts: bad input costs no start-up."""
        plan = self.plan
        if not plan.checked:
            say = print if plan.records else (lambda line: None)
            self.lock = preflight(plan.cfg, plan.env.is_main, say, plan.script)

    # ------------------------------------------------------------ the process

    @cached_property
    def _process(self) -> tuple[ProcessContext, Strategy]:
        return start_process(self.plan.cfg, self.plan.env, self.plan.topology)

    @property
    def ctx(self) -> ProcessContext:
        """rank, world size, device"""
        return self._process[0]

    @property
    def strategy(self) -> Strategy:
        """single, dp, ddp or fsdp"""
        return self._process[1]

    @property
    def split(self) -> BatchSplit:
        assert self.plan.split is not None, "an evaluation has no batch split"
        return self.plan.split

    @cached_property
    def stop(self) -> GracefulStop:
        """Graceful-stop signal handling, from here until the run ends. One process agrees with itself
        at every step (an elastic job shrunk to one stops at once when a node joins)."""
        every = 1 if self.ctx.world_size == 1 else POLL_EVERY
        return self.stack.enter_context(GracefulStop(self.strategy.start_max, every, announce=self.ctx.is_main))

    @cached_property
    def reporter(self) -> Reporter:
        """The console (rank 0's) and the run's files: metrics.jsonl, config.yaml (silent without records)."""
        reporter = Reporter(self.ctx.is_main and self.plan.records)
        self.stack.callback(reporter.close)
        return reporter

    def watch(self, loop: Loop) -> None:
        """Heartbeats and stall reports for `loop` (debug.stall_s) for as long as the run lasts."""
        self.watchdog = watch_for_stalls(self.plan.cfg, self.ctx, loop, self.stack)

    def loader_processes(self, requested: int) -> int:
        if requested < 0:
            raise UserError(f"num_workers={requested} must be >= 0 (loader processes per rank)")
        return loader_processes(requested, self.ctx)

    def check_same_on_every_rank(self, dataset: Any, what: str) -> None:
        """Every rank sees the same number of samples: else their batches and steps would differ
        and the job would hang at the first collective one rank never reaches."""
        kinds = self.ctx.all_gather_object((len(dataset), type(dataset).__name__))
        for rank, (size, kind) in enumerate(kinds):
            if (size, kind) != kinds[0]:
                error = UserError(
                    f"{what}: the ranks were given different datasets (rank {rank}: {size} samples of {kind}, "
                    f"rank 0: {kinds[0][0]} of {kinds[0][1]}); give every rank the same dataset (the run splits it)"
                )
                error.every_rank = True
                raise error

    # ------------------------------------------------------------ checkpoints and sinks

    def checkpointer(self, facts: RunFacts) -> Checkpointer | None:
        """The one owner of the run's checkpoint folder, made once from the run's facts (None: a run
        without checkpoints, as the tools that time a loop run it)."""
        if self.plan.checkpoints and self._checkpointer is None:
            folder = self.out_dir / "checkpoints"
            agent = parent_agent_folder(self.plan.env) if self.cfg.checkpoint.local_copy else None  # the node's copies
            copies = agent / "checkpoints" if agent is not None else None
            self._checkpointer = Checkpointer(
                folder, self.strategy, self.cfg.checkpoint, facts, self.reporter.print, copies
            )
        return self._checkpointer

    def announce(self, loop: Loop, resumed: tuple[Path | str, int] | None, config: dict[str, Any], loader: str) -> None:
        """metrics.jsonl (continued after the step a resumed run restarts from) and config.yaml
        (`config`), written once the run has trained a step, then the run's start said
        (process.announce_start): a script, or a config's model and data (`loader`: its kind)."""
        plan = self.plan
        text = OmegaConf.to_yaml(config)
        resumed_at = resumed[1] if resumed is not None else None
        self.reporter.run_files(self.out_dir / "metrics.jsonl", resumed_at, {self.out_dir / "config.yaml": text})
        what = (f"script={plan.script}" if plan.script is not None
                else f"model={plan.cfg.model.name} data={plan.cfg.data.name} loader={loader}")  # fmt: skip
        announce_start(self.reporter, self.strategy, plan.cfg, self.split, what, loop, resumed)

    def logs(self, resumed_at: int | None, loader: str) -> list[Callback]:
        """Every logging callback of a training run (console and metrics.jsonl, TensorBoard,
        trackers), none without records; `loader`: device, workers or user (what the data-bound
        advice names)."""
        if not self.plan.records:
            return []
        cfg, is_main = self.cfg, self.ctx.is_main
        logs: list[Callback] = [TrainingLog(self.reporter, cfg.data, loader)]
        if self.plan.env.source == "torchrun":  # an agent's workers: it may start them again as nodes come and go
            logs.insert(0, Membership(self.ctx, self.plan.env, self.reporter, self.out_dir / "metrics.jsonl"))
        if cfg.log.tensorboard:
            logs.append(TensorBoardLog(self.out_dir / "tensorboard", is_main, resumed_at))
        if cfg.log.mlflow or cfg.log.wandb:
            logs.append(TrackerLog(cfg, self.out_dir, is_main, resumed_at))
        return logs

    # ------------------------------------------------------------ the end

    def abandon(self, exc: BaseException | None = None) -> None:
        """An error ends the process (a script's uncaught error): release out_dir (as found, if the
        run never started), and close files; the process group is left to the exit (exits.report_error)."""
        self._release(refused=not self.started)
        self.stack.pop_all()  # the watchdog is a daemon thread; signal handlers stay until the end
        if "reporter" in self.__dict__:
            self.reporter.close()

    def close(self, error: BaseException | None = None) -> None:
        """Undo what was built, release out_dir (as found if `error` refused the run or came before it
        started), then leave the process group, except after an error of this rank alone: the group
        stays open on the way out, so peers see its connections close only once it has exited and
        the launcher reports this rank's exit code, not a peer's "connection closed". A graceful
        stop is every rank's decision: it tears down as usual."""
        try:
            self.stack.close()
            self._release(refused=error is not None and (isinstance(error, UserError) or not self.started))
        finally:
            alone = isinstance(error, MulticardError) and not isinstance(error, Stopped)
            if "_process" in self.__dict__ and not (alone and self.ctx.world_size > 1):
                teardown()

    def _release(self, refused: bool) -> None:
        if self.lock is not None:
            if refused:
                self.lock.refused()
            self.lock.release()
            self.lock = None

    def __enter__(self) -> Assembly:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)
