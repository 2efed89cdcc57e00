"""Numeric precision: autocast dtype, parameter dtype and the fp16 gradient scaler; and the
attribute pass-through every wrapper of a user's module has (`PassThrough`)."""

from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Precision:
    name: str  # fp32 | bf16 | fp16 | fp64
    device_type: str

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.float64 if self.name == "fp64" else torch.float32

    def autocast(self) -> Any:
        dtype = self.autocast_dtype
        return torch.autocast(self.device_type, dtype=dtype) if dtype else nullcontext()

    def grad_scaler(self) -> torch.amp.GradScaler:
        # Only fp16 has too little range for small gradients; a disabled scaler is a pass-through.
        return torch.amp.GradScaler(self.device_type, enabled=self.name == "fp16")


class PassThrough:
    """For a module wrapper (autocast, DataParallel, DDP): an attribute it does not have is the
    wrapped module's, so a user's own methods and attributes (`model.generate(...)`,
    `model.config`) work on what multicard returns as on the module they built. `INNER`: the
    name of the wrapped module among the wrapper's submodules."""

    INNER = "module"

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)  # type: ignore[arg-type]  # mixed into nn.Module wrappers only
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get(self.INNER)
            if inner is None or name.startswith("__"):
                raise
            return self._inner_attribute(inner, name)

    def _inner_attribute(self, inner: nn.Module, name: str) -> Any:
        return getattr(inner, name)


class AutocastForward(PassThrough, nn.Module):
    """Runs the wrapped model's forward under autocast; the model's own methods too, when they
    are called on this wrapper (`model.generate(...)` computes as the forward does).

    Wrapping here (inside DataParallel) puts autocast in every replica's thread with our dtype;
    DataParallel alone would re-enter autocast with the device's default dtype.
    """

    INNER = "model"

    def __init__(self, model: nn.Module, precision: Precision) -> None:
        super().__init__()
        self.model = model
        self.precision = precision

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision.autocast():
            return self.model(*args, **kwargs)

    def _inner_attribute(self, inner: nn.Module, name: str) -> Any:
        value = getattr(inner, name)
        if not callable(value) or isinstance(value, (nn.Module, type)):
            return value

        @functools.wraps(value)
        def under_autocast(*args: Any, **kwargs: Any) -> Any:
            with self.precision.autocast():
                return value(*args, **kwargs)

        return under_autocast
