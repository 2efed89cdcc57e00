"""An exponential moving average of the weights, kept beside the model on every rank: a component
of `multicard train`'s classifier recipe, registered with its Run as a part of the checkpoints
(run.register: written as the model is, sharded under fsdp).

The average covers parameters and floating-point buffers (BatchNorm's running statistics: an
averaged network needs statistics that belong to it) and is updated with torch's own EMA step
(torch.optim.swa_utils.get_ema_multi_avg_fn) every `every` optimizer steps. It holds exactly the
tensors this rank holds: full ones under single, dp and ddp, the rank's shards under fsdp (their
DTensor's local part), so it costs one copy of what the rank already keeps, and an element's
average does not depend on the world size. Evaluating it swaps its values into the model and
back, which needs no second module under any strategy.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(t: Any) -> TypeGuard[DTensor]:
    """A DTensor (fsdp's sharded tensors). Without torch.distributed.tensor loaded there is none:
    the module is not imported for the question (it costs every process ~0.4 s to start)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for `t` (its shard under fsdp)."""
    return t.to_local() if is_dtensor(t) else t


def averaged_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and floating-point buffers by state-dict name."""
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {name: t for name, t in named.items() if torch.is_floating_point(t)}


class WeightAverage:
    """EMA of `model`'s weights (the bare module, as the strategy placed it), updated every `every`
    steps; up to `start` steps (and at the first update after it) an update copies the model instead,
    as torch's AveragedModel does at its first update and torchvision's recipes do during the warm-up.
    Which updates copy follows from the step alone, so a resumed run needs no counter of its own."""

    def __init__(self, model: nn.Module, decay: float, every: int, start: int = 0) -> None:
        self.model = model
        self.every = every
        self.start = start
        self.update_fn = get_ema_multi_avg_fn(decay)
        with torch.no_grad():
            self.tensors = {name: local(t).detach().clone() for name, t in averaged_tensors(model).items()}

    def update(self, step: int) -> None:
        """After optimizer step `step` (1-based)."""
        if step % self.every:
            return
        current = averaged_tensors(self.model)
        names = list(self.tensors)
        ours, theirs = [self.tensors[n] for n in names], [local(current[n]).detach() for n in names]
        if step - self.every <= self.start:
            with torch.no_grad():
                for average, weight in zip(ours, theirs, strict=True):
                    average.copy_(weight)
        else:
            self.update_fn(ours, theirs, step)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the average inside the block, its own weights again after it."""
        current = averaged_tensors(self.model)
        with torch.no_grad():
            kept = {n: local(current[n]).clone() for n in self.tensors}
            for n, t in self.tensors.items():
                local(current[n]).copy_(t)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, t in kept.items():
                    local(current[n]).copy_(t)

    def state_dict(self, whole: bool = False) -> dict[str, torch.Tensor]:
        """By the model's state-dict names, laid out as the model's tensors are: DTensors of this
        rank's shards under fsdp (whole tensors with `whole`: a collective), else whole tensors."""
        current = averaged_tensors(self.model)
        out: dict[str, torch.Tensor] = {}
        for n, t in self.tensors.items():
            ref = current[n]
            if is_dtensor(ref):  # the shape given: the last rank's shard may be the short one
                from torch.distributed.tensor import DTensor

                t = DTensor.from_local(t, ref.device_mesh, ref.placements, shape=ref.shape, stride=ref.stride())
                t = t.full_tensor() if whole else t
            out[n] = t
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """From `state_dict`'s layout, or whole tensors (a checkpoint file) cut to this rank's shards."""
        current = averaged_tensors(self.model)
        with torch.no_grad():
            for n, t in self.tensors.items():
                value, ref = state[n], current[n]
                if is_dtensor(ref) and not is_dtensor(value):
                    from torch.distributed.tensor import distribute_tensor

                    value = distribute_tensor(value.to(t.device), ref.device_mesh, ref.placements)
                t.copy_(local(value))
