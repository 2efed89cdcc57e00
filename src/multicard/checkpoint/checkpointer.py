"""The one owner of a run's checkpoint folder, on local disk or object storage alike (its store:
base/store.py; its checkpoints: checkpoint/folder.py).

It decides when to save (every N optimizer steps, at epoch ends, when the ranks agree to stop),
writes through a format (one file by rank 0, or one shard per rank) and commits it, points `last`/`best`
at the newest and best checkpoints, keeps the newest `keep_last`, chooses what a run continues
from (`train.resume` = auto / never / a path or URL, passing over uncommitted and damaged ones) and
checks that the run can continue it. The training loop only reports that a step or an epoch has ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from multicard.base.atomic import save_atomic
from multicard.base.config import CheckpointConfig
from multicard.base.errors import Stopped, UserError
from multicard.base.store import Store, open_store
from multicard.base.version import __version__
from multicard.checkpoint.compat import (
    FORMAT_VERSION,
    RunFacts,
    check_format,
    check_resumable,
    check_settings,
    schedule_stretch,
)
from multicard.checkpoint.folder import (
    FORMATS,
    POINTERS,
    CheckpointFolder,
    checkpoint_store,
    format_of,
    locate,
    readable,
    split,
    step_of,
)
from multicard.checkpoint.node_copies import NodeCopies
from multicard.checkpoint.sharded import TRAIN_STATE
from multicard.engine.loop import Callback, Loop, StepEnd
from multicard.engine.meters import EvalResult
from multicard.engine.phases import CHECKPOINT, IDLE

if TYPE_CHECKING:  # annotations only: the strategies import torch's sharding stack
    from multicard.strategy.base import Strategy

# The parts of the loop's state a checkpoint holds at its top level (what eval, export and
# fine-tuning read); the rest (position, random streams) is under "resume", with the run's facts.
# ema: where the run keeps one; models, optimizers, schedulers: a run's others (multicard.Run)
TOP_LEVEL = ("model", "optimizer", "scheduler", "scaler", "ema", "models", "optimizers", "schedulers")
PROBE_BYTES = 2**20  # the test write that measures the link to object storage at start-up


def resume_path(mode: str) -> str:
    """The checkpoint train.resume=PATH names: a checkpoint (checkpoint/folder.py `locate`), or the newest
    that reads in a folder of them."""
    store = open_store(mode, "train.resume")
    name = split(store.url)[1]
    folder = CheckpointFolder(store)
    if name not in POINTERS and step_of(name) is None and folder.steps():
        newest, _, _ = folder.newest_readable()
        if newest is None:
            raise UserError(f"train.resume={mode}: no checkpoint in that folder reads; give one of them, or never")
        return newest
    parent, name = locate(mode, "train.resume", f"train.resume={mode} is neither auto, never nor an existing "
                          f"checkpoint file")  # fmt: skip
    return parent.join(name)


def check_resume_settings(folder: Path, mode: str, config: dict[str, Any]) -> None:
    """Before a launcher starts workers: the checkpoint train.resume would continue accepts this
    config (its settings; the data and model are checked by the workers). `folder`: out_dir/checkpoints,
    unless the config's checkpoint.dir says otherwise."""
    if mode == "never":
        return
    if mode == "auto":
        store = checkpoint_store(folder, config.get("checkpoint", {}).get("dir"))
        path, meta, _ = CheckpointFolder(store).newest_readable()
    else:
        path = resume_path(mode)
        with readable(path, "train.resume") as local:
            meta = format_of(local).read_meta(local)
    if path is not None and meta is not None:
        check_settings(meta, path, config)


def read_checkpoint(path: Path | str) -> dict[str, Any]:
    """A checkpoint's contents in the single-file layout, whatever its format and wherever it is; the
    model as whole CPU tensors (for eval, export and fine-tuning)."""
    with readable(str(path)) as local:
        fmt = format_of(local)
        check_format(fmt.read_meta(local), local)
        return fmt.read(local)


