"""`run.setup(model, optimizer)`: the user's model placed, converted and wrapped by the run's
strategy, and their optimizer made to step what the strategy holds.

The optimizer keeps its class, parameter groups and settings. Under fsdp the parameters are
replaced by sharded ones of the same names, so each group is pointed at the new ones (the same
optimizer object: a scheduler made from it keeps working); with ddp.shard_optimizer (ZeRO-1)
the strategy builds a ZeroRedundancyOptimizer of the same class and groups, returned instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from multicard.base.errors import UserError
from multicard.strategy.optim import OptimizerRecipe

if TYPE_CHECKING:
    from multicard.strategy.base import Strategy


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"run.setup(model, optimizer) got {type(optimizer).__name__} for the optimizer; "
                        f"pass a torch.optim.Optimizer built on model.parameters()")  # fmt: skip
    if optimizer.state:
        raise UserError(
            "run.setup(model, optimizer) got an optimizer that has already stepped; build it anew on "
            "model.parameters() and call run.setup before training (a resumed run restores its state)"
        )
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in names)
    if foreign:
        raise UserError(
            f"the optimizer given to run.setup holds {foreign} tensor(s) that are not parameters of the model; "
            f"build it on model.parameters() (or groups of them)"
        )


def prepare_model(
    strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """The model as the strategy runs it, and the optimizer that steps it."""
    if not isinstance(model, nn.Module):
        raise UserError(f"run.setup(model, ...) got {type(model).__name__}; pass a torch.nn.Module")
    names = {id(p): name for name, p in model.named_parameters()}
    if optimizer is not None:
        check_optimizer(model, optimizer, names)
    wrapped = strategy.prepare(model)
    if optimizer is None:
        return wrapped, None
    bare = strategy.unwrap(wrapped)
    current = dict(bare.named_parameters())
    for group in optimizer.param_groups:  # the same tensors, or (fsdp) their sharded replacements
        group["params"] = [current[names[id(p)]] for p in group["params"]]
    groups = [dict(group) for group in optimizer.param_groups]
    recipe = OptimizerRecipe(type(optimizer), groups, dict(optimizer.defaults))
    shards_state = getattr(getattr(strategy, "options", None), "shard_optimizer", False)
    return wrapped, strategy.make_optimizer(recipe, bare) if shards_state else optimizer
