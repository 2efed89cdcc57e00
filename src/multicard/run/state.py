"""`run.state`: a user's own values that a checkpoint keeps (a best score, a counter, an EMA).

Values are what torch's weights-only loader reads back — tensors, numbers, strings, bytes,
booleans, None, torch's dtypes, devices and sizes, and lists, tuples and dicts of them — or
objects with `state_dict()` / `load_state_dict()` (an EMA module, an LR scheduler stepped per
epoch, torch.optim.swa_utils.AveragedModel, a metric object), whose state must be such values.
Each value is checked once, when it is set: anything else (a numpy number or array, a
namedtuple, a function inside a state dict, another object) is refused there, in one line — a
checkpoint that the next run could not read would otherwise make it start afresh.

A resumed run gives each key its saved value: a value set before the loop is replaced by it; an
object takes its saved state, whenever it is set (before the loop, or later: an object created
inside the loop gets the state its predecessor was saved with). In an epoch resumed in the
middle, the code between the epoch's start and its first batch runs again though the
uninterrupted run had run it before the checkpoint: what it sets takes the saved value too.
Rank 0's values are saved: keep them the same on every rank (derive them from reduced values).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

from multicard.base.errors import UserError

LEAVES = (bool, int, float, complex, str, bytes, type(None), torch.Size, torch.dtype, torch.device)
HELD = (
    "a checkpoint holds tensors, numbers, strings, booleans, None and lists, tuples and dicts of them, or objects "
    "with state_dict()/load_state_dict() whose state is such values"
)


def unreadable(value: Any, where: str = "") -> str | None:
    """Where in `value` something sits that torch's weights-only loader cannot read back, and what
    it is; None if nothing does."""
    kind = type(value)
    if kind in LEAVES or kind in (torch.Tensor, torch.nn.Parameter):
        return None
    if kind in (list, tuple):
        return next((bad for i, v in enumerate(value) if (bad := unreadable(v, f"{where}[{i}]"))), None)
    if kind in (dict, OrderedDict):
        for k, v in value.items():
            bad = unreadable(k, f"{where} (a key)") or unreadable(v, f"{where}[{k!r}]")
            if bad:
                return bad
        return None
    name = "a namedtuple" if isinstance(value, tuple) else f"{kind.__module__}.{kind.__qualname__}"
    return f"{name} at {where or 'the top'}"


def _advice(value: Any) -> str:
    if type(value).__module__ == "numpy":
        return "convert numpy values (float(v), v.tolist() or torch.from_numpy(v))"
    if isinstance(value, tuple):
        return "store a namedtuple as a tuple or a dict (value._asdict())"
    return "store it as one of those"


def _checked(key: str, value: Any) -> Any:
    if is_object(value):
        bad = unreadable(value.state_dict())
        if bad:
            raise UserError(f"run.state[{key!r}] = {type(value).__name__}: its state_dict() holds {bad}; {HELD}")
        return value
    bad = unreadable(value)
    if bad:
        inside = "" if bad.endswith(" at the top") else f" it holds {bad};"
        raise UserError(f"run.state[{key!r}] = {type(value).__name__}:{inside} {HELD}; {_advice(value)}")
    return value


def is_object(value: Any) -> bool:
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict")


def _detached(value: Any) -> Any:
    """A copy for a checkpoint: tensors detached on the CPU, containers rebuilt."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _detached(v)) for k, v in value.items())
    return value


def _load_into(value: Any, saved: Any) -> None:
    """An object's saved state, loaded into it. An LR scheduler made after the resume has set its
    optimizer's learning rates in its constructor: they become again the ones it had set."""
    value.load_state_dict(saved)
    if isinstance(value, torch.optim.lr_scheduler.LRScheduler):
        for group, lr in zip(value.optimizer.param_groups, value.get_last_lr(), strict=False):
            group["lr"] = lr


def _placed(saved: Any, like: Any) -> Any:
    """A saved tensor where the user keeps its counterpart (checkpoints load on the CPU)."""
    if isinstance(like, torch.Tensor) and isinstance(saved, torch.Tensor):
        return saved.to(like.device)
    return saved


