"""The sharded checkpoint format: step-NNNNNNNNN/, every rank writing its own shard in parallel
through torch.distributed.checkpoint (DCP).

A step directory is written under a hidden temporary name; once every rank has written, rank 0
adds train_state.pt (position, random streams, schedule, config) and a COMPLETE marker, then
renames it into place: a step directory without the marker is never read. `last` and `best` are
symbolic links to step directories. Reading reshards: the saved shards are loaded into whatever
layout the reading run has (fsdp at any world size, ddp, one process with no process group).
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from multicard.base.atomic import save_atomic, symlink_atomic, write_text_atomic
from multicard.base.errors import UserError
from multicard.runtime.process_group import ProcessContext

PREFIX = "step-"
COMPLETE = "COMPLETE"  # written last, by rank 0, after every shard and train_state.pt
TRAIN_STATE = "train_state.pt"
INCOMPLETE = ".incomplete"  # suffix of a step directory being written
TENSORS = ("model", "optimizer", "ema")  # what DCP shards (ema: where the run keeps one); the rest: train_state.pt


def _digits(path: Path) -> str:
    return path.name[len(PREFIX) :]


def incomplete_dirs(folder: Path) -> list[Path]:
    """Step directories a run began writing and never finished (it was killed)."""
    return sorted(p for p in folder.glob(f".{PREFIX}*{INCOMPLETE}") if p.is_dir())


def unmarked_dirs(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of step directories without the COMPLETE marker (cut short, or copied in part)."""
    return [
        (int(_digits(p)), p)
        for p in folder.glob(f"{PREFIX}*")
        if _digits(p).isdigit() and p.is_dir() and not p.is_symlink() and not (p / COMPLETE).exists()
    ]


def part_of_sharded(path: Path) -> Path | None:
    """The sharded checkpoint directory a file belongs to, or None."""
    return path.parent if path.is_file() and (path.parent / ".metadata").exists() else None


