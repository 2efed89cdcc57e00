"""Writing a run's checkpoints to object storage, behind the formats' interface (path_for, write,
point, pinned, steps, remove), so that the Checkpointer saves, points and prunes as on disk.

Single file: rank 0 serialises the state at once (a snapshot: training then changes the tensors) and
a thread uploads it, then its commit object, while training goes on. Sharded: every rank writes its
shard through torch.distributed.checkpoint's fsspec storage (a URL as checkpoint_id), rank 0 the train
state; after a barrier, rank 0 writes the COMPLETE marker and the commit object. The next save, a stop
and the end of the run wait for the write in progress (at most checkpoint.stop_timeout_s).
"""

from __future__ import annotations

import io
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from multicard.base.errors import UserError
from multicard.base.storage import storage_error
from multicard.checkpoint.remote import PREFIX, RemoteFolder
from multicard.checkpoint.sharded import COMPLETE, TENSORS, TRAIN_STATE, dcp_api, save_tensors
from multicard.engine.loop import Loop
from multicard.runtime.process_group import ProcessContext

PROBE_BYTES = 2**20  # the test write that measures the link to the storage at start-up
# DCP's writer says on every file that an object store's stream cannot be fsync'ed: there, the commit
# object written last is what makes a checkpoint durable. Background writes warn on their own thread, so
# the filter is the process's.
warnings.filterwarnings("ignore", "fsync not supported for this stream", UserWarning)


def serialised(state: dict[str, Any]) -> bytes:
    """torch.save's bytes of `state` (as a step file holds them), made in memory."""
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


class RemoteWriter:
    """The checkpoints of a run in `fmt`'s layout (SingleFile or Sharded) in a folder on object storage."""

    pointers = ()  # `last` is the newest commit; `best` an object of the folder's own (point)

    def __init__(self, fmt: Any, url: str, wait_s: float) -> None:
        self.fmt, self.store, self.wait_s = fmt, RemoteFolder(url), wait_s
        self.name, self.whole_state, self.needs_template = fmt.name, fmt.whole_state, fmt.needs_template

    def path_for(self, folder: Any, step: int) -> str:
        return self.store.join(f"{PREFIX}{step:09d}{'.pt' if self.fmt.name == 'file' else ''}")

    def write(self, url: str, state: dict[str, Any], ctx: ProcessContext, background: Any = None) -> Callable[[], None]:
        if self.fmt.name == "file":
            return self._write_file(url, state, ctx)
        return self._write_sharded(url, state, ctx, background)

    def _write_file(self, url: str, state: dict[str, Any], ctx: ProcessContext) -> Callable[[], None]:
        if not ctx.is_main:
            return lambda: None
        data, name = serialised(state), url.rsplit("/", 1)[-1]

        def upload() -> None:
            self.store.upload(name, data)
            self.store.commit(url)

        return Upload(upload, url, self.wait_s).wait

    def _write_sharded(
        self, url: str, state: dict[str, Any], ctx: ProcessContext, background: Any
    ) -> Callable[[], None]:
        name = url.rsplit("/", 1)[-1]
        if ctx.is_main:
            self.store.upload(f"{name}/{TRAIN_STATE}", serialised({k: v for k, v in state.items() if k not in TENSORS}))
        with _said(url):
            pending = save_tensors(state, url, background)

        def complete() -> None:
            if pending is not None:
                with _said(url):
                    pending.result()
            ctx.barrier()  # every rank's shard is written
            if ctx.is_main:
                self.store.upload(f"{name}/{COMPLETE}", f"step {state['step']}, {ctx.world_size} shard(s)\n".encode())
                self.store.commit(url)

        return complete

    def point(self, folder: Any, name: str, url: str) -> None:
        if name == "best":
            self.store.point_best(url)
            self._best = url

    def pinned(self, folder: Any) -> set[str]:
        """The checkpoint `best` names: pruning keeps it (asked of the storage once, then remembered)."""
        if not hasattr(self, "_best"):
            self._best = self.store.best()
        return {self._best} if self._best else set()

    def steps(self, folder: Any) -> list[tuple[int, str]]:
        return self.store.committed()

    def remove(self, url: str) -> None:
        self.store.remove(url)


class _said:
    """DCP's failure to write to storage (on every rank: DCP tells each of any rank's failure) in one line."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, trace: Any) -> bool:
        if exc is None or isinstance(exc, UserError) or not isinstance(exc, (dcp_api().CheckpointException, OSError)):
            return False
        error = storage_error(self.url, exc, 1, 0.0, "write")
        error.every_rank = True  # then rank 0 alone says it (exits.report_error)
        raise error from None


def state_bytes(loop: Loop) -> int:
    """About the bytes of one checkpoint: the model's tensors and the optimizer's (before the first step
    has made them, two per parameter, as Adam keeps)."""
    model = sum(t.numel() * t.element_size() for t in loop.bare.state_dict().values() if isinstance(t, torch.Tensor))
    per_param = loop.optimizer.state.values()
    slots = [t for state in per_param for t in state.values() if isinstance(t, torch.Tensor)]
    optimizer = sum(t.numel() * t.element_size() for t in slots)
    return model + (optimizer if slots else 2 * model)


def estimate_line(loop: Loop, store: RemoteFolder, stop_timeout_s: float) -> str:
    """The start-up line that says how long a save to `store` takes: the state's bytes at the rate a
    test write of PROBE_BYTES measured (request latency included), to compare with a grace period."""
    size = state_bytes(loop)
    began = time.monotonic()
    store.upload(".multicard-write-test", bytes(PROBE_BYTES))
    took = max(time.monotonic() - began, 1e-6)
    store.delete(".multicard-write-test")
    rate = PROBE_BYTES / took
    return (
        f"checkpoints: {store.url}, about {size / 2**20:.1f} MiB each; a {PROBE_BYTES // 2**20} MiB test write took "
        f"{took:.2f} s ({rate / 2**20:.1f} MiB/s): a save (a stop's too) takes about {max(size / rate, took):.1f} s; "
        f"compare with the grace period your platform gives before preemption (checkpoint.stop_timeout_s="
        f"{stop_timeout_s:g})"
    )