class UserState(MutableMapping):
    """A dict of the user's resumable values; a checkpoint part of the run's loop."""

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}
        self._pending: dict[str, Any] = {}  # saved objects' states, until an object is set under their key
        self._saved: dict[str, dict[str, Any]] = {}  # a resumed run's entries, until its first epoch ends
        self._replay: dict[str, dict[str, Any]] | None = None  # those, while that epoch's start runs again

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            raise UserError(f"run.state keys are strings; got {key!r}")
        value = _checked(key, value)
        saved = self._replay.pop(key, None) if self._replay is not None else None
        if saved is not None and saved["object"] and is_object(value):
            _load_into(value, saved["value"])
            self._pending.pop(key, None)
        elif saved is not None and not saved["object"]:
            value = _placed(saved["value"], value)
        elif is_object(value) and key in self._pending:
            _load_into(value, self._pending.pop(key))
        self._values[key] = value

    def __delitem__(self, key: str) -> None:
        del self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"run.state({self._values!r})"

    def replaying(self, on: bool) -> bool:
        """An epoch resumed in the middle starts (on) / draws its first batch (off: for good); `on`."""
        self._replay = dict(self._saved) if on else None
        if not on:
            self._saved = {}
        return on

    def state_dict(self, whole: bool = False) -> dict[str, Any]:
        out = {}
        for key, value in self._values.items():
            kept = value.state_dict() if is_object(value) else value
            bad = unreadable(kept)  # an object's state may have changed since it was set
            if bad:
                raise UserError(f"run.state[{key!r}]: {'its state_dict() ' if is_object(value) else ''}now holds "
                                f"{bad}; {HELD} (nothing was saved)")  # fmt: skip
            out[key] = {"object": is_object(value), "value": _detached(kept)}
        return out | {key: {"object": True, "value": _detached(v)} for key, v in self._pending.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Values saved replace those set now; an object set now (or later) takes its saved state."""
        for key, saved in state.items():
            current = self._values.get(key)
            if saved["object"] and is_object(current):
                _load_into(current, saved["value"])
            elif saved["object"]:
                self._pending[key] = saved["value"]
            else:
                self._values[key] = _placed(saved["value"], current)
        self._saved = dict(state)


class Monitor:
    """Which epoch's checkpoint `best` points at: the one with the highest (best_mode="max") or
    lowest ("min") epoch value of the logged key `best` (e.g. Run(best="val_iou") with
    run.log(val_iou=...) after run.evaluate). A checkpoint part, so a resumed run keeps the best."""

    def __init__(self, key: str | None, mode: str) -> None:
        if mode not in ("max", "min"):
            raise UserError(f"best_mode={mode!r} is not one of max, min")
        if key is not None and not isinstance(key, str):
            raise UserError(f"best={key!r} names a value given to run.log, e.g. best='val_iou'")
        self.key, self.sign = key, 1.0 if mode == "max" else -1.0
        self.best: float | None = None
        self.warned = False

    def update(self, record: dict[str, Any], say: Any) -> bool:
        """Whether this epoch's record is the best so far (records are reduced: every rank agrees)."""
        if self.key is None:
            return False
        value = record.get(self.key)
        if value is None:
            if not self.warned:
                self.warned = True
                say(f"warning: best={self.key!r}, but nothing named {self.key} was logged in epoch {record['epoch']}; "
                    f"log it with run.log({self.key}=...) in each epoch (e.g. after run.evaluate)")  # fmt: skip
            return False
        if self.best is not None and self.sign * value <= self.sign * self.best:
            return False
        self.best = value
        return True

    def state_dict(self, whole: bool = False) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state.get("best")


# Checkpoint parts a component registered with run.register may not be named after.
TAKEN = ("model", "optimizer", "scheduler", "scaler", "models", "optimizers", "schedulers", "position", "rng",
         "state", "best", "resume", "config", "step", "epoch", "classes", "val", "format", "script")  # fmt: skip


def checked_component(name: str, component: Any, components: dict[str, Any]) -> Any:
    """run.register(name, component): a free name, an object with a state dict."""
    if name in TAKEN or name.startswith("streams") or name in components:
        raise UserError(f"run.register({name!r}, ...): a checkpoint part of that name exists; choose another")
    if not all(callable(getattr(component, m, None)) for m in ("state_dict", "load_state_dict")):
        raise UserError(f"run.register({name!r}, ...) takes an object with state_dict() and load_state_dict()")
    return component
