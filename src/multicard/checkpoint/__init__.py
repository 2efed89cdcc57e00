"""Checkpoints: complete, unwrapped, written atomically, readable by any strategy and world size.

`Checkpointer` owns a run's checkpoint folder, on local disk or object storage through one storage
interface (base/store.py, checkpoint/folder.py); formats (one file, or one shard per rank) plug in
beside each other behind the same small interface (see single_file.py).
"""

from multicard.checkpoint.checkpointer import Checkpointer, check_resume_settings, edit_resume_state, read_checkpoint
from multicard.checkpoint.compat import FORMAT_VERSION, RunFacts, check_classes, check_model_fits
from multicard.checkpoint.folder import checkpoint_store, checkpoints_in, format_of
from multicard.checkpoint.single_file import load_file, snapshot
from multicard.checkpoint.weights import load_weights

__all__ = [
    "FORMAT_VERSION",
    "Checkpointer",
    "check_resume_settings",
    "RunFacts",
    "check_classes",
    "check_model_fits",
    "checkpoint_store",
    "checkpoints_in",
    "edit_resume_state",
    "format_of",
    "load_file",
    "load_weights",
    "read_checkpoint",
    "snapshot",
]
