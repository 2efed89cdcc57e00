"""`run.load_weights(model, "best")`: a checkpoint's weights of the run's model, back into it.

After training (or in another script with the same Run arguments), the weights of the epoch that
`best` points at, of the last checkpoint, or of any checkpoint path, load into the model as run.setup
returned it, whatever the strategy and world size the checkpoint was written with (whole tensors,
sharded again on the way in under fsdp). Every rank calls it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch.nn as nn

from multicard.base.errors import UserError
from multicard.checkpoint import read_checkpoint

if TYPE_CHECKING:
    from multicard.engine.loop import Loop
    from multicard.strategy.base import Strategy


def checkpoint_path(folder: Path | str, which: str) -> Path | str:
    """`which` ("best", "last", or a path) as a checkpoint: in a folder of files, `best.pt`; of
    step directories (sharded), `best`; on object storage, the URL `folder/best`."""
    if which not in ("best", "last"):
        return which
    if isinstance(folder, str):
        return f"{folder}/{which}"
    return folder / which if (folder / which).is_dir() else folder / f"{which}.pt"


def load_weights(loop: Loop, strategy: Strategy, model: nn.Module, path: Path | str) -> None:
    if loop.model is None or model not in (loop.model, loop.bare):
        raise UserError(
            "run.load_weights(model, ...) loads the run's model (the first set up with an optimizer, as "
            "run.setup returned it); checkpoints keep the others beside it (read_checkpoint)"
        )
    strategy.load_whole_model_state(loop.bare, read_checkpoint(path)["model"])
