"""The sharded checkpoint format: step-NNNNNNNNN/, every rank writing its own shard in parallel
through torch.distributed.checkpoint (DCP).

Rank 0 writes train_state.pt (position, random streams, schedule, config) into the step's staging
folder on the store (base/store.py: a hidden `.step-NNNNNNNNN.incomplete` on local disk, the step's own
prefix on object storage), every rank its shard (DCP's file writer, or its fsspec writer for a URL);
once every rank has written, rank 0 adds the COMPLETE marker and commits the folder (renamed into place,
or its commit object written): a step directory without the marker is never read. Reading reshards:
the saved shards are loaded into whatever layout the reading run has (fsdp at any world size, ddp, one
process with no process group).
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from multicard.base.errors import UserError
from multicard.base.storage import first_line
from multicard.base.store import Store
from multicard.checkpoint.single_file import PREFIX, serialised
from multicard.runtime.process_group import ProcessContext

COMPLETE = "COMPLETE"  # written last, by rank 0, after every shard and train_state.pt
TRAIN_STATE = "train_state.pt"
# What DCP shards (ema: where the run keeps one; models, optimizers: a run's others); the rest: train_state.pt
TENSORS = ("model", "optimizer", "ema", "models", "optimizers")


class Incomplete(UserError):
    """A step directory without its COMPLETE marker: a run ended while writing it, or it was copied in part."""


def part_of_sharded(path: Path) -> Path | None:
    """The sharded checkpoint directory a file belongs to, or None."""
    return path.parent if path.is_file() and (path.parent / ".metadata").exists() else None


class Sharded:
    name = "sharded"
    pointers = ("last", "best")
    needs_template = True  # DCP loads into tensors of the reading run's layout
    whole_state = False  # each rank writes its own shard

    def name_for(self, step: int) -> str:
        return f"{PREFIX}{step:09d}"

    def owns(self, path: Path) -> bool:
        """A step directory: written by this format, or named like one (an unfinished one too)."""
        named = path.name.startswith((PREFIX, f".{PREFIX}"))
        return path.is_dir() and (named or any((path / m).exists() for m in (".metadata", COMPLETE, TRAIN_STATE)))

    def write(self, store: Store, name: str, state: dict[str, Any], ctx: ProcessContext, background: Any = None,
              wait_s: float = 0.0) -> tuple[Callable[[], None], bool]:  # fmt: skip
        """Every rank writes its shard into the step's staging folder (store.staging); returns `complete`,
        which waits for that and (rank 0) adds the marker and commits the folder, and whether the write goes
        on in the background: with `background` (a process group of its own), the shards are written by a
        background thread from a CPU copy of each rank's state, and training goes on until `complete`."""
        staged = store.staging(name)
        if ctx.is_main:
            store.abandon(name)  # what a killed run left of this step
            try:
                store.write(f"{staged}/{TRAIN_STATE}", serialised({k: v for k, v in state.items() if k not in TENSORS}))
            except UserError:
                store.abandon(name)  # the other ranks, waiting below, lose rank 0 and end
                raise
        ctx.barrier()
        with _unwritable(store, name, ctx):
            pending = save_tensors(state, store.join(staged), background)

        def complete() -> None:
            if pending is not None:
                with _unwritable(store, name, ctx):
                    pending.result()
            ctx.barrier()  # every rank's shard is written
            if ctx.is_main:
                store.write(f"{staged}/{COMPLETE}", f"step {state['step']}, {ctx.world_size} shard(s)\n".encode())
                store.commit(name)

        return complete, pending is not None

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
        if template is None:  # the model and, where the run kept them, its weights' EMA and its other models
            keys = ("model", "ema", "models")
            whole: dict[str, Any] = {key: self._whole_tensors(path, key, device="cpu") for key in keys}
            whole["models"] = by_model(whole["models"])
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
            raise UserError(f"checkpoint {path} cannot be loaded into this run ({first_line(exc)})") from None
        return {**meta, **tensors}

    # ------------------------------------------------------------

    @staticmethod
    def _complete(path: Path) -> Path:
        path = path.resolve()
        if not (path / COMPLETE).exists() or not (path / ".metadata").exists():
            raise Incomplete(
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


def by_model(flat: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """A run's other models ("1.weight" → {"1": {"weight": ...}}): each model's own state dict."""
    nested: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in flat.items():
        model, _, key = name.partition(".")
        nested.setdefault(model, {})[key] = tensor
    return nested


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
def _unwritable(store: Store, name: str, ctx: ProcessContext) -> Iterator[None]:
    """A failed write of the shards (disk full, quota, the store gone) in one line, said by rank 0 alone:
    DCP reports one rank's failure to every rank. What local disk holds of it goes (CheckpointException is
    a BaseException)."""
    try:
        yield
    except (dcp_api().CheckpointException, OSError) as exc:
        every_rank = isinstance(exc, dcp_api().CheckpointException)  # DCP tells every rank of any rank's failure
        error = store.write_failure(name, exc, probe=ctx.is_main)
        if ctx.is_main:
            store.abandon(name)
        if every_rank:
            ctx.barrier()  # removed before any rank ends (a launcher stops the others when one ends)
        error.every_rank = every_rank  # then rank 0 alone says it (exits.report_error)
        raise error from None
