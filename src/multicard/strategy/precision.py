"""Numeric precision: autocast dtype, parameter dtype and the fp16 gradient scaler."""

from __future__ import annotations

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


class AutocastForward(nn.Module):
    """Runs the wrapped model's forward under autocast.

    Wrapping here (inside DataParallel) puts autocast in every replica's thread with our dtype;
    DataParallel alone would re-enter autocast with the device's default dtype.
    """

    def __init__(self, model: nn.Module, precision: Precision) -> None:
        super().__init__()
        self.model = model
        self.precision = precision

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision.autocast():
            return self.model(*args, **kwargs)
