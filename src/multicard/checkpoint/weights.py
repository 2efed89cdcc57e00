"""Initial weights for fine-tuning: `model.weights=PATH`, a multicard checkpoint or a plain
state dict (torch.save of `model.state_dict()`, or a dict holding one under "state_dict").

Tensors load by name where the shapes agree; `module.` prefixes (DataParallel/DDP) are dropped.
Those that do not fit (a new classifier head, say) keep their fresh initialisation and are
named in the returned note, so nothing is skipped silently.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from multicard.base.errors import UserError
from multicard.checkpoint.folder import format_of, locate
from multicard.checkpoint.single_file import load_weights_only


def _state_dict_in(path: Path) -> dict[str, Any]:
    if path.is_dir() or path.suffix == ".pt":
        try:
            return format_of(path).read(path)["model"]
        except UserError:
            if path.is_dir():
                raise
    try:
        loaded = load_weights_only(path)
    except FileNotFoundError:
        raise UserError(f"model.weights={path} does not exist") from None
    except pickle.UnpicklingError:
        raise UserError(f"model.weights={path} holds objects other than weights and was not loaded") from None
    except Exception as exc:
        raise UserError(f"model.weights={path} cannot be read ({type(exc).__name__}); give a state dict file") from None
    for key in ("model", "state_dict"):
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            loaded = loaded[key]
    if not isinstance(loaded, dict) or not any(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise UserError(f"model.weights={path} holds no state dict (name → tensor)")
    return loaded


def load_weights(model: nn.Module, path: str) -> str:
    """Load what fits of `path` into `model`; a one-line note of what was loaded and what not."""
    # A checkpoint at the path or URL (step-N, last, best: committed), or a plain state dict file or object
    # (what export wrote, uploaded).
    store, name = locate(path, "model.weights", f"model.weights={path} does not exist")
    with store.local_copy(name) as local:
        state = {k.removeprefix("module."): v for k, v in _state_dict_in(local).items()}
    own = model.state_dict()
    fits = {k: v for k, v in state.items() if k in own and tuple(v.shape) == tuple(own[k].shape)}
    if not fits:
        raise UserError(
            f"model.weights={path} has no tensor of this model's names and shapes; check model.name and model.kwargs"
        )
    model.load_state_dict(fits, strict=False)
    kept = [k for k in own if k not in fits]
    note = f"model.weights: loaded {len(fits)} of {len(own)} tensors from {path}"
    if kept:
        note += f"; {len(kept)} keep their initialisation ({', '.join(kept[:3])}{', …' if len(kept) > 3 else ''})"
    return note
