"""The torch internals multicard uses, imported in one place.

multicard is tested on torch 2.11–2.14 (torchvision 0.26–0.29); see TESTED_TORCH and pyproject.toml.
These private modules had the same names and contents throughout that range (checked on torch 2.11.0
and 2.14.1). Where a later torch moves one, the fallback here keeps multicard importing, and this
is the one file to change. The other internals in use were also the same on both: FakeTensorMode
(plan/fake.py), the profiler's allocation events (plan/profiled_peak.py) and DataLoader's
`_shutdown_workers` (data/loading/workers.py, called only where it exists).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 (re-exported)
from torch.utils._pytree import tree_flatten  # noqa: F401 (re-exported)

TESTED_TORCH = ("2.11", "2.14")  # oldest and newest minor release the suite has passed on

# Operators that return a view of an input (they move no memory): the runtime estimator's set,
# else the same operators by name (its contents on torch 2.11 and 2.14).
VIEW_OPS: Collection[Any]
try:
    from torch.utils._runtime_estimation import _VIEW_OPS as VIEW_OPS
except ImportError:  # pragma: no cover - only on a torch that moved it
    _NAMES = (
        "_unsafe_view adjoint as_strided chunk detach diagonal expand expand_as hsplit imag lift_fresh mH mT movedim "
        "permute real select split split_with_sizes squeeze swapaxes swapdims t transpose unbind unflatten unfold "
        "unsqueeze view view_as vsplit"
    ).split()
    VIEW_OPS = {getattr(torch.ops.aten, name) for name in _NAMES if hasattr(torch.ops.aten, name)}
