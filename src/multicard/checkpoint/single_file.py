"""The single-file checkpoint format: step-NNNNNNNNN.pt, written whole by rank 0.

For strategies whose every rank holds the whole model (single, dp, ddp). On local disk `last.pt` and
`best.pt` are hard links to step files (no copies), so best.pt outlives its rotated step file; on
object storage they are small objects naming one (base/store.py).
Files are read with torch's weights-only unpickler: a crafted file cannot run code.
"""

from __future__ import annotations

import copy
import io
import pickle
import threading
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from multicard.base.errors import UserError
from multicard.base.storage import storage_error
from multicard.base.store import Store
from multicard.runtime.process_group import ProcessContext

PREFIX = "step-"
SUFFIX = ".pt"


def load_weights_only(path: Path) -> Any:
    """torch.load with the weights-only unpickler, without torch's warning about the pickle protocol
    of a file it then refuses: the refusal is said in one line by whoever called."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"Detected pickle protocol \d+ in the checkpoint", UserWarning)
        return torch.load(path, map_location="cpu", weights_only=True)


def load_file(path: Path) -> dict[str, Any]:
    """A checkpoint file's contents on the CPU, or a one-line error saying what is wrong."""
    if path.is_dir():
        raise UserError(f"checkpoint {path} is a directory, not a checkpoint file")
    if not path.is_file():
        raise UserError(f"checkpoint not found: {path}")
    try:
        state = load_weights_only(path)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unpickling error"
        raise UserError(
            f"checkpoint {path} holds objects a checkpoint never holds and was not loaded ({first[:120]}); "
            f"use a checkpoint written by multicard"
        ) from None
    except Exception as exc:
        raise UserError(
            f"checkpoint {path} cannot be read ({type(exc).__name__}); it may be truncated or not a checkpoint"
        ) from None
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise UserError(f"checkpoint {path} is not a multicard checkpoint (no model or config)")
    return state


class SingleFile:
    name = "file"
    pointers = ("last.pt", "best.pt")
    needs_template = False  # reads whole tensors; nothing to load into
    whole_state = True  # rank 0 writes whole tensors (fsdp gathers them onto rank 0 for it)

    def name_for(self, step: int) -> str:
        return f"{PREFIX}{step:09d}{SUFFIX}"

    def owns(self, path: Path) -> bool:
        return path.suffix == SUFFIX and not path.is_dir()

    def write(self, store: Store, name: str, state: dict[str, Any], ctx: ProcessContext, background: Any = None,
              wait_s: float = 0.0, node_copy: Store | None = None) -> tuple[Callable[[], None], bool]:  # fmt: skip
        """Rank 0 writes (every rank holds the same model): on local disk complete on return; on object
        storage the state is serialised at once (a snapshot: training then changes the tensors) and a thread
        uploads and commits it while training goes on. With `background` (checkpoint.async_save) the
        snapshot is a copy of the state's tensors, serialised and written by the thread. `node_copy`: every
        node's first process writes the same bytes there too, first (node_copies.py). `complete`, and
        whether it goes on in the background."""
        local = node_copy if ctx.is_local_main else None  # this node's copy, written by its first process
        if background is not None:
            staged = snapshot(state) if ctx.is_main or local is not None else None

            def work(staged: dict[str, Any]) -> None:  # serialise, this node's copy, the durable write and commit
                data = serialised(staged)
                if local is not None:
                    local.write(name, data)
                if ctx.is_main:
                    upload = store.write_later(name, lambda f: f.write(data))
                    if upload is not None:
                        upload()

            job = partial(work, staged) if staged is not None else (lambda: None)
            return Upload(job, store.join(name), wait_s).wait, True
        data = serialised(state) if local is not None else None
        if local is not None and data is not None:
            local.write(name, data)
        save = (lambda f: f.write(data)) if data is not None else (lambda f: torch.save(state, f))
        upload = store.write_later(name, save if ctx.is_main else None)
        if upload is None:  # written (every rank alike: the same store)
            return (lambda: None), False
        return Upload(upload, store.join(name), wait_s).wait, True

    def read(self, path: Path, template: dict[str, Any] | None = None) -> dict[str, Any]:
        return load_file(path)

    read_meta = read  # a file's metadata is read with its tensors


def snapshot(tree: Any) -> Any:
    """`tree` with its tensors copied to the CPU, and its other values copied: what training then changes
    leaves it as it was at the step (a background write's snapshot)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {key: snapshot(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(snapshot(value) for value in tree)
    return copy.deepcopy(tree)


def serialised(state: dict[str, Any]) -> bytes:
    """The bytes torch.save writes for `state`, taken now (the snapshot a background write writes)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


class Upload:
    """Work on a thread of its own, training going on meanwhile; `wait` joins it, raising its error."""

    def __init__(self, work: Callable[[], None], what: str, wait_s: float) -> None:
        self.what, self.wait_s = what, wait_s
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(work,), name="multicard-upload", daemon=True)
        self.thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - raised again by wait(), in the training thread
            self.error = exc

    def wait(self) -> None:
        self.thread.join(self.wait_s)
        if self.thread.is_alive():
            raise UserError(
                f"the upload of {self.what} took longer than checkpoint.stop_timeout_s={self.wait_s:g} s; raise it, "
                f"or check the link to the storage (the last committed checkpoint is intact)"
            )
        if isinstance(self.error, UserError):
            raise self.error
        if self.error is not None:
            raise storage_error(self.what, self.error, 1, 0.0, "write")
