"""Each node's own copy of the newest step checkpoints (checkpoint.local_copy), for elastic jobs.

A step checkpoint's durable write (to shared or object storage) may still be going on in the background
(checkpoint.async_save, or an upload) when a node is lost. The first process of every node also writes
the same bytes at once to its own disk, in the folder of the agent that starts the node's workers
(environment.agent_folder: it lives as long as that agent, so no copy outlives the job or belongs to
another). When the job re-forms and every process finds the same step among its node's copies, newer than
the newest durable checkpoint, each resumes from its own copy: the steps since that durable one are not
trained again. A node that joined has no copies, and the job then resumes from the durable checkpoint.
Single-file checkpoints only (every rank holds the whole state).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from multicard.base.store import LocalStore
from multicard.checkpoint.folder import CheckpointFolder, split, step_of
from multicard.runtime.process_group import ProcessContext

KEEP = 2  # copies kept: the newest, and the one before while the newest is written


class NodeCopies:
    def __init__(self, folder: Path, ctx: ProcessContext) -> None:
        self.store = LocalStore(str(folder))
        self.copies = CheckpointFolder(self.store)
        self.ctx = ctx

    def rotate(self, keep: int = KEEP) -> None:
        """Keep the newest `keep` copies, none to clear them (the node's first process writes and removes them)."""
        if self.ctx.is_local_main:
            for _, name in self.copies.steps()[keep:]:
                self.store.remove(name)

    def newer(self, chosen: str | None, name_for: Callable[[int], str]) -> tuple[int, str] | None:
        """(step, this node's copy of it) where every process holds a copy of one step newer than the
        durable checkpoint `chosen` (None: there is none); else None. Every rank calls it (a collective)."""
        mine = sorted(step for step, _ in self.copies.steps())  # a folder not there yet holds none
        everyone = self.ctx.all_gather_object(mine)
        common = set(everyone[0]).intersection(*everyone[1:])
        durable = step_of(split(chosen)[1]) if chosen is not None else None
        newest = max(common, default=-1)
        if newest <= (durable if durable is not None else -1):
            return None
        return newest, str(self.store.location(name_for(newest)))
