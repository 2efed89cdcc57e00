"""A folder of step checkpoints on a store (base/store.py): local disk and object storage alike.

Its checkpoints are the committed `step-NNNNNNNNN.pt` files and `step-NNNNNNNNN/` folders (on local disk
renamed into place when whole; on object storage named by a commit object written last); what a run left
uncommitted is no checkpoint for any reader. `last` and `best` (or `last.pt`, `best.pt`) name checkpoints
in it: the pointer the run wrote where it names a committed one, else the newest. `locate` is how every
reader (resume, eval, export, model.weights, the launcher's settings check) finds the checkpoint a path or
URL names, and `readable` gives it as a local path its format reads (object storage: a copy), where `format_of`
says which format reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from multicard.base.errors import UserError
from multicard.base.store import COMMIT, LocalStore, Store, commit_name, open_store
from multicard.checkpoint.compat import check_format
from multicard.checkpoint.sharded import COMPLETE, Incomplete, Sharded, part_of_sharded
from multicard.checkpoint.single_file import PREFIX, SingleFile
from multicard.runtime.process_group import ProcessContext


class Format(Protocol):
    """A checkpoint format (single_file.SingleFile, sharded.Sharded): how a step is named, written and read."""

    @property
    def name(self) -> str: ...
    @property
    def pointers(self) -> tuple[str, ...]: ...  # the names of `last` and `best` it writes
    @property
    def needs_template(self) -> bool: ...  # it reads into tensors of the reading run's layout
    @property
    def whole_state(self) -> bool: ...  # rank 0 writes whole tensors (else each rank its shard)

    def name_for(self, step: int) -> str: ...
    def owns(self, path: Path) -> bool: ...
    def write(self, store: Store, name: str, state: dict[str, Any], ctx: ProcessContext, background: Any = None,
              wait_s: float = 0.0) -> tuple[Callable[[], None], bool]: ...  # fmt: skip
    def read(self, path: Path, template: dict[str, Any] | None = None) -> dict[str, Any]: ...
    def read_meta(self, path: Path) -> dict[str, Any]: ...


FORMATS: dict[str, Format] = {"file": SingleFile(), "sharded": Sharded()}
LAST_NAMES, BEST_NAMES = ("last", "last.pt"), ("best", "best.pt")
POINTERS = LAST_NAMES + BEST_NAMES


def step_of(name: str) -> int | None:
    """N of step-NNNNNNNNN, step-NNNNNNNNN.pt or step-NNNNNNNNN.commit; None for any other name."""
    digits = name[len(PREFIX) :].removesuffix(".pt").removesuffix(COMMIT)
    return int(digits) if name.startswith(PREFIX) and digits.isdigit() else None


def checkpoint_store(default: Path, configured: str | None) -> Store:
    """Where a run's checkpoints are: checkpoint.dir (a local path or a URL), else `default`,
    out_dir/checkpoints. The one place that decides it."""
    return open_store(configured, "checkpoint.dir") if configured else LocalStore(str(default))


def split(location: str) -> tuple[str, str]:
    """(the folder, the name in it) of a path or URL."""
    parent, _, name = location.rstrip("/").rpartition("/")
    return (parent or ("/" if location.startswith("/") else "")), name


def format_of(path: Path) -> Format:
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


def checkpoints_in(folder: Path) -> list[Path]:
    """Every whole step checkpoint in a local `folder` (any format), newest first."""
    paths = [Path(folder) / name for _, name in CheckpointFolder(LocalStore(str(folder))).steps()]
    return [path for path in paths if not path.is_dir() or (path / COMPLETE).exists()]


class CheckpointFolder:
    """The step checkpoints in a store's folder."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def steps(self, listing: dict[str, Any] | None = None) -> list[tuple[int, str]]:
        """(step, name) of every committed step checkpoint, newest first."""
        listing = self.store.listing() if listing is None else listing
        found = [(step_of(name), name) for name in self.store.committed(listing) if not name.endswith(COMMIT)]
        return sorted(((step, name) for step, name in found if step is not None), reverse=True)

    def leftovers(self, listing: dict[str, Any]) -> list[tuple[int, str]]:
        """(step, name as listed) of every step checkpoint a run began and never committed, newest first."""
        meant = self.store.uncommitted(listing)
        found = [(step_of(meant[name]), name) for name in meant]
        return sorted(((step, name) for step, name in found if step is not None), reverse=True)

    def target(self, pointer: str, listing: dict[str, Any]) -> str | None:
        """The committed checkpoint `pointer` (one of POINTERS) names: what the run pointed it at where
        that is committed, else the newest; None in a folder without one."""
        committed = set(self.store.committed(listing))
        for name in LAST_NAMES if pointer in LAST_NAMES else BEST_NAMES:
            if name in listing and self.store.resolve(name, listing) in committed:
                return self.store.resolve(name, listing)
        steps = self.steps(listing)
        return steps[0][1] if steps else None

    def newest_readable(self) -> tuple[str | None, dict[str, Any] | None, list[str]]:
        """The newest checkpoint whose metadata reads (its location and metadata), and a warning for each
        newer one passed over: never committed, without its COMPLETE marker, or damaged."""
        listing = self.store.listing()
        steps = self.steps(listing)
        newest = steps[0][0] if steps else -1
        skipped = [
            f"skipping {self.store.join(name)}: {self.store.uncommitted_note} (a run ended while writing it)"
            for step, name in self.leftovers(listing) if step > newest
        ]  # fmt: skip
        for _, name in steps:
            location = self.store.join(name)
            with self.store.local_copy(name) as local:
                try:
                    meta = format_of(local).read_meta(local)
                    check_format(meta, local)
                except Incomplete:
                    skipped.append(
                        f"skipping {location}: it has no {COMPLETE} marker (a run ended while writing it, or it was "
                        f"copied in part)"
                    )
                    continue
                except UserError as exc:
                    said = str(exc).replace(str(local), location).removeprefix("checkpoint ")
                    skipped.append(f"skipping damaged {said}")
                    continue
            return location, meta, skipped
        return None, None, skipped


