"""The training side of a Run: its loop (multicard.engine.loop, the step `multicard train` takes too),
the epochs with resume and epoch-end checkpoints, the micro-steps its loaders announce, the
agreed stop, and the console, metrics and trackers the command line uses.

A step ends where the user's code for it ends: at the next batch, backward or epoch end. Its
checkpoint (every checkpoint_every steps, or at an agreed stop) is written then, so it holds
what the code after run.step changed (run.state, random streams), as a resumed run needs it.
A stop agreed on an epoch's last step waits for the epoch's end (the user's evaluation), then
saves the epoch and stops, as `multicard train` does; any other stop saves the step and stops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from multicard.base.errors import MulticardError, Stopped, UserError
from multicard.checkpoint import Checkpointer, RunFacts
from multicard.engine.loop import Hooks, Loop, Position, Schedule, StepEnd
from multicard.run.ending import on_error
from multicard.run.logbook import Logbook
from multicard.run.session import start_line
from multicard.run.settings import saved_config
from multicard.run.state import Monitor, UserState

if TYPE_CHECKING:
    from multicard.run.loading import Loader
    from multicard.run.runtime import Runtime


class Training:
    def __init__(self, runtime: Runtime, best: str | None, best_mode: str) -> None:
        self.rt = runtime
        cfg = runtime.cfg
        schedule = Schedule(0, 0, cfg.train.grad_accum, cfg.log_every, clip_grad_norm=cfg.clip_grad_norm)
        self.loop = Loop(runtime.strategy, schedule, runtime.stop)
        self.state = UserState()
        self.monitor = Monitor(best, best_mode)
        self.logbook = Logbook(self.loop, cfg.train.global_batch_size)
        self.loop.components.update(state=self.state, best=self.monitor)
        self.loop.position_state.append(self.logbook)
        self.loaders: list[Loader] = []
        self.checkpointer: Checkpointer | None = None
        self.begun = self.ended = False
        self._micro: int | None = None  # the micro-step of the batch the user holds (from a loader)
        self._micro_context = ExitStack()
        self._backwards = 0  # run.backward calls since the last optimizer step
        self._deferred: Stopped | None = None  # a stop agreed on an epoch's last step
        self._step_end: StepEnd | None = None  # the last step, until the user's code for it has run
        self._scheduler_state: dict[str, Any] | None = None  # a resumed scheduler's, until it is given
        runtime.watch(self.loop)
        on_error(self._failed)

    def _failed(self, exc: BaseException) -> None:
        """Before the process ends on a stop or an error of its own: writes complete, sinks closed
        (not on a lost peer: a pending write's barrier would wait for it)."""
        if isinstance(exc, (MulticardError, KeyboardInterrupt)):
            self.finish(exc)

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.loop.attach(model, optimizer)

    # ------------------------------------------------------------ what loaders announce (loading.MicroSteps)

    def begin_micro(self, micro: int) -> None:
        self.end_micro()
        if self.loop.model is not None:
            self._micro_context.enter_context(self.loop.micro_step(micro))
        self._micro = micro

    def end_micro(self) -> None:
        self._micro_context.close()
        self._micro = None

    def enter(self, phase: str) -> None:
        self.loop.clock.enter(phase)

    def settle(self) -> None:
        """The user's code for the last step has run: tell the callbacks (its checkpoint, if one is
        due), and stop there if the ranks agreed to (at an epoch's last step: after the epoch)."""
        if self._step_end is None:
            return
        step, self._step_end = self._step_end, None
        self.loop.hooks.on_step_end(self.loop, step)
        if step.stop_signal:
            self._stop(Stopped(step.stop_signal, step.global_step), defer=step.last_in_epoch)

    # ------------------------------------------------------------ epochs

    def epochs(self, n: int) -> Iterator[int]:
        self._begin(n)
        return self._epochs()

    def _begin(self, n: int) -> None:
        loop, rt = self.loop, self.rt
        if self.begun:
            raise UserError("run.epochs(...) was called twice; loop over one `for epoch in run.epochs(N)`")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UserError(f"run.epochs({n!r}): give the number of epochs, an integer >= 1")
        if loop.model is None or loop.optimizer is None:
            raise UserError("run.epochs(...) before run.setup(model, optimizer): set up the model and optimizer first")
        if not self.loaders:
            raise UserError("run.epochs(...) before run.loader(train_set): the training loader sets an epoch's steps")
        spe = self.loaders[0].steps_per_epoch
        rt.cfg = cfg = dataclasses.replace(rt.cfg, train=dataclasses.replace(rt.cfg.train, epochs=n))
        loop.schedule = dataclasses.replace(loop.schedule, steps_per_epoch=spe, total_steps=cfg.train.run_length(spe))
        rt.parts.facts = RunFacts(saved_config(cfg), [], spe, rt.ctx.world_size, script=rt.script)
        self.checkpointer = rt.parts.checkpointer
        resume_from = self.checkpointer.choose(cfg.train.resume)
        state = self.checkpointer.restore(resume_from, loop) if resume_from is not None else None
        if state is not None:
            self._scheduler_state = state.get("scheduler")
        rt.started = self.begun = True
        resumed = (resume_from, state["step"]) if resume_from is not None and state is not None else None
        line = start_line(rt.strategy, cfg.precision, rt.split, f"script={rt.script}")
        rt.parts.announce(line, loop, resumed, config=saved_config(cfg))
        logs = rt.parts.logs(resumed[1] if resumed is not None else None, loader="user")
        loop.hooks = Hooks([self.checkpointer, *logs])
        loop.hooks.on_fit_start(loop)

    def _epochs(self) -> Iterator[int]:
        loop = self.loop
        while not loop.finished:
            pos = loop.position
            last = loop.schedule.steps_in_epoch(pos.epoch)
            for loader in self.loaders:
                loader.set_epoch(pos.epoch, pos.step_in_epoch, last)
            self.logbook.start_epoch(fresh=pos.step_in_epoch == 0)
            yield pos.epoch
            self._end_epoch()
        self.finish(None)

    def _end_epoch(self) -> None:
        """Record the epoch, keep the best, move to the next epoch, save; then a deferred stop."""
        loop, pos = self.loop, self.loop.position
        self.end_micro()
        self.settle()
        record = self.logbook.epoch_record(self._lr())
        best = self.monitor.update(record, self.rt.reporter.print)
        cut = loop.finished and pos.step_in_epoch < loop.schedule.steps_per_epoch  # max_steps ended it early
        if not cut:
            loop.position = Position(pos.epoch + 1, 0, pos.global_step, pos.best_top1)
        loop.hooks.on_epoch_end(loop, record, None, best)
        if self._deferred is not None:
            stopped, self._deferred = self._deferred, None
            loop.hooks.on_stop(loop, stopped)
            raise stopped

    def _lr(self) -> float:
        return float(self.loop.optimizer.param_groups[0]["lr"]) if self.loop.optimizer is not None else 0.0

    # ------------------------------------------------------------ steps

    def _require_training(self, what: str) -> None:
        if self.loop.model is None:
            raise UserError(f"{what} before run.setup(model, optimizer): call run.setup first, train what it returns")
        if not self.begun:
            raise UserError(f"{what} outside `for epoch in run.epochs(N)`: train in that loop (it resumes and saves)")

    def backpropagate(self, loss: torch.Tensor) -> None:
        self._require_training("run.backward(loss)")
        self.settle()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise UserError("run.backward(loss) takes the loss: one number that needs gradients (e.g. a mean)")
        self.logbook.watch_loss(loss)
        self.loop.backpropagate(loss)
        self._backwards += 1

    def step(self, optimizer: torch.optim.Optimizer | None, scheduler: Any) -> bool:
        loop = self.loop
        self._require_training("run.step(...)")
        if optimizer is not None and optimizer is not loop.optimizer:
            raise UserError("run.step(optimizer) got another optimizer than run.setup returned; step that one")
        if scheduler is not None and scheduler is not loop.scheduler:
            self._attach_scheduler(scheduler)
        if self._backwards == 0:
            raise UserError("run.step(...) without run.backward(loss) since the last step; call run.backward first")
        accum = loop.schedule.grad_accum
        if (self._micro if self._micro is not None else self._backwards - 1) < accum - 1:
            return False  # a micro-step of the global batch: its gradients wait for the others
        loop.optimizer_step()
        self._backwards = 0
        loop.count_step()
        times, signum = loop.end_step()
        self.logbook.add_step(times)
        pos = loop.position
        ends = pos.step_in_epoch >= loop.schedule.steps_in_epoch(pos.epoch)
        if pos.global_step % loop.schedule.log_every == 0 or ends or signum:
            loop.hooks.on_log(loop, self.logbook.step_record(self._lr()))
        self._step_end = StepEnd(pos.epoch, pos.global_step, pos.step_in_epoch, ends, times, signum)
        return True

    def _stop(self, stopped: Stopped, defer: bool) -> None:
        if defer:  # the epoch's last step: its end (evaluation, checkpoint) comes first
            self._deferred = stopped
            return
        self.loop.hooks.on_stop(self.loop, stopped)
        raise stopped

    def _attach_scheduler(self, scheduler: Any) -> None:
        attach_scheduler(self.loop, scheduler, self._scheduler_state)
        self._scheduler_state = None

    def save(self) -> Any:
        self._require_training("run.save()")
        self.settle()
        assert self.checkpointer is not None
        return self.checkpointer.save(self.loop)

    # ------------------------------------------------------------ the end

    def finish(self, ending: BaseException | None) -> None:
        """Training is over (done, stopped or failed): writes complete, sinks closed."""
        if self.begun and not self.ended:
            self.ended = True
            self.end_micro()
            if ending is None:
                self.settle()  # the last step's due checkpoint
            self.loop.ending = ending
            self.loop.hooks.on_fit_end(self.loop)

    def close(self, settle: bool = True) -> None:
        """`settle`: the script ended normally (else nothing that waits for the other ranks runs)."""
        if settle:
            self.finish(None)
        for loader in self.loaders:
            loader.close()


def attach_scheduler(loop: Loop, scheduler: Any, saved: dict[str, Any] | None) -> None:
    """The LR scheduler the user's first run.step gives; in a resumed run, at the `saved` state."""
    if loop.scheduler is not None:
        raise UserError("run.step got another scheduler than before; pass the same one at every step")
    if getattr(scheduler, "optimizer", loop.optimizer) is not loop.optimizer:
        raise UserError("the scheduler steps another optimizer than run.setup returned; build it from that one")
    loop.scheduler = scheduler
    if saved is not None:  # continue the schedule where it was, with the learning rates it had set
        scheduler.load_state_dict(saved)
        for group, lr in zip(loop.optimizer.param_groups, scheduler.get_last_lr(), strict=False):  # type: ignore[union-attr]
            group["lr"] = lr
