"""The one owner of a run's checkpoint folder.

It decides when to save (every N optimizer steps, at epoch ends, when the ranks agree to stop),
writes through a format (one file by rank 0, or one shard per rank), points `last`/`best` at
the newest and best checkpoints, keeps the newest `keep_last`, chooses what a run continues
from (`train.resume` = auto / never / a path, passing over damaged ones) and checks that the
run can continue it. The training loop only reports that a step or an epoch has ended.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from multicard.base.atomic import remove_temporaries, save_atomic
from multicard.base.config import CheckpointConfig
from multicard.base.errors import Stopped, UserError
from multicard.base.version import __version__
from multicard.checkpoint.compat import (
    FORMAT_VERSION,
    RunFacts,
    check_format,
    check_resumable,
    check_settings,
    schedule_stretch,
)
from multicard.checkpoint.remote import (
    RemoteFolder,
    checkpoint_folder,
    committed_target,
    downloaded,
    is_remote,
    readable,
    step_of,
)
from multicard.checkpoint.remote_writer import RemoteWriter, estimate_line
from multicard.checkpoint.sharded import COMPLETE, TRAIN_STATE, Sharded, incomplete_dirs, part_of_sharded, unmarked_dirs
from multicard.checkpoint.single_file import SingleFile
from multicard.engine.loop import Callback, Loop, StepEnd
from multicard.engine.meters import EvalResult
from multicard.engine.phases import CHECKPOINT, IDLE

if TYPE_CHECKING:  # annotations only: the strategies import torch's sharding stack
    from multicard.strategy.base import Strategy

FORMATS = {"file": SingleFile(), "sharded": Sharded()}
# The parts of the trainer's state a checkpoint holds at its top level (what eval, export and
# fine-tuning read); the rest (position, random streams) is under "resume", with the run's facts.
TOP_LEVEL = ("model", "optimizer", "scheduler", "scaler", "ema")  # ema: where the run keeps one


def format_of(path: Path) -> Any:
    """The format that reads `path`."""
    whole = part_of_sharded(path)
    if whole is not None:
        raise UserError(f"{path} is one file of the sharded checkpoint {whole}; give the directory {whole}")
    for fmt in FORMATS.values():
        if fmt.owns(path):
            return fmt
    if not path.exists():
        raise UserError(f"checkpoint not found: {path}")
    if path.is_dir() and checkpoints_in(path):
        raise UserError(
            f"{path} is a folder of checkpoints; give one of them, e.g. {path / 'last'} or {checkpoints_in(path)[0]}"
        )
    if path.is_dir():
        raise UserError(
            f"{path} is a directory that holds no checkpoint; give a step directory "
            f"(…/checkpoints/step-NNNNNNNNN) or a .pt file"
        )
    raise UserError(f"checkpoint {path} is neither a step file (.pt) nor a step directory")


def _steps_in(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step checkpoint in `folder` (any format), newest first."""
    found = [item for fmt in FORMATS.values() for item in fmt.steps(folder)] if folder.is_dir() else []
    return sorted(found, key=lambda item: item[0], reverse=True)


def checkpoints_in(folder: Path) -> list[Path]:
    """Every step checkpoint in `folder` (any format), newest first."""
    return [path for _, path in _steps_in(folder)]


def newest_readable(folder: Path) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """The newest checkpoint whose metadata reads (its path and metadata), and a warning for
    each newer one passed over: damaged, or a step directory without its COMPLETE marker (on object
    storage: uncommitted)."""
    if is_remote(folder):
        return _newest_committed(folder)
    unmarked = [(step, path, False) for step, path in unmarked_dirs(folder)] if folder.is_dir() else []
    candidates = [(step, path, True) for step, path in _steps_in(folder)] + unmarked
    skipped = []
    for _, path, complete in sorted(candidates, key=lambda item: item[0], reverse=True):
        if not complete:
            skipped.append(
                f"skipping {path}: it has no {COMPLETE} marker (a run ended while writing it, or it was copied in part)"
            )
            continue
        try:
            meta = format_of(path).read_meta(path)
            check_format(meta, path)
        except UserError as exc:
            skipped.append(f"skipping damaged {str(exc).removeprefix('checkpoint ')}")
            continue
        return path, meta, skipped
    return None, None, skipped


