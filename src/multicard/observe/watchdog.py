"""A stalled job is never silent: heartbeats in the job's store, and one line naming the suspects.

Every rank runs a thread that, each second, writes its heartbeat to the job's key-value store
(the rendezvous store: no new transport): a beat counter, a progress counter, its step, its
phase and where its main thread is. Every rank also reads all heartbeats, timing changes on its
own clock (hosts' clocks need not agree). A rank whose beat stops is silent (stopped, swapped
out, its node gone); when no rank's progress moves for `stall_s`, the lowest-ranked rank that
still beats claims the report, every rank writes the stacks of all its threads to
out_dir/stall/rank-K.txt (faulthandler reads them even while the main thread is blocked inside a
collective), and one line names who is where:

    stall at step 812 (125 s): rank 3 in data loading (data/loading/workers.py:88); ranks 0-2 wait in
    gradient all-reduce; stacks in runs/x/stall/

With on_stall=abort every rank then exits with ExitCode.STALLED instead of waiting for the
collective timeout.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multicard.base.errors import ExitCode
from multicard.engine import phases

BEAT_S = 1.0  # seconds between heartbeats
SILENT_S = 5.0  # a rank whose heartbeat has not changed for this long is silent
AUTO_MIN_S, AUTO_STEPS = 120.0, 20  # auto: the larger of 120 s and 20 median steps
PACKAGE = Path(__file__).resolve().parents[1]  # multicard: frames of its code name the stall

# How the report names what a rank is doing, by phase.
DOING = {
    phases.DATA: "in data loading",
    phases.FORWARD: "in forward",
    phases.BACKWARD: "in backward",
    phases.COMMUNICATION: "wait in gradient all-reduce",
    phases.OPTIMIZER: "in the optimizer step",
    phases.EVALUATION: "in evaluation",
    phases.CHECKPOINT: "writing a checkpoint",
    phases.REDUCING: "wait in the metrics (or stop) all-reduce",
    phases.IDLE: "between steps",
}
WAITING = {phases.COMMUNICATION, phases.REDUCING}  # phases that wait for the other ranks
COLLECTIVE_CODE = ("torch/distributed/", "torch/nn/parallel/distributed.py")  # e.g. DDP's buffer broadcast


@dataclass(frozen=True)
class Beat:
    rank: int
    beat: int
    progress: int
    step: int
    phase: str
    where: str
    waiting: bool  # the main thread is inside a torch.distributed call (a collective)
    host: str
    pid: int


def main_thread_location() -> tuple[str, bool]:
    """(file:line of the main thread's innermost frame in multicard, else its innermost frame;
    whether that innermost frame is inside torch.distributed or DDP: waiting in a collective)."""
    ident = threading.main_thread().ident  # None only for a thread not started: the main thread has
    frame = sys._current_frames().get(ident) if ident is not None else None  # noqa: SLF001 -- made for this
    innermost, waiting = None, False
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if innermost is None:
            innermost = f"{path.name}:{frame.f_lineno}"
            waiting = any(part in path.as_posix() for part in COLLECTIVE_CODE)
        if PACKAGE in path.parents and path.name != "watchdog.py":
            return f"{path.relative_to(PACKAGE)}:{frame.f_lineno}", waiting
        frame = frame.f_back
    return innermost or "?", waiting


def ranks_text(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0-2', 'ranks 0, 2, 5'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def describe(beats: dict[int, Beat], silent: list[int], stalled_s: float, folder: Path) -> str:
    """The report line: suspects first (silent ranks, then the busiest ranks the others wait for)."""
    alive = {r: b for r, b in beats.items() if r not in silent}
    step = min((b.step for b in beats.values()), default=0)
    parts = [f"{ranks_text([r])} is silent (no heartbeat for {SILENT_S:.0f}+ s: stopped or gone?)" for r in silent]
    waiting = [r for r, b in sorted(alive.items()) if b.phase in WAITING or b.waiting]
    busy = [r for r in sorted(alive) if r not in waiting]
    for r in busy:  # the ranks the waiting ones wait for, each with its place
        parts.append(f"rank {r} {DOING.get(alive[r].phase, alive[r].phase)} ({alive[r].where})")
    by_what: dict[str, list[int]] = {}
    for r in waiting:
        b = alive[r]
        what = DOING[b.phase] if b.phase in WAITING else f"wait in a collective during {b.phase} ({b.where})"
        by_what.setdefault(what, []).append(r)
    parts += [f"{ranks_text(rs)} {what}" for what, rs in by_what.items()]
    return f"stall at step {step} ({stalled_s:.0f} s): {'; '.join(parts)}; stacks in {folder}/"


@dataclass
class BeatCost:
    """What the heartbeats cost: seconds spent in them, as wall time (an upper bound on how long
    they can hold the interpreter from the training thread) and as this thread's CPU time."""

    beats: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    started: float = 0.0  # monotonic time the thread started

    def add(self, wall_s: float, cpu_s: float) -> None:
        self.beats, self.wall_s, self.cpu_s = self.beats + 1, self.wall_s + wall_s, self.cpu_s + cpu_s

    def summary(self) -> dict[str, float]:
        """Per beat (ms) and as a share of the time the thread has run."""
        elapsed = max(time.monotonic() - self.started, 1e-9) if self.started else 0.0
        return {
            "beats": self.beats,
            "wall_ms_per_beat": 1000 * self.wall_s / max(self.beats, 1),
            "cpu_ms_per_beat": 1000 * self.cpu_s / max(self.beats, 1),
            "wall_share": self.wall_s / elapsed if elapsed else 0.0,
        }


