"""What a Run needs before its model and data, built from its config by the Assembly that builds
a `multicard train` run (assembly.py): the launcher's environment, the process group and device,
the strategy, the batch split, graceful stop, out_dir and its lock, the console and metrics file,
and (once the loop exists) the stall watchdog; later its checkpointer and sinks (training.py).

Signal handlers are installed here, after the user's script has imported its own modules: a
module that set SIGTERM to be ignored at import would otherwise disable the graceful stop.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from multicard.base.config import Config
from multicard.base.errors import UserError
from multicard.data import loader_processes
from multicard.engine.loop import Loop
from multicard.run.assembly import Assembly
from multicard.run.ending import on_error
from multicard.run.preflight import check_extras, claim_out_dir
from multicard.run.session import seed_process
from multicard.runtime.environment import detect_env
from multicard.runtime.exits import die_with_launcher
from multicard.runtime.process_group import teardown
from multicard.runtime.run_lock import RunLock


class Runtime:
    def __init__(self, cfg: Config, script: str) -> None:
        self.script = script
        self._stack = ExitStack()
        self.started = False  # training began: files of this run exist beside the lock
        self.lock: RunLock | None = None
        on_error(self.abandon)
        env = detect_env()
        die_with_launcher(env)
        check_extras(cfg)
        self.parts = Assembly(cfg, env, stack=self._stack)
        self.ctx, self.strategy = self.parts.ctx, self.parts.strategy
        self.split = self.parts.batch_split
        self.stop = self.parts.stop
        self.reporter = self.parts.reporter
        self.lock = claim_out_dir(cfg.out_dir, self.ctx.is_main, self.reporter.print, cfg.checkpoint.dir)
        self.out_dir = self.parts.out_dir
        seed_process(cfg.seed)  # a model built after this starts from the same weights on every rank

    @property
    def cfg(self) -> Config:
        return self.parts.cfg

    @cfg.setter
    def cfg(self, cfg: Config) -> None:  # run.epochs(n) sets train.epochs: the run's parts see it too
        self.parts.cfg = cfg

    def watch(self, loop: Loop) -> None:
        """Heartbeats and stall reports for as long as the run lasts (debug.stall_s)."""
        self.parts.watch(loop)

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

    def abandon(self, exc: BaseException | None = None) -> None:
        """An error ends the process: release out_dir (as found, if the run never started), and
        close files; the process group is left to the exit (see exits.report_error)."""
        if self.lock is not None:
            if not self.started:
                self.lock.refused()
            self.lock.release()
        self._stack.pop_all()  # the watchdog is a daemon thread; signal handlers stay until the end
        if hasattr(self, "reporter"):
            self.reporter.close()

    def close(self) -> None:
        """Stop the watchdog, restore signal handlers, close files, release out_dir, leave the group."""
        try:
            self._stack.close()
            if self.lock is not None:
                self.lock.release()
        finally:
            teardown()