def _newest_committed(url: str) -> tuple[str | None, dict[str, Any] | None, list[str]]:
    """newest_readable of a folder on object storage: its newest committed checkpoint (a commit object
    is written once the upload is whole), and a warning for each newer one not committed."""
    store = RemoteFolder(url)
    names = store.names()  # one listing
    committed = store.committed(names)
    step, newest = committed[0] if committed else (-1, None)
    cut_short = [u for u in store.uncommitted(names) if step_of(u.rsplit("/", 1)[-1]) > step]  # newer ones
    skipped = [f"skipping {u}: it has no commit object (a run ended while uploading it)" for u in cut_short]
    if newest is None:
        return None, None, skipped
    with downloaded(newest) as local:
        meta = format_of(local).read_meta(local)
        check_format(meta, local)
    return newest, meta, skipped


def resume_path(mode: str) -> Path | str:
    """The checkpoint train.resume=PATH names: a checkpoint, or the newest that reads in a folder of them
    (a URL: the newest committed one in a folder of them)."""
    if is_remote(mode):
        return _remote_resume_path(mode)
    path = Path(mode)
    if not path.exists():
        raise UserError(f"train.resume={mode} is neither auto, never nor an existing checkpoint file")
    if path.is_dir() and not any(fmt.owns(path) for fmt in FORMATS.values()) and checkpoints_in(path):
        newest, _, _ = newest_readable(path)
        if newest is None:
            raise UserError(f"train.resume={mode}: no checkpoint in that folder reads; give one of them, or never")
        return newest
    return path


def _remote_resume_path(url: str) -> str:
    """train.resume=URL: a committed checkpoint, or the newest committed one of a folder of them."""
    if step_of(url.rstrip("/").rsplit("/", 1)[-1]) is None:  # not a step checkpoint: maybe a folder of them
        newest = RemoteFolder(url.rstrip("/")).newest()
        if newest is not None:
            return newest
    return committed_target(url, "train.resume")


def check_resume_settings(folder: Path, mode: str, config: dict[str, Any]) -> None:
    """Before a launcher starts workers: the checkpoint train.resume would continue accepts this
    config (its settings; the data and model are checked by the workers). `folder`: out_dir/checkpoints,
    unless the config's checkpoint.dir says otherwise."""
    if mode == "never":
        return
    if mode == "auto":
        path, meta, _ = newest_readable(checkpoint_folder(folder, config.get("checkpoint", {}).get("dir")))
    else:
        path = resume_path(mode)
        with readable(path) as local:
            meta = format_of(local).read_meta(local)
    if path is not None and meta is not None:
        check_settings(meta, path, config)


def read_checkpoint(path: Path | str) -> dict[str, Any]:
    """A checkpoint's contents in the single-file layout, whatever its format; the model as whole
    CPU tensors (for eval, export and fine-tuning). A URL: a committed checkpoint on object storage."""
    with readable(path) as local:
        fmt = format_of(local)
        check_format(fmt.read_meta(local), local)
        return fmt.read(local)


