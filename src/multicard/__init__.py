"""multicard: train PyTorch models on one device, DataParallel, DDP or FSDP — from one config
(`multicard train`), or in your own loop through `multicard.Run`.

    import multicard
    run = multicard.Run(out_dir="runs/mine", global_batch_size=256)
    model, optimizer = run.setup(model, optimizer)
    ...

`import multicard` stays light (the command line imports it first): `Run` and the rest of the
public API are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from multicard.base.errors import Stopped  # what a graceful stop raises (not a KeyboardInterrupt)
from multicard.base.version import __version__

if TYPE_CHECKING:
    from multicard.run import Run, Scores

__all__ = ["Run", "Scores", "Stopped", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Run", "Scores"):
        import multicard.run

        return getattr(multicard.run, name)
    raise AttributeError(f"module 'multicard' has no attribute {name!r}")