def state_bytes(loop: Loop) -> int:
    """About the bytes of one checkpoint: the model's tensors and the optimizer's (before the first step
    has made them, two per parameter, as Adam keeps)."""
    model = sum(t.numel() * t.element_size() for t in loop.bare.state_dict().values() if isinstance(t, torch.Tensor))
    slots = [t for state in loop.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    optimizer = sum(t.numel() * t.element_size() for t in slots)
    return model + (optimizer if slots else 2 * model)


def estimate_line(loop: Loop, store: Store, stop_timeout_s: float) -> str | None:
    """Where a save crosses a network, the start-up line that says how long one takes: the state's bytes
    at the rate a test write of PROBE_BYTES measured (request latency included), to compare with a grace
    period; None on local disk."""
    took = store.probe_write(PROBE_BYTES)
    if took is None:
        return None
    size, rate = state_bytes(loop), PROBE_BYTES / took
    return (
        f"checkpoints: {store.url}, about {size / 2**20:.1f} MiB each; a {PROBE_BYTES // 2**20} MiB test write took "
        f"{took:.2f} s ({rate / 2**20:.1f} MiB/s): a save (a stop's too) takes about {max(size / rate, took):.1f} s; "
        f"compare with the grace period your platform gives before preemption (checkpoint.stop_timeout_s="
        f"{stop_timeout_s:g})"
    )


class Checkpointer(Callback):
    def __init__(
        self,
        folder: Path,
        strategy: Strategy,
        options: CheckpointConfig,
        run: RunFacts,
        say: Callable[[str], None] = lambda line: None,
        node_copies: Path | None = None,
    ) -> None:
        """`node_copies`: where this node keeps its own copies (checkpoint.local_copy; node_copies.py)."""
        self.store = checkpoint_store(folder, options.dir)  # checkpoint.dir, else `folder`
        self.folder = CheckpointFolder(self.store)
        self.strategy = strategy
        self.ctx = strategy.ctx
        self.options = options
        self.run = run
        self.say = say
        self.fmt = FORMATS[strategy.checkpoint_format if options.format == "auto" else options.format]
        self.last_saved: tuple[int, Path | str] | None = None
        # Background writes: a file is rank 0's alone (a thread); shards need a process group of their own,
        # or their collectives would interleave with training's (gloo aborts on that).
        self.background: Any = None
        if options.async_save:
            sharded = self.fmt is FORMATS["sharded"]
            self.background = (dist.new_group(backend="gloo") if self.ctx.distributed else None) if sharded else True
        self.copies = NodeCopies(node_copies, self.ctx) if node_copies is not None else None
        self._pending: tuple[str, Callable[[], None], bool] | None = None  # a write still in progress
        self._best: str | None | bool = False  # the checkpoint `best` names (False: not asked of the store yet)

    # ------------------------------------------------------------ resume

    def choose(self, mode: str) -> str | None:
        """What to continue from: agreed by every rank (None: start afresh). Leftovers of writes never
        committed are removed first, and said.

        auto: the newest checkpoint that reads, saying which newer ones it passed over;
        never: start afresh and remove the folder's old checkpoints; else the path or URL given.
        """
        chosen: str | None = None
        if self.ctx.is_main:
            self._tidy()
            if mode == "never":
                self._remove_all()
                if self.copies is not None:
                    self.copies.rotate(keep=0)
            elif mode == "auto":
                chosen, _, skipped = self.folder.newest_readable()
                for line in skipped:
                    self.say(f"warning: {line}")
        if mode not in ("auto", "never"):
            chosen = resume_path(mode)  # every rank reads it, and a bad one fails on every rank
        chosen = self.strategy.broadcast_object(chosen)
        own = self.copies.newer(chosen, self.fmt.name_for) if self.copies is not None and mode == "auto" else None
        if own is not None and self.ctx.is_main:
            self.say(f"resuming from each node's own copy of step {own[0]}: the newest in {self.store.url} is "
                     f"{chosen or 'none'} (its write had not finished)")  # fmt: skip
        return own[1] if own is not None else chosen

    def _tidy(self) -> None:
        """A file in the folder's way is said before any training, not after an epoch (the folder itself
        is made by the first save: a run refused before it leaves none); what killed runs left goes."""
        if self.store.in_the_way():
            raise UserError(
                f"{self.store.url} is a file, not a folder for checkpoints; move it away or choose another out_dir"
            )
        self.store.tidy()
        for _, name in self.folder.leftovers(self.store.listing()):
            self.store.discard(name)
            self.say(f"removed {name}: a run ended while writing that checkpoint ({self.store.uncommitted_note})")

    def _remove_all(self) -> None:
        listing = self.store.listing()
        old = self.folder.steps(listing)
        for _, name in old:
            self.store.retire(name)
        for pointer in [name for fmt in FORMATS.values() for name in fmt.pointers if name in listing]:
            self.store.remove(pointer)
        if old:
            self.say(f"train.resume=never: removed {len(old)} checkpoint(s) of an earlier run in {self.store.url}")

    def restore(self, path: Path | str, loop: Loop) -> dict[str, Any]:
        """Check that this run can continue `path`, then load it into the loop; its contents."""
        with readable(str(path), "train.resume") as local:
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

    def save(self, loop: Loop, val: EvalResult | None = None, best: bool = False) -> Path | str:
        """Write the checkpoint of the current step (every rank calls it), then point last (and
        best) at it and drop old ones; all ranks return once it is complete, or, with
        checkpoint.async_save or an upload to object storage, once its writing has begun (it completes
        before the next save). Its location: a Path on local disk, a URL as text."""
        loop.set_phase(CHECKPOINT)
        self.finish_writing()
        name = self.fmt.name_for(loop.position.global_step)
        copy = {"node_copy": self.copies.store} if self.copies is not None else {}  # single files only
        complete, in_background = self.fmt.write(self.store, name, self._contents(loop, val), self.ctx,
                                                 self.background, self.options.stop_timeout_s, **copy)  # fmt: skip
        if self.copies is not None:
            self.copies.rotate()
        self._pending = (name, complete, best)
        if not in_background:  # the same answer on every rank
            self.finish_writing()
        self.last_saved = (loop.position.global_step, self.store.location(name))
        loop.set_phase(IDLE)
        return self.last_saved[1]

    def _contents(self, loop: Loop, val: EvalResult | None) -> dict[str, Any]:
        pos = loop.position
        state = loop.state_dict(whole=self.fmt.whole_state)
        return {
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

    def finish_writing(self) -> None:
        """Complete the write in progress, if any: then point last (and best) at it and rotate."""
        if self._pending is None:
            return
        name, complete, best = self._pending
        self._pending = None
        complete()
        if self.ctx.is_main:
            listing = self.store.listing()
            for pointer in [p for fmt in FORMATS.values() if fmt is not self.fmt for p in fmt.pointers]:
                if pointer in listing:  # a run that changed format
                    self.store.remove(pointer)
            self.store.point(self.fmt.pointers[0], name)
            if best:
                self._best = self.store.point(self.fmt.pointers[1], name)
            self._rotate(listing)
        self.strategy.barrier()

    def _rotate(self, listing: dict[str, Any]) -> None:
        if self._best is False:  # asked of the store once, then remembered
            self._best = next((self.store.pointed(p, listing) for p in self.fmt.pointers[1:] if p in listing), None)
        for _, name in self.folder.steps(listing)[self.options.keep_last :]:
            if name != self._best:
                self.store.retire(name)

    # ------------------------------------------------------------ cadence (the loop's callbacks)

    def on_step_end(self, loop: Loop, step: StepEnd) -> None:
        every = self.options.every_steps
        if every and step.global_step % every == 0 and not step.last_in_epoch and not step.stop_signal:
            self.save(loop)  # an epoch's last step is saved at its end, a stop's by on_stop

    def on_epoch_end(self, loop: Loop, record: dict[str, Any], val: EvalResult | None, best: bool) -> None:
        self.save(loop, val, best)

    def on_fit_start(self, loop: Loop) -> None:
        if self.ctx.is_main:  # what a preemption's grace period must cover, where saves cross a network
            line = estimate_line(loop, self.store, self.options.stop_timeout_s)
            if line is not None:
                self.say(line)

    def on_stop(self, loop: Loop, stop: Stopped) -> None:
        began = time.monotonic()
        if self.last_saved is None or self.last_saved[0] != loop.position.global_step:
            self.save(loop)
        self.finish_writing()  # the upload too: a stop waits for it
        stop.checkpoint = str(self.last_saved[1]) if self.last_saved else None
        stop.save_s = time.monotonic() - began

    def on_fit_end(self, loop: Loop) -> None:
        self.finish_writing()


def edit_resume_state(path: Path | str, edit: Callable[[dict[str, Any]], None]) -> None:
    """Change, in place, what the checkpoint at `path` (on local disk) holds to resume from (the loop's
    position and random streams, under "resume"): `multicard verify --break` drops some of it on purpose."""
    path = Path(path)
    holder = path / TRAIN_STATE if path.is_dir() else path  # where each format keeps it
    state = torch.load(holder, map_location="cpu", weights_only=True)
    edit(state["resume"])
    save_atomic(state, holder)