class Sharded:
    name = "sharded"
    pointers = ("last", "best")
    needs_template = True  # DCP loads into tensors of the reading run's layout
    whole_state = False  # each rank writes its own shard

    def path_for(self, folder: Path, step: int) -> Path:
        return folder / f"{PREFIX}{step:09d}"

    def owns(self, path: Path) -> bool:
        """A step directory: written by this format, or named like one (an unfinished one too)."""
        named = path.name.startswith((PREFIX, f".{PREFIX}"))
        return path.is_dir() and (named or any((path / m).exists() for m in (".metadata", COMPLETE, TRAIN_STATE)))

    def steps(self, folder: Path) -> list[tuple[int, Path]]:
        """(step, path) of the complete step directories in `folder`."""
        return [
            (int(_digits(p)), p)
            for p in folder.glob(f"{PREFIX}*")
            if _digits(p).isdigit() and p.is_dir() and not p.is_symlink() and (p / COMPLETE).exists()
        ]

    def write(
        self, path: Path, state: dict[str, Any], ctx: ProcessContext, background: Any = None
    ) -> Callable[[], None]:
        """Every rank writes its shard into the temporary directory; returns `complete`, which
        waits for that and (rank 0) adds the marker and renames the directory into place.

        With `background` (a process group of its own), the shards are written by a background
        thread from a CPU copy of each rank's state, and training goes on until `complete`.
        """
        tmp = path.with_name(f".{path.name}{INCOMPLETE}")
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir(parents=True)
            except OSError as exc:
                raise UserError(f"cannot write {path} ({exc.strerror}); choose a writable out_dir") from None
            try:
                save_atomic({k: v for k, v in state.items() if k not in TENSORS}, tmp / TRAIN_STATE)
            except UserError:
                shutil.rmtree(tmp, ignore_errors=True)  # the other ranks, waiting below, lose rank 0 and end
                raise
        ctx.barrier()
        with _unwritable(path, tmp, ctx):
            pending = save_tensors(state, tmp, background)

        def complete() -> None:
            if pending is not None:
                with _unwritable(path, tmp, ctx):
                    pending.result()
                ctx.barrier()  # every rank's shard is written
            if ctx.is_main:
                write_text_atomic(tmp / COMPLETE, f"step {state['step']}, {ctx.world_size} shard(s)\n")
                if path.exists():
                    shutil.rmtree(path)
                os.replace(tmp, path)

        return complete

    def read_meta(self, path: Path) -> dict[str, Any]:
        """Everything but the tensors' values: train state, config, and the model's tensor shapes."""
        path = self._complete(path)
        damage = _damage(path)
        if damage is not None:
            raise UserError(f"checkpoint {path} cannot be read ({damage}); it is damaged, use an earlier checkpoint")
        try:
            meta = torch.load(path / TRAIN_STATE, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise UserError(
                f"checkpoint {path} holds objects a checkpoint never holds and was not loaded; "
                f"use a checkpoint written by multicard"
            ) from None
        except Exception as exc:
            raise UserError(f"checkpoint {path} cannot be read ({type(exc).__name__}); it may be damaged") from None
        return {**meta, "model": self._whole_tensors(path, "model", device="meta")}

    def read(self, path: Path, template: dict[str, Any] | None = None) -> dict[str, Any]:
        """The checkpoint with its tensors: loaded into `template`'s (model, optimizer) layout, or
        without one as whole CPU tensors of the model (and its EMA) alone (eval, export, fine-tuning)."""
        meta = self.read_meta(path)
        path = self._complete(path)
        if template is None:  # the model and, where the run kept one, its weights' EMA
            whole = {key: self._whole_tensors(path, key, device="cpu") for key in ("model", "ema")}
            tensors = {key: value for key, value in whole.items() if value}
        else:
            tensors = {k: template[k] for k in TENSORS if k in template}
        dcp = dcp_api()
        try:
            with warnings.catch_warnings():
                # Whole tensors are read by each process alone, with or without a process group
                # (DCP warns that it assumes so when there is none: that is the intent).
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                dcp.load(tensors, checkpoint_id=path, no_dist=template is None)
        except (dcp.CheckpointException, RuntimeError, KeyError) as exc:
            raise UserError(f"checkpoint {path} cannot be loaded into this run ({_first_line(exc)})") from None
        return {**meta, **tensors}

    def point(self, folder: Path, name: str, path: Path) -> None:
        symlink_atomic(path.name, folder / name)

    def pinned(self, folder: Path) -> set[Path]:
        """The step directory `best` points at: rotation keeps it."""
        best = folder / "best"
        return {best.resolve()} if best.is_symlink() else set()

    def remove(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------

    @staticmethod
    def _complete(path: Path) -> Path:
        path = path.resolve()
        if not (path / COMPLETE).exists() or not (path / ".metadata").exists():
            raise UserError(
                f"checkpoint {path} is incomplete (a run ended while writing it); use an earlier checkpoint"
            )
        return path

    @staticmethod
    def _whole_tensors(path: Path, key: str, device: str) -> dict[str, torch.Tensor]:
        """Empty whole tensors of `key`'s entries, shaped as saved (DCP's metadata holds the shapes)."""
        dcp = dcp_api()
        metadata = _metadata(path).state_dict_metadata
        prefix = f"{key}."
        return {
            name[len(prefix) :]: torch.empty(m.size, dtype=m.properties.dtype, device=device)
            for name, m in metadata.items()
            if name.startswith(prefix) and isinstance(m, dcp.metadata.TensorStorageMetadata)
        }


def save_tensors(state: dict[str, Any], checkpoint_id: Path | str, background: Any) -> Any:
    """Every rank's shard of the state's tensors to `checkpoint_id` (a folder or a URL) through DCP;
    in the background (`background`: the process group for it) the pending save, else None."""
    tensors = {k: state[k] for k in TENSORS if k in state}
    dcp = dcp_api()
    # Rank 0's copy of replicated tensors (BatchNorm statistics, everything under ddp).
    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    if background is not None:
        return dcp.async_save(tensors, checkpoint_id=checkpoint_id, planner=planner, process_group=background)
    with warnings.catch_warnings():
        # One process without a process group saves alone (DCP warns that it assumes so).
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(tensors, checkpoint_id=checkpoint_id, planner=planner)
    return None


def dcp_api() -> Any:
    """torch.distributed.checkpoint, imported on first use: it pulls in DTensor and sympy (over
    half a second), which a launcher that only reads a checkpoint's settings should not pay."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _metadata(path: Path) -> Any:
    """DCP's index of a step directory: every tensor's shape, and where its bytes are."""
    try:
        return dcp_api().FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        raise UserError(
            f"checkpoint {path} cannot be read ({path / '.metadata'}: {type(exc).__name__}); it is damaged, "
            f"use an earlier checkpoint"
        ) from None


def _damage(path: Path) -> str | None:
    """What is wrong with a step directory's shard files — one missing, or shorter than its
    index says (truncated) — or None. Sizes only: cheap enough to check every candidate for resume."""
    needed: dict[str, int] = {}
    for info in (_metadata(path).storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return f"{shard} is missing"
        if shard.stat().st_size < size:
            return f"{shard} has {shard.stat().st_size} of its {size} bytes"
    return None


@contextmanager
def _unwritable(path: Path, tmp: Path, ctx: ProcessContext) -> Iterator[None]:
    """A failed write of the shards (disk full, quota) in one line, said by rank 0 alone: DCP
    reports one rank's failure to every rank. What the write made goes (CheckpointException is a
    BaseException)."""
    try:
        yield
    except (dcp_api().CheckpointException, OSError) as exc:
        every_rank = isinstance(exc, dcp_api().CheckpointException)  # DCP tells every rank of any rank's failure
        reason = _os_reason(exc) or (_probe(tmp) if ctx.is_main else None) or _first_line(exc)
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if every_rank:
            ctx.barrier()  # removed before any rank ends (a launcher stops the others when one ends)
        error = UserError(
            f"cannot write {path} ({reason}); free space in {path.parent} or choose another out_dir "
            f"(earlier checkpoints are intact)"
        )
        error.every_rank = every_rank  # then rank 0 alone says it (exits.report_error)
        raise error from None


def _os_reason(exc: BaseException) -> str | None:
    """The OS's reason (e.g. 'No space left on device') inside DCP's per-rank failures, if any."""
    if isinstance(exc, OSError):
        return os.strerror(exc.errno) if exc.errno else exc.strerror
    inner = [f[0] if isinstance(f, tuple) else f for f in getattr(exc, "failures", {}).values()]  # (exc, trace)
    for cause in [*inner, exc.__cause__, exc.__context__]:
        if isinstance(cause, BaseException) and cause is not exc:
            reason = _os_reason(cause)
            if reason:
                return reason
    return None


def _probe(folder: Path) -> str | None:
    """Why `folder` takes no more bytes (disk full, quota), found by writing 1 MiB there; None if it
    does. DCP's shard writer loses the OS error (torch's zip writer says only 'unexpected pos')."""
    if not folder.is_dir():
        return None
    probe = folder / ".space-probe"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(2**20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return exc.strerror
    finally:
        probe.unlink(missing_ok=True)
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
