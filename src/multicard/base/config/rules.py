"""The shapes of a config rule every section uses: a choice, a range, a finite number, a local path
(base/locations.py).
Each says what to change in one line (a `UserError`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from multicard.base.errors import UserError
from multicard.base.locations import check_local_path as check_local_path  # a rule every section may use


def choice(value: str, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"{name}={value} is not one of {', '.join(choices)}")


def positive(value: float, name: str, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise UserError(f"{name}={value} must be {bound}")


def finite(node: Any, name: str = "") -> None:
    """No NaN or infinity anywhere: they pass range checks (nan < 0 is False) and end runs later."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            finite(getattr(node, f.name), f"{name}.{f.name}" if name else f.name)
    elif isinstance(node, float) and not math.isfinite(node):
        raise UserError(f"{name}={node} must be a finite number")
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            finite(item, f"{name}[{i}]")


def within(value: float, name: str, lo: float, hi: float, hi_open: bool = True) -> None:
    if not (lo <= value < hi if hi_open else lo <= value <= hi):
        raise UserError(f"{name}={value} must be in [{lo:g}, {hi:g}{')' if hi_open else ']'}")


def changed_fields(section: Any) -> list[str]:
    """The fields of a section set to other than their defaults."""
    defaults = type(section)()
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(defaults, f.name)]