class Watchdog:
    """Heartbeats of this rank and stall detection over all ranks (a daemon thread)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        state: Callable[[], tuple[int, int, str]],
        folder: Path,
        stall_s: float | None,
        abort: bool,
        say: Callable[[str], None],
    ) -> None:
        """`state()` gives (progress count, step, phase) of this rank's main thread; `stall_s`
        None means auto (from step times)."""
        self.store, self.rank, self.world_size = store, rank, world_size
        self.state, self.folder, self.stall_s, self.abort, self.say = state, folder, stall_s, abort, say
        self._stop = threading.Event()
        self._beat = 0
        start = time.monotonic()
        # rank → (beat, progress, when the beat last changed, when the progress last changed), on
        # this rank's clock; a rank not heard from yet counts from now (it may never be heard).
        self._seen: dict[int, tuple[int, int, float, float]] = {r: (-1, -1, start, start) for r in range(world_size)}
        self._heard: set[int] = set()
        self._steps: list[tuple[int, float]] = []  # (step, time) of this rank's recent steps
        self._reported = 0.0  # when the current stall was reported (0: none yet)
        self.cost = BeatCost()
        self._thread = threading.Thread(target=self._run, name="multicard-watchdog", daemon=True)

    def start(self) -> Watchdog:
        # The first heartbeat now, before training: a rank stopped before the thread's first beat
        # would otherwise be unknown to the others (no pid to end it by when aborting).
        self._write_beat(time.monotonic())
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        self.cost.started = time.monotonic()
        while not self._stop.wait(BEAT_S):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                self._tick()
            except Exception:  # noqa: BLE001 -- the store may go before us at the end: stop quietly
                return
            self.cost.add(time.perf_counter() - wall, time.thread_time() - cpu)

    def _write_beat(self, now: float) -> None:
        progress, step, phase = self.state()
        self._beat += 1
        if not self._steps or self._steps[-1][0] != step:
            self._steps = [*self._steps[-49:], (step, now)]
        host, (where, waiting) = socket.gethostname(), main_thread_location()
        mine = Beat(self.rank, self._beat, progress, step, phase, where, waiting, host, os.getpid())
        self.store.set(f"health/{self.rank}", json.dumps(mine.__dict__))

    def _tick(self) -> None:
        now = time.monotonic()
        self._write_beat(now)
        beats = {b.rank: b for b in (Beat(**json.loads(v)) for v in self._read_heartbeats())}
        for r, b in beats.items():
            old = self._seen[r]
            self._seen[r] = (b.beat, b.progress, now if b.beat != old[0] else old[2],
                             now if b.progress != old[1] else old[3])  # fmt: skip
        self._check(beats, now)
        if self.store.check(["stall/report"]):
            self._dump_stacks(self.store.get("stall/report").decode())

    def _read_heartbeats(self) -> list[bytes]:
        """Every rank's heartbeat that exists (all in one round trip once each rank has written)."""
        if len(self._heard) == self.world_size:
            return self.store.multi_get([f"health/{r}" for r in range(self.world_size)])
        self._heard |= {r for r in range(self.world_size) if self.store.check([f"health/{r}"])}
        return [self.store.get(f"health/{r}") for r in sorted(self._heard)]

    def _threshold(self) -> float | None:
        if self.stall_s is not None:
            return self.stall_s or None  # 0: off
        if len(self._steps) < 3:
            return None  # auto: not before steps have been timed (start-up, compilation, cache filling)
        pairs = zip(self._steps, self._steps[1:], strict=False)
        per_step = statistics.median((b[1] - a[1]) / max(1, b[0] - a[0]) for a, b in pairs)
        return max(AUTO_MIN_S, AUTO_STEPS * per_step)

    def _check(self, beats: dict[int, Beat], now: float) -> None:
        threshold = self._threshold()
        if threshold is None:
            return
        stalled_s = now - max(seen[3] for seen in self._seen.values())
        if stalled_s < threshold:
            self._reported = 0.0
            return
        if self._reported:
            return  # this stall is reported already
        silent = sorted(r for r, seen in self._seen.items() if now - seen[2] >= SILENT_S)
        reporter = min(r for r in range(self.world_size) if r not in silent)
        if reporter != self.rank:
            return  # the lowest rank that still beats reports
        line = describe(beats, silent, stalled_s, self.folder)
        if self.store.compare_set("stall/report", "", line).decode() == line:
            self._reported = now
            self.say(f"multicard: {line}")
            if self.abort:
                self._kill_silent(beats, silent)
            self._dump_stacks(line)  # exits when aborting

    def _dump_stacks(self, line: str) -> None:
        """Every thread's stack of this rank to folder/rank-K.txt (once per report); abort if asked."""
        target = self.folder / f"rank-{self.rank}.txt"
        if getattr(self, "_dumped", None) != line:
            self._dumped = line
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(target, "w") as f:
                f.write(f"{line}\n\nrank {self.rank} (pid {os.getpid()}), stacks of all threads:\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        if self.abort:
            sys.stderr.flush()
            os._exit(ExitCode.STALLED)

    def _kill_silent(self, beats: dict[int, Beat], silent: list[int]) -> None:
        """Aborting: silent ranks on this host cannot end themselves (a stopped process does not
        run its signal handlers), so end them here rather than leave them behind."""
        for r in silent:
            b = beats.get(r)
            if b is not None and b.host == socket.gethostname():
                try:
                    os.kill(b.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