def locate(location: str, key: str, missing: str | None = None) -> tuple[Store, str]:
    """The folder holding the checkpoint `location` names and its name there: a committed step
    checkpoint, `last` or `best` of a folder of them, or any other file or object (a state dict); one
    line where it names an uncommitted one, a folder of them, or nothing (`missing`: that line)."""
    store = open_store(location, key)
    parent, name = split(store.url)
    folder = CheckpointFolder(open_store(parent, key) if parent else LocalStore(""))
    listing = folder.store.listing()
    if name in POINTERS:
        target = folder.target(name, listing)
        if target is None:
            raise UserError(f"{key}={location}: {folder.store.url} holds no committed checkpoint; give another one")
        return folder.store, target
    if step_of(name) is not None and name not in folder.store.committed(listing):
        if name in listing:
            raise UserError(
                f"{key}={location} is not a committed checkpoint (no {commit_name(name)}: its upload did not finish, "
                f"or it does not exist); give a committed one, e.g. {folder.store.join('last')}"
            )
        raise UserError(missing or f"checkpoint not found: {location}")
    if step_of(name) is None:
        inside = CheckpointFolder(store).steps()
        if inside:
            raise UserError(
                f"{key}={location} is a folder of checkpoints; give one of them, e.g. {store.join('last')} or "
                f"{store.join(inside[0][1])}"
            )
        if name not in listing:
            raise UserError(missing or f"checkpoint not found: {location}")
    return folder.store, name


@contextmanager
def readable(location: str, key: str = "--checkpoint") -> Iterator[Path]:
    """The checkpoint `location` names (locate) as a local path its format reads: on local disk itself,
    on object storage a copy for the time of the reading."""
    store, name = locate(location, key)
    with store.local_copy(name) as local:
        yield local
