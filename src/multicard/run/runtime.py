"""What a Run needs before its model and data, built from its config as `multicard train`
builds its own (session.py): the launcher's environment, the process group and device, the
strategy, the batch split, graceful stop, out_dir and its lock, the console and metrics file,
and (once the loop exists) the stall watchdog.

Signal handlers are installed here, after the user's script has imported its own modules: a
module that set SIGTERM to be ignored at import would otherwise disable the graceful stop.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

from multicard.base.config import Config
from multicard.base.errors import UserError
from multicard.data import loader_processes
from multicard.data.loading.sampling import BatchSplit
from multicard.engine.loop import Loop
from multicard.observe.telemetry import Reporter
from multicard.run.ending import on_error
from multicard.run.preflight import check_extras, prepare_out_dir
from multicard.run.session import seed_process, start_process, watch_for_stalls
from multicard.runtime.environment import detect_env
from multicard.runtime.exits import die_with_launcher
from multicard.runtime.process_group import teardown
from multicard.runtime.run_lock import RunLock
from multicard.runtime.stopping import GracefulStop
from multicard.strategy.topology import resolve


class Runtime:
    def __init__(self, cfg: Config, script: str) -> None:
        self.cfg, self.script = cfg, script
        self._stack = ExitStack()
        self.started = False  # training began: files of this run exist beside the lock
        self.lock: RunLock | None = None
        on_error(self.abandon)
        env = detect_env()
        die_with_launcher(env)
        check_extras(cfg)
        topology = resolve(cfg, env.world_size, env.local_world_size, env.launched)
        self.ctx, self.strategy = start_process(cfg, env, topology)
        self.split = BatchSplit(cfg.train.global_batch_size, cfg.train.grad_accum, self.ctx.world_size)
        self.stop = self._stack.enter_context(GracefulStop(self.strategy.start_max, announce=self.ctx.is_main))
        self.reporter = Reporter(self.ctx.is_main)
        self._stack.callback(self.reporter.close)
        fresh = not Path(cfg.out_dir).exists()
        self.out_dir = prepare_out_dir(cfg.out_dir)
        self.lock = RunLock(self.out_dir, made_out_dir=fresh)
        if self.ctx.is_main:
            self.lock.acquire(self.reporter.print)
        seed_process(cfg.seed)  # a model built after this starts from the same weights on every rank

    def watch(self, loop: Loop) -> None:
        """Heartbeats and stall reports for as long as the run lasts (debug.stall_s)."""
        watch_for_stalls(self.cfg, self.ctx, loop, self._stack)

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
