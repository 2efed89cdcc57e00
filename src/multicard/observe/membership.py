"""Who trains: one line and one metrics.jsonl record each time the job's nodes change.

An elastic job (torchrun's agent, `--nnodes MIN:MAX`) re-forms when a node is lost or joins: every
worker starts again at the new world size and resumes from the newest checkpoint. The new start
compares its nodes with the last `membership` record in metrics.jsonl (the nodes that trained
before), says who left and who joined, the new world size, the step it resumed from and the steps
it trains again: the steps the previous start had completed past that checkpoint. That count comes
from a small file on each node's local disk, in the folder of the agent that starts its workers
(environment.agent_folder): its workers write their last completed step there, and the next start
on that node reads it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from multicard.engine.loop import Callback, Loop, StepEnd
from multicard.observe.telemetry import Reporter
from multicard.runtime.environment import ProcessEnv, parent_agent_folder, remove_stale_agent_folders
from multicard.runtime.process_group import ProcessContext, node_name

PROGRESS = "progress"  # in the agent's folder: the last step this node's workers completed
STEP_WIDTH = 20  # the step is written in place, padded to this width: one write per step


def last_membership(metrics: Path) -> dict[str, Any] | None:
    """The newest membership record of a run's metrics.jsonl, or None."""
    found = None
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        if '"membership"' in line:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # cut short by a crash
            found = record if record.get("kind") == "membership" else found
    return found


def change_line(record: dict[str, Any]) -> str | None:
    """What a start says of its membership record: who left and joined, the world size, where it
    resumed and the steps redone; None for a job's first start."""
    moves = [f"node{'s' if len(names) > 1 else ''} {', '.join(names)} {verb}"
             for names, verb in ((record["left"], "left"), (record["joined"], "joined")) if names]  # fmt: skip
    if not moves and record["restart"] == 0 and record["redone"] is None:
        return None  # a job's first start, or a rerun on the same nodes
    redone = "" if record["redone"] is None else f", {record['redone']} step(s) redone"
    where = f"resumed from step {record['step']}{redone}"
    if not moves:
        return f"multicard: workers restarted on the same node(s), world size {record['world_size']}; {where}"
    size = f"world size {record['previous_world_size']} → {record['world_size']}"
    return f"multicard: nodes changed: {'; '.join(moves)}; {size}; {where}"


class Membership(Callback):
    """Says and records each start's nodes; keeps this node's progress for the next start."""

    def __init__(self, ctx: ProcessContext, env: ProcessEnv, reporter: Reporter, metrics: Path) -> None:
        self.ctx, self.env, self.reporter, self.metrics = ctx, env, reporter, metrics
        self.folder = parent_agent_folder(env) if ctx.is_local_main else None
        self._fd: int | None = None
        self._record: dict[str, Any] | None = None  # written with the first step (Reporter.run_files)

    def on_fit_start(self, loop: Loop) -> None:
        reached = self._read_progress()
        everyone = self.ctx.all_gather_object((node_name(self.env), reached, self.env.restart))
        if self.ctx.is_main:
            nodes = list(dict.fromkeys(name for name, _, _ in everyone))
            known = [step for _, step, _ in everyone if step is not None]
            self._record = self._compose(loop.position.global_step, nodes, max(known, default=None),
                                         max(restart for _, _, restart in everyone))  # fmt: skip
            line = change_line(self._record)
            if line is not None:
                self.reporter.print(line)
        if self.folder is not None:
            remove_stale_agent_folders()  # under torchrun no launcher of multicard's does it
            self.folder.mkdir(mode=0o700, exist_ok=True)
            self._fd = os.open(self.folder / PROGRESS, os.O_RDWR | os.O_CREAT, 0o600)

    def _compose(self, step: int, nodes: list[str], reached: int | None, restart: int) -> dict[str, Any]:
        previous = last_membership(self.metrics)
        before = previous["nodes"] if previous is not None else nodes
        return {
            "step": step, "world_size": self.ctx.world_size, "nodes": nodes,
            "left": [n for n in before if n not in nodes], "joined": [n for n in nodes if n not in before],
            "previous_world_size": previous["world_size"] if previous is not None else None,
            "redone": max(0, reached - step) if reached is not None else None, "restart": restart,
            "time": round(time.time(), 3),
        }  # fmt: skip

    def _read_progress(self) -> int | None:
        """The last step this node's previous workers completed (None: none trained here before)."""
        try:
            text = (self.folder / PROGRESS).read_text() if self.folder is not None else ""
        except OSError:
            return None
        return int(text) if text.strip().isdigit() else None

    def on_step_end(self, loop: Loop, step: StepEnd) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, f"{step.global_step:<{STEP_WIDTH}}".encode(), 0)
        if self._record is not None:
            self.reporter.record("membership", **self._record)
            self._record = None

    def on_fit_end(self, loop: Loop) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if loop.finished and self.folder is not None:  # done: nothing for a next start (or torchrun) to keep
                shutil.rmtree(self.folder, ignore_errors=True)
