"""`run.backward(loss)` and `run.step(optimizer, scheduler)` of a Run with one or several optimizers.

A global batch of the training loader is one step of the run, whatever number of optimizers
stepped in it (a GAN's discriminator and generator, or every fifth batch for one of them): the
run's position counts global batches. Each optimizer steps at the last micro-step of a global
batch, when run.backward has been called since its own last step, with its own clipping and LR
scheduler; one fp16 GradScaler serves all (each optimizer skips its step on its own inf/NaN; the
scale is updated once per global batch, when the user's code for it has ended).

A backward may leave gradients in parameters of an optimizer that has already stepped in this
batch (the generator's loss through the discriminator): with several optimizers, or parameters
no optimizer holds, every parameter's gradient is cleared when the batch ends, as a plain loop's
`zero_grad()` at the start of each update does.
"""

from __future__ import annotations

from typing import Any

import torch

from multicard.base.errors import UserError
from multicard.engine.loop import Loop, Stepper
from multicard.run.preparation import OptimizerGuard


class Steps:
    def __init__(self, loop: Loop, guard: OptimizerGuard) -> None:
        self.loop, self.guard = loop, guard
        self.backwards = 0  # run.backward calls so far
        self.seen: dict[int, int] = {}  # optimizer (its index) → backwards at its last step
        self.counted = False  # this global batch's step has been counted (some optimizer stepped)
        self.settled = 0  # backwards when the last counted global batch ended
        self._stray: list[torch.Tensor] | None = None

    def backpropagate(self, loss: torch.Tensor) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise UserError("run.backward(loss) takes the loss: one number that needs gradients (e.g. a mean)")
        self.loop.backpropagate(loss)
        self.backwards += 1

    def step(self, optimizer: Any, scheduler: Any, clip: float | None, micro: int | None) -> bool:
        """Step `optimizer` if this is the last micro-step of the global batch; whether it stepped."""
        index, stepper = self._find(optimizer)
        if scheduler is not None and scheduler is not stepper.scheduler:
            self._bind(index, stepper, scheduler)
        done = self.backwards - self.seen.get(index, 0)
        if done == 0:
            raise UserError("run.step(...) without run.backward(loss) since the last step; call run.backward first")
        if (micro if micro is not None else done - 1) < self.loop.schedule.grad_accum - 1:
            return False  # a micro-step of the global batch: its gradients wait for the others
        with self.guard.inside():
            self.loop.optimizer_step(stepper, clip, update=False)
        self.seen[index] = self.backwards
        if not self.counted:
            self.loop.count_step()
            self.counted = True
        return True

    def every(self, n: int) -> bool:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UserError(f"run.every({n!r}): give a number of steps, an integer >= 1")
        return self.counted and self.loop.position.global_step % n == 0

    def end_batch(self) -> None:
        """The global batch's code has ended (it counted a step): the fp16 scale for the next, and
        gradients left where no optimizer will take them cleared."""
        self.counted = False
        self.settled = self.backwards
        self.loop.update_scale()
        for p in self._stray_params():
            p.grad = None

    def drop_partial(self) -> bool:
        """An epoch left in the middle of a global batch (a `break` between micro-steps): its
        accumulated gradients are dropped; whether there were any."""
        if self.backwards == self.settled:
            return False
        for trained in self.loop.trained:
            trained.bare.zero_grad(set_to_none=True)
        self.seen = dict.fromkeys(range(len(self.loop.steppers)), self.backwards)
        self.settled = self.backwards
        return True

    def _stray_params(self) -> list[torch.Tensor]:
        if self._stray is None:
            loop = self.loop
            held = {id(p) for s in loop.steppers for g in s.optimizer.param_groups for p in g["params"]}
            trainable = [p for t in loop.trained for p in t.bare.parameters() if p.requires_grad]
            several = len(loop.steppers) > 1
            self._stray = [p for p in trainable if several or id(p) not in held]
        return self._stray

    def _find(self, optimizer: Any) -> tuple[int, Stepper]:
        steppers = self.loop.steppers
        if optimizer is None:
            if len(steppers) != 1:
                raise UserError(f"run.step() in a run of {len(steppers)} optimizers: name the one to step, "
                                f"run.step(optimizer)")  # fmt: skip
            return 0, steppers[0]
        for index, stepper in enumerate(steppers):
            if stepper.optimizer is optimizer:
                return index, stepper
        raise UserError("run.step(optimizer) got an optimizer that run.setup did not return; step one it returned "
                        "(give every optimizer to run.setup(model, optimizer, ...))")  # fmt: skip

    def _bind(self, index: int, stepper: Stepper, scheduler: Any) -> None:
        """The LR scheduler stepped after each step of `stepper`; in a resumed run, at its saved state."""
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise UserError(
                "run.step(optimizer, scheduler) steps the scheduler after every optimizer step; ReduceLROnPlateau "
                "steps on a metric: call scheduler.step(value) yourself after evaluating, and keep it in run.state "
                "(run.state['plateau'] = scheduler) so checkpoints hold it"
            )
        if stepper.scheduler is not None:
            raise UserError("run.step got another scheduler than before for this optimizer; pass the same one")
        if getattr(scheduler, "optimizer", stepper.optimizer) is not stepper.optimizer:
            raise UserError("the scheduler steps another optimizer than the one given to run.step; build it from that")
        stepper.scheduler = scheduler
        saved, stepper.saved = stepper.saved, None
        if saved is not None:  # continue the schedule where it was, with the learning rates it had set
            scheduler.load_state_dict(saved)
            for group, lr in zip(stepper.optimizer.param_groups, scheduler.get_last_lr(), strict=False):
                group["lr"] = lr
