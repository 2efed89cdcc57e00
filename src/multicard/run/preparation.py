"""`run.setup(model, *optimizers)`: the user's model placed, converted and wrapped by the run's
strategy, and their optimizers made to step what the strategy holds.

Each optimizer keeps its class, parameter groups and settings. Where the strategy replaces the
parameters (fsdp shards them; sync_bn replaces BatchNorm layers), each group is pointed at the
new ones of the same names (the same optimizer object: a scheduler made from it keeps working);
with ddp.shard_optimizer (ZeRO-1) the strategy builds a ZeroRedundancyOptimizer of the same class
and groups, returned instead. An optimizer may also be given as a function of the prepared module
that builds it (`make(module) -> optimizer`): for one whose choices depend on where and how the
strategy placed the parameters (a fused kernel exists for fsdp's sharded tensors with AdamW only).

An optimizer that was not given to run.setup would step tensors the strategy replaced (and train
nothing), or steps outside the run (its state in no checkpoint): `OptimizerGuard` refuses its
first step over a parameter of a model the run set up, in one line.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from multicard.base.errors import UserError
from multicard.strategy.optim import OptimizerRecipe

if TYPE_CHECKING:
    from multicard.strategy.base import Strategy


def check_optimizer(optimizer: Any, names: dict[int, str]) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"run.setup(model, optimizer) got {type(optimizer).__name__} for an optimizer; "
                        f"pass torch.optim.Optimizer objects built on model.parameters()")  # fmt: skip
    if optimizer.state:
        raise UserError(
            "run.setup(model, optimizer) got an optimizer that has already stepped; build it anew on "
            "model.parameters() and call run.setup before training (a resumed run restores its state)"
        )
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in names)
    if foreign:
        raise UserError(
            f"an optimizer given to run.setup holds {foreign} tensor(s) that are not parameters of its model; "
            f"build it on model.parameters() (or groups of them), one optimizer per model (run.setup each model)"
        )


def prepare_model(
    strategy: Strategy, model: nn.Module, optimizers: tuple[Any, ...], guard: OptimizerGuard
) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    """The model as the strategy runs it, and the optimizers that step it."""
    if not isinstance(model, nn.Module):
        raise UserError(f"run.setup(model, ...) got {type(model).__name__}; pass a torch.nn.Module")
    names = {id(p): name for name, p in model.named_parameters()}
    for optimizer in optimizers:
        if not callable(optimizer):
            check_optimizer(optimizer, names)
    shards_state = getattr(getattr(strategy, "options", None), "shard_optimizer", False)
    if shards_state and (len(optimizers) > 1 or guard.models):
        raise UserError("ddp.shard_optimizer (ZeRO-1) shards the optimizer of one model; with several models or "
                        "optimizers drop it, or use strategy='fsdp' (it shards every one)")  # fmt: skip
    before: list[torch.Tensor] = list(model.parameters())
    wrapped = strategy.prepare(model)
    bare = strategy.unwrap(wrapped)
    current = dict(bare.named_parameters())
    made = [make(bare) if callable(make) else make for make in optimizers]
    for optimizer, make in zip(made, optimizers, strict=True):
        if callable(make):
            check_optimizer(optimizer, {id(p): name for name, p in current.items()})
    guard.watch(bare, before, tuple(made))
    stepping = []
    for optimizer, given in zip(made, optimizers, strict=True):  # the same tensors, or their replacements
        for group in optimizer.param_groups if not callable(given) else ():
            group["params"] = [current[names[id(p)]] for p in group["params"]]
        if shards_state:
            groups = [dict(group) for group in optimizer.param_groups]
            recipe = OptimizerRecipe(type(optimizer), groups, dict(optimizer.defaults))
            optimizer = strategy.make_optimizer(recipe, bare)
        stepping.append(optimizer)
    guard.allow(stepping)
    return wrapped, stepping


def setup_model(training: Any, strategy: Strategy, model: nn.Module, optimizers: tuple[Any, ...]) -> Any:
    """run.setup(model, *optimizers): what it returns (see there), the model and its optimizers added
    to the run's loop."""
    if training.begun:
        raise UserError("run.setup(...) after run.epochs(...) started; set up every model before the loop")
    if any(t.bare is model or t.wrapped is model for t in training.loop.trained):
        raise UserError("run.setup was called twice with the same model; set each model up once")
    given = [o for o in optimizers if o is not None]
    wrapped, stepping = prepare_model(strategy, model, tuple(given), training.guard)
    training.loop.add(wrapped, stepping)
    returned = iter(stepping)
    out = [next(returned) if o is not None else None for o in optimizers]
    return (wrapped, *out) if optimizers else wrapped


class OptimizerGuard:
    """Refuses, at its first step, an optimizer run.setup was not given that holds a parameter of a
    model the run set up, or one the strategy replaced: it would train nothing (fsdp, sync_bn) or
    outside the run (its state in no checkpoint). One pre-step hook on every torch optimizer of the
    process, while the run lasts; each optimizer is looked at once (again if its groups grow)."""

    def __init__(self) -> None:
        self.models = 0
        # id → tensor, held weakly: the models' parameters and those the strategy replaced
        self._params: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._allowed: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._seen: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        self._handle: Any = None
        self.stepping = False  # inside(): the run's own steps

    def watch(self, bare: nn.Module, before: list[torch.Tensor], given: tuple[Any, ...]) -> None:
        self.models += 1
        for p in [*bare.parameters(), *before]:
            self._params[id(p)] = p
        if self._handle is None:
            self._handle = register_optimizer_step_pre_hook(self._check)

    def allow(self, optimizers: list[torch.optim.Optimizer]) -> None:
        for optimizer in optimizers:
            self._allowed.add(optimizer)

    @contextmanager
    def inside(self) -> Iterator[None]:
        """Steps the run takes itself: run.step's (ZeRO-1's inner optimizer too), and a checkpoint's save
        or load (torch's state init steps an optimizer once: ZeRO-1's template of the whole state)."""
        was, self.stepping = self.stepping, True
        try:
            yield
        finally:
            self.stepping = was  # inside() may nest: the checkpointer's hooks run inside run.step's

    def _check(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.stepping or optimizer in self._allowed:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self._seen.get(optimizer) == len(params):
            return
        self._seen[optimizer] = len(params)
        if any(self._params.get(id(p)) is p for p in params):
            raise UserError(
                f"an optimizer ({type(optimizer).__name__}) over parameters of a model given to run.setup steps "
                f"outside the run: the strategy may have replaced those parameters (fsdp, sync_bn: it would train "
                f"nothing) and no checkpoint holds its state; give it to run.setup(model, optimizer, ...) and step "
                f"it with run.step(optimizer)"
            )

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class OwnSteps:
    """A callback (the checkpointer) whose calls are the run's own steps to the guard (OptimizerGuard.inside)."""

    def __init__(self, callback: Any, guard: OptimizerGuard) -> None:
        self.callback, self.guard = callback, guard

    def __getattr__(self, hook: str) -> Any:
        method = getattr(self.callback, hook)

        def call(*args: Any) -> Any:
            with self.guard.inside():
                return method(*args)

        return call
