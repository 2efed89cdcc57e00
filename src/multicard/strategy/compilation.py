"""How the model's kernels are chosen: torch.compile and cuDNN autotuning.

Both change speed, not results beyond rounding. They are switched here and nowhere else.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn


def set_cudnn_benchmark(enabled: bool) -> None:
    """Process-wide: cuDNN times its convolution algorithms for each new input shape and keeps
    the fastest. That pays when shapes repeat (fixed image size and batch); the choice may
    differ between runs, so results are no longer bitwise reproducible. No effect on the CPU."""
    torch.backends.cudnn.benchmark = enabled


def compile_in_place(model: nn.Module, mode: str, dynamic: bool | None = None) -> nn.Module:
    """torch.compile the model's forward (and so its backward) in place; returns the model.

    In place (`Module.compile`) rather than `torch.compile(model)`: the module stays itself, so
    its state_dict has no `_orig_mod.` prefix, and the optimizer, checkpoints and evaluation
    see the same object. Compilation happens at the first forward of each new graph (training
    and eval mode, new input shapes). `dynamic=False` compiles for static shapes only.
    """
    model.compile(mode=mode, dynamic=dynamic)
    return model


def compiled_original(model: nn.Module) -> nn.Module | None:
    """The module inside a `torch.compile(module)` wrapper (a user's model factory may return
    one), else None."""
    # Without torch._dynamo loaded no such wrapper exists; importing it would cost ~1 s.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        return model._orig_mod
    return None
