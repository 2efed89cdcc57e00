"""`run.state`: a user's own values that a checkpoint keeps (a best score, a counter, an EMA).

Values are what torch's weights-only loader reads back — tensors, numbers, strings, booleans,
None, and lists, tuples and dicts of them — or objects with `state_dict()` / `load_state_dict()`
(an EMA module, torch.optim.swa_utils.AveragedModel, a metric object), which keep their identity
across a resume: their state is loaded into them. Other values are refused when set, in one line.
Rank 0's values are saved: keep them the same on every rank (derive them from reduced values).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch

from multicard.base.errors import UserError

PLAIN = (torch.Tensor, int, float, str, bool, type(None))


def _checked(key: str, value: Any) -> Any:
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return value
    if not _plain(value):
        raise UserError(
            f"run.state[{key!r}] = {type(value).__name__}: a checkpoint holds tensors, numbers, strings, booleans, "
            f"None and lists, tuples and dicts of them, or objects with state_dict()/load_state_dict(); "
            f"store it as one of those"
        )
    return value


def _plain(value: Any) -> bool:
    if isinstance(value, PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    return False


def _detached(value: Any) -> Any:
    """A copy for a checkpoint: tensors detached on the CPU, containers rebuilt."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


class UserState(MutableMapping):
    """A dict of the user's resumable values; a checkpoint part of the run's loop."""

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            raise UserError(f"run.state keys are strings; got {key!r}")
        self._values[key] = _checked(key, value)

    def __delitem__(self, key: str) -> None:
        del self._values[key]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"run.state({self._values!r})"

    def state_dict(self, whole: bool = False) -> dict[str, Any]:
        out = {}
        for key, value in self._values.items():
            is_object = not _plain(value)
            out[key] = {"object": is_object, "value": _detached(value.state_dict() if is_object else value)}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Values saved replace those set now; an object set now takes its saved state."""
        for key, saved in state.items():
            current = self._values.get(key)
            if saved["object"] and current is not None and not _plain(current):
                current.load_state_dict(saved["value"])
            elif not saved["object"]:
                value = saved["value"]
                if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
                    value = value.to(current.device)  # where the user keeps it (checkpoints load on the CPU)
                self._values[key] = value


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