class Checkpointer(Callback):
    def __init__(
        self,
        folder: Path,
        strategy: Strategy,
        options: CheckpointConfig,
        run: RunFacts,
        say: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.folder: Path | str = checkpoint_folder(folder, options.dir)  # checkpoint.dir, else `folder`
        self.strategy = strategy
        self.ctx = strategy.ctx
        self.options = options
        self.run = run
        self.say = say
        fmt = FORMATS[strategy.checkpoint_format if options.format == "auto" else options.format]
        self.remote = is_remote(self.folder)
        self.writer = RemoteWriter(fmt, self.folder, options.stop_timeout_s) if self.remote else fmt
        self.last_saved: tuple[int, Path | str] | None = None
        # Background writes need a process group of their own: their collectives would otherwise
        # interleave with training's (gloo aborts on that).
        self.background = dist.new_group(backend="gloo") if options.async_save and self.ctx.distributed else None
        self._pending: tuple[Path, Callable[[], None], bool] | None = None  # a write still in progress

    # ------------------------------------------------------------ resume

    def choose(self, mode: str) -> Path | None:
        """What to continue from: agreed by every rank (None: start afresh).

        auto: the newest checkpoint that reads, saying which damaged ones it passed over;
        never: start afresh and remove the folder's old checkpoints; else the path given.
        """
        chosen: str | None = None
        if self.remote:
            return self._choose_remote(mode)
        if self.ctx.is_main:
            self._check_folder()
        if self.ctx.is_main and self.folder.is_dir():
            remove_temporaries(self.folder)
            for unfinished in incomplete_dirs(self.folder):
                shutil.rmtree(unfinished, ignore_errors=True)
                self.say(f"removed {unfinished.name}: a run ended while writing that checkpoint")
            if mode == "never":
                self._remove_all()
            elif mode == "auto":
                chosen = self._newest_valid()
        if mode not in ("auto", "never"):
            chosen = str(resume_path(mode))  # every rank reads it, and a bad one fails on every rank
        chosen = self.strategy.broadcast_object(chosen)
        return Path(chosen) if chosen is not None else None

    def _choose_remote(self, mode: str) -> str | None:
        """choose() of a folder on object storage: auto takes the newest committed checkpoint (its
        commit object is written once the upload is whole); uncommitted ones are removed, and said."""
        chosen: str | None = None
        store = self.writer.store
        for url in store.uncommitted() if self.ctx.is_main else []:
            store.discard(url)
            self.say(f"removed {url}: a run ended while uploading that checkpoint (it has no commit object)")
        if self.ctx.is_main and mode == "never":
            old = self.writer.steps(self.folder)
            for _, url in old:
                self.writer.remove(url)
            if old:
                self.say(f"train.resume=never: removed {len(old)} checkpoint(s) of an earlier run in {self.folder}")
        elif self.ctx.is_main and mode == "auto":
            chosen = store.newest()
        elif mode not in ("auto", "never"):
            chosen = str(resume_path(mode))
        return self.strategy.broadcast_object(chosen)

    def _check_folder(self) -> None:
        """A file in the folder's way is said before any training, not after an epoch. The folder
        itself is made by the first save: a run refused before it leaves none."""
        if self.folder.exists() and not self.folder.is_dir():
            raise UserError(
                f"{self.folder} is a file, not a folder for checkpoints; move it away or choose another out_dir"
            )

    def _newest_valid(self) -> str | None:
        path, meta, skipped = newest_readable(self.folder)
        for line in skipped:
            self.say(f"warning: {line}")
        return str(path) if path is not None else None

    def _remove_all(self) -> None:
        old = checkpoints_in(self.folder)
        for path in old:
            format_of(path).remove(path)
        self._remove_pointers(FORMATS.values())
        if old:
            self.say(f"train.resume=never: removed {len(old)} checkpoint(s) of an earlier run in {self.folder}")

    def _remove_pointers(self, formats: Any) -> None:
        for fmt in formats:
            for name in fmt.pointers:
                pointer = self.folder / name
                if pointer.exists() or pointer.is_symlink():
                    pointer.unlink()

    def restore(self, path: Path | str, loop: Loop) -> dict[str, Any]:
        """Check that this run can continue `path`, then load it into the trainer; its contents."""
        with readable(path) as local:
            fmt = format_of(local)
            meta = fmt.read_meta(local)
            check_resumable(meta, local, self.run, loop.bare)
            stretched = schedule_stretch(meta, self.run.config)
            if stretched is not None:
                self.say(stretched)
            state = fmt.read(local, loop.state_dict() if fmt.needs_template else None)
        loop.load_state_dict({**{k: state[k] for k in TOP_LEVEL if k in state}, **state["resume"]})
        self.last_saved = (loop.position.global_step, path)
        return state

    # ------------------------------------------------------------ saving

    def save(self, loop: Loop, val: EvalResult | None = None, best: bool = False) -> Path:
        """Write the checkpoint of the current step (every rank calls it), then point last (and
        best) at it and drop old ones; all ranks return once it is complete, or, with
        checkpoint.async_save, once its writing has begun (it completes before the next save)."""
        loop.set_phase(CHECKPOINT)
        self.finish_writing()
        pos = loop.position
        state = loop.state_dict(whole=self.writer.whole_state)
        contents = {
            "multicard_version": __version__,
            "format": FORMAT_VERSION,
            "config": self.run.config,
            **({"script": self.run.script} if self.run.script else {}),
            "classes": self.run.classes,
            "step": pos.global_step,
            "epoch": pos.epoch - (1 if pos.step_in_epoch == 0 else 0),
            "val": val.as_dict() if val is not None else None,
            **{k: state[k] for k in TOP_LEVEL if k in state},
            "resume": {
                **{k: v for k, v in state.items() if k not in TOP_LEVEL},  # position, rng
                "steps_per_epoch": self.run.steps_per_epoch,
                "world_size": self.run.world_size,
                "data_fingerprint": self.run.data_fingerprint,
            },
        }
        path = self.writer.path_for(self.folder, pos.global_step)
        self._pending = (path, self.writer.write(path, contents, self.ctx, self.background), best)
        if self.background is None and not self.remote:  # an upload goes on in the background
            self.finish_writing()
        self.last_saved = (pos.global_step, path)
        loop.set_phase(IDLE)
        return path

    def finish_writing(self) -> None:
        """Complete the write in progress, if any: then point last (and best) at it and rotate."""
        if self._pending is None:
            return
        path, complete, best = self._pending
        self._pending = None
        complete()
        if self.ctx.is_main:
            if not self.remote:
                self._remove_pointers(f for f in FORMATS.values() if f is not self.writer)  # a run that changed format
            self.writer.point(self.folder, "last", path)
            if best:
                self.writer.point(self.folder, "best", path)
            self._rotate()
        self.strategy.barrier()

    def _rotate(self) -> None:
        keep = self.writer.pinned(self.folder)
        steps = sorted(self.writer.steps(self.folder), key=lambda item: item[0], reverse=True)
        for _, path in steps[self.options.keep_last :]:
            if path not in keep:
                self.writer.remove(path)

    # ------------------------------------------------------------ cadence (Trainer callbacks)

    def on_step_end(self, loop: Loop, step: StepEnd) -> None:
        every = self.options.every_steps
        if every and step.global_step % every == 0 and not step.last_in_epoch and not step.stop_signal:
            self.save(loop)  # an epoch's last step is saved at its end, a stop's by on_stop

    def on_epoch_end(self, loop: Loop, record: dict[str, Any], val: EvalResult | None, best: bool) -> None:
        self.save(loop, val, best)

    def on_fit_start(self, loop: Loop) -> None:
        if self.remote and self.ctx.is_main:  # what a preemption's grace period must cover
            self.say(estimate_line(loop, self.writer.store, self.options.stop_timeout_s))

    def on_stop(self, loop: Loop, stop: Stopped) -> None:
        began = time.monotonic()
        if self.last_saved is None or self.last_saved[0] != loop.position.global_step:
            self.save(loop)
        self.finish_writing()  # the upload too: a stop waits for it
        stop.checkpoint = str(self.last_saved[1]) if self.last_saved else None
        stop.save_s = time.monotonic() - began

    def on_fit_end(self, loop: Loop) -> None:
        self.finish_writing()


def edit_resume_state(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Change, in place, what the checkpoint at `path` holds to resume from (the loop's position
    and random streams, under "resume"): `multicard verify --break` drops some of it on purpose."""
    holder = path / TRAIN_STATE if path.is_dir() else path  # where each format keeps it
    state = torch.load(holder, map_location="cpu", weights_only=True)
    edit(state["resume"])
    save_atomic(state, holder)
