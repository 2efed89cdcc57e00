"""The training side of a Run, the one training-loop control of multicard (a user's loop and
`multicard train`'s classifier recipe alike): its loop (multicard.engine.loop, the one step), the
epochs (or steps) with resume and epoch-end checkpoints, the micro-steps its loaders announce, the
agreed stop, and the console, metrics and trackers.

A step is one global batch of the training loader, whatever number of optimizers stepped in it,
and it ends where the user's code for the batch ends: at the next batch, at the end of the
loader's epoch, or at run.save. Then the step is counted in the records, its checkpoint is
written (every checkpoint_every steps, or at an agreed stop) and a stop takes effect: never
between two optimizers' updates of one batch, and holding what the code after run.step changed
(run.state, random streams), as a resumed run needs it. A stop agreed on an epoch's last step
waits for the epoch's end (the code after the batches: an evaluation), then saves the epoch and
stops; any other stop saves the step and stops.

The run's length is decided once, when its loop begins (run.epochs(n) or run.steps(n)): the
schedule and the facts its checkpoints record (assembly/plan.py), then the checkpointer, the
resume and the start (`start`).

Every way out of a loop ends: `break` out of the batches ends the epoch there (the next epoch
starts at its first batch; the run still ends after its epochs), a loader iterated twice in one
epoch is refused, and each step polls the stop.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch

from multicard.assembly.plan import DataFacts, RunLength
from multicard.base.errors import MulticardError, Stopped, UserError
from multicard.checkpoint import Checkpointer
from multicard.engine.loop import Callback, Hooks, Loop, Position, StepEnd
from multicard.engine.meters import EvalResult
from multicard.run.ending import forget, on_error
from multicard.run.logbook import Logbook
from multicard.run.preparation import OptimizerGuard, OwnSteps
from multicard.run.state import Monitor, UserState
from multicard.run.stepping import Steps

if TYPE_CHECKING:
    from multicard.assembly.parts import Assembly
    from multicard.run.loading import Loader


class Training:
    def __init__(
        self, parts: Assembly, best: str | None, best_mode: str, callbacks: Sequence[Callback] = (),
        epoch_names: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.parts, self.plan = parts, parts.plan
        cfg = self.plan.cfg
        self.loop = Loop(parts.strategy, parts.stop)
        self.guard = OptimizerGuard()
        self.steps = Steps(self.loop, self.guard)
        self.state = UserState()
        self.monitor = Monitor(best, best_mode)
        names = dict(epoch_names or {})
        self.logbook = Logbook(self.loop, cfg.train.global_batch_size, names, of_config=self.plan.script is None)
        self.loop.components.update(state=self.state, best=self.monitor)
        self.loop.position_state.append(self.logbook)
        self.callbacks = list(callbacks)
        self.loaders: list[Loader] = []
        self.data, self.loader_kind = DataFacts(), "user"  # the training data's facts, and its loader (run.loader)
        self.length: RunLength | None = None
        self.checkpointer: Checkpointer | None = None
        self.begun = self.ended = False
        self.last_step = 0  # where the epoch in progress ends
        self._micro: int | None = None  # the micro-step of the batch the user holds (from a loader)
        self._micro_context = ExitStack()
        self._deferred: Stopped | None = None  # a stop agreed on an epoch's last step
        self._replaying = False  # an epoch resumed in the middle, before its first batch
        parts.watch(self.loop)
        on_error(self._failed)

    def _failed(self, exc: BaseException) -> None:
        """Before the process ends on a stop or an error of its own: writes complete, sinks closed."""
        if isinstance(exc, (MulticardError, KeyboardInterrupt)):
            self.finish(exc)

    # ------------------------------------------------------------ what loaders announce (loading.MicroSteps)

    def begin_micro(self, micro: int) -> None:
        # The resumed epoch's first batch: its start has run again (run.state).
        self._replaying = self._replaying and self.state.replaying(False)
        self.end_micro()
        if self.loop.trained:
            self._micro_context.enter_context(self.loop.micro_step(micro))
        self._micro = micro

    def end_micro(self) -> None:
        self._micro_context.close()
        self._micro = None

    micro = property(lambda self: self._micro)

    def enter(self, phase: str) -> None:
        self.loop.clock.enter(phase)

    def settle(self) -> None:
        """The user's code for the last global batch has run: count its step in the records, tell
        the callbacks (its checkpoint, if one is due), and stop there if the ranks agreed to (at an
        epoch's last step: after the epoch)."""
        if not self.steps.counted:
            return
        loop = self.loop
        self.steps.end_batch()
        times, signum = loop.end_step()
        self.logbook.add_step(times)
        pos = loop.position
        ends = pos.step_in_epoch >= self.last_step
        if pos.global_step % loop.schedule.log_every == 0 or ends or signum:
            loop.hooks.on_log(loop, self.logbook.step_record(lr_of(loop)))
        loop.hooks.on_step_end(loop, StepEnd(pos.epoch, pos.global_step, pos.step_in_epoch, ends, times, signum))
        if signum:
            self._stop(Stopped(signum, pos.global_step), defer=ends)

    # ------------------------------------------------------------ epochs and steps

    def epochs(self, n: int) -> Iterator[int]:
        self._begin(n, "run.epochs")
        return self._epochs()

    def steps_of(self, n: int) -> Iterator[Any]:
        self._begin(n, "run.steps")
        return self._steps()

    def _begin(self, n: int, what: str) -> None:
        if self.begun:
            raise UserError(f"{what}(...) was called twice; loop over one `for ... in run.epochs(N)` or run.steps(N)")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UserError(f"{what}({n!r}): give the number of {what[4:]}, an integer >= 1")
        if not self.loop.steppers:
            raise UserError(f"{what}(...) before run.setup(model, optimizer): set up the model and optimizer first")
        if not self.loaders:
            raise UserError(f"{what}(...) before run.loader(train_set): the training loader sets an epoch's steps")
        self.length = self.plan.length(n, what, self.loaders[0].steps_per_epoch, self.data)
        self.loop.begin(self.length.schedule)
        self.checkpointer = self.parts.checkpointer(self.length.facts)
        start(self)

    def _epochs(self) -> Iterator[int]:
        while not self.loop.finished:
            self._start_epoch()
            yield self.loop.position.epoch
            self._end_epoch()
        self.finish(None)

    def _steps(self) -> Iterator[Any]:
        """The training loader's micro-batches, epoch after epoch, until the run's steps are done."""
        while not self.loop.finished:
            before = self._start_epoch()
            yield from self.loaders[0]
            if self.loop.position.global_step == before and len(self.loaders[0]):
                raise UserError("run.steps(N): a pass over the training data took no optimizer step; call "
                                "run.backward(loss) and run.step(optimizer) for its batches")  # fmt: skip
            self._end_epoch()
        self.finish(None)

    def _start_epoch(self) -> int:
        pos = self.loop.position
        self.last_step = self.loop.schedule.last_step(pos)
        for loader in self.loaders:
            loader.set_epoch(pos.epoch, pos.step_in_epoch, self.last_step)
        self.logbook.start_epoch(fresh=pos.step_in_epoch == 0)
        self._replaying = pos.step_in_epoch > 0
        self.state.replaying(self._replaying)
        return pos.global_step

    def _end_epoch(self) -> None:
        """Record the epoch, keep the best, move to the next epoch, save; then a deferred stop."""
        loop, pos = self.loop, self.loop.position
        self.end_micro()
        self.settle()
        self._replaying = self._replaying and self.state.replaying(False)
        if self.steps.drop_partial():
            self.parts.reporter.print(f"warning: epoch {pos.epoch} ended in the middle of a global batch (a break "
                                      f"between its micro-steps?); their gradients were dropped")  # fmt: skip
        if self.logbook.steps_since_record:  # an epoch left early: its last steps' record first
            loop.hooks.on_log(loop, self.logbook.step_record(lr_of(loop)))
        record = self.logbook.epoch_record(lr_of(loop))
        best = self.monitor.update(record, self.parts.reporter.print)
        cut = pos.global_step >= loop.schedule.total_steps and pos.step_in_epoch < loop.schedule.steps_per_epoch
        if not cut:  # else max_steps ended the run inside the epoch: a longer rerun continues it there
            loop.position = Position(pos.epoch + 1, 0, pos.global_step)
        for loader in self.loaders:
            loader.end_epoch()
        loop.hooks.on_epoch_end(loop, record, EvalResult.in_record(record), best)
        if self._deferred is not None:
            stopped, self._deferred = self._deferred, None
            loop.hooks.on_stop(loop, stopped)
            raise stopped

    # ------------------------------------------------------------ steps

    def _require_training(self, what: str) -> None:
        require_training(what, bool(self.loop.trained), self.begun)

    def backpropagate(self, loss: torch.Tensor) -> None:
        self._require_training("run.backward(loss)")
        if self._micro is None:  # a batch not drawn from run.loader: a backward after a step begins the next
            self.settle()
        self.steps.backpropagate(loss)
        self.logbook.watch_loss(loss)

    def step(self, optimizer: torch.optim.Optimizer | None, scheduler: Any, clip: float | None) -> bool:
        self._require_training("run.step(...)")
        return self.steps.step(optimizer, scheduler, clip, self._micro)

    def _stop(self, stopped: Stopped, defer: bool) -> None:
        if defer:  # the epoch's last step: its end (evaluation, checkpoint) comes first
            self._deferred = stopped
            return
        self.loop.hooks.on_stop(self.loop, stopped)
        raise stopped

    def save(self) -> Any:
        self._require_training("run.save()")
        self.settle()
        if self.checkpointer is None:
            raise UserError("run.save(): this run writes no checkpoints")
        return OwnSteps(self.checkpointer, self.guard).save(self.loop)

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
            # A stop signal from here on has nothing left to save.
            self.parts.stop.training_ended(complete=ending is None and self.loop.finished, failed=ending is not None)

    def close(self, settle: bool = True) -> None:
        """`settle`: the run ended normally (else nothing that waits for the other ranks runs)."""
        if settle:
            self.finish(None)
        for loader in self.loaders:
            loader.close()
        self.guard.close()
        forget(self._failed)


def start(training: Training) -> None:
    """Resume from the newest checkpoint (or the one `resume` names), say so, open the sinks."""
    loop, parts, length = training.loop, training.parts, training.length
    assert length is not None
    checkpointer, resumed = training.checkpointer, None
    resume_from = checkpointer.choose(length.train.resume) if checkpointer is not None else None
    if checkpointer is not None and resume_from is not None:
        with training.guard.inside():
            resumed = (resume_from, checkpointer.restore(resume_from, loop)["step"])
    parts.started = training.begun = True
    parts.announce(loop, resumed, length.facts.config, training.loader_kind)
    logs = parts.logs(resumed[1] if resumed is not None else None, training.loader_kind)
    saves: list[Any] = [OwnSteps(checkpointer, training.guard)] if checkpointer is not None else []  # a Callback
    loop.hooks = Hooks([*saves, *logs, *training.callbacks])
    loop.hooks.on_fit_start(loop)


def require_training(what: str, set_up: bool, begun: bool) -> None:
    if not set_up:
        raise UserError(f"{what} before run.setup(model, optimizer): call run.setup first, train what it returns")
    if not begun:
        raise UserError(f"{what} outside `for epoch in run.epochs(N)`: train in that loop (it resumes and saves)")


def lr_of(loop: Loop) -> float:
    return float(loop.optimizer.param_groups[0]["lr"]) if loop.optimizer is not None else 0.0
