"""Checkpoints: complete, unwrapped, written atomically, readable by any strategy and world size.

`Checkpointer` owns a run's checkpoint folder; formats (one file, or one shard per rank) plug
in beside each other behind the same small interface (see single_file.py).
"""

from multicard.checkpoint.checkpointer import (
    Checkpointer,
    check_resume_settings,
    checkpoints_in,
    edit_resume_state,
    format_of,
    read_checkpoint,
)
from multicard.checkpoint.compat import FORMAT_VERSION, RunFacts, check_model_fits
from multicard.checkpoint.single_file import load_file

__all__ = [
    "FORMAT_VERSION",
    "Checkpointer",
    "check_resume_settings",
    "RunFacts",
    "check_model_fits",
    "checkpoints_in",
    "edit_resume_state",
    "format_of",
    "load_file",
    "read_checkpoint",
]
