"""This process's random streams: seeded from the run's seed, and saved and restored as tensors.

Saved as tensors and plain Python values only, so checkpoints load with torch's safe
(weights-only) unpickler; every rank's streams are saved, and a run resumed at another world
size seeds them all from rank 0's.
"""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch


def seed_process(seed: int) -> None:
    """Python's, numpy's and torch's global streams from `seed`."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    # legacy=True (the default): the MT19937 tuple, not the dict of other bit generators
    _, keys, pos, has_gauss, gauss = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss, "gauss": gauss},
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(state["python"])


def own_streams(streams: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's random streams among every rank's saved: at the same world size each rank continues
    its own; otherwise rank 0's seed them all."""
    return streams[rank] if len(streams) == world_size else streams[0]
