"""The processes below this one. A user's code (a script, a dataset or model function) may start
processes of its own; none may outlive the multicard command that ran it.

Read from /proc and asked of the kernel with prctl: Linux only. Elsewhere nothing is found and
nothing is adopted.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36  # prctl option: orphans below this process come to it, not to init
PR_SET_PDEATHSIG = 1  # prctl option: a signal for this process when its parent dies


def prctl(option: int, value: int) -> None:
    """The kernel's per-process setting `option` (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def adopt_orphans() -> None:
    """A process below this one whose parent ends (a worker that died, a script's helper that
    started a process in the background) becomes this process's child instead of init's, so that
    end_descendants still finds it: for multicard's launcher, whose workers run the user's code."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process; None if it has gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def descendants(pid: int) -> list[int]:
    """The live processes below `pid` (zombies are over), parents before their children."""
    if not os.path.isdir("/proc"):
        return []
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None and stat[0] != "Z":
            children.setdefault(stat[1], []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        found += frontier
    return found


def _helper(pid: int) -> bool:
    """One of multiprocessing's own helper processes (its resource tracker, its fork server): they
    end by themselves once this process has ended (and the tracker ignores SIGTERM)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"multiprocessing.resource_tracker" in argv or b"multiprocessing.forkserver" in argv


def _name(pid: int) -> str:
    try:
        return f"{Path(f'/proc/{pid}/comm').read_text().strip()} (pid {pid})"
    except OSError:
        return f"pid {pid}"


def _running(pids: list[int]) -> list[int]:
    return [pid for pid in pids if (stat := _stat(pid)) is not None and stat[0] != "Z"]


def end_processes(pids: list[int], grace_s: float) -> None:
    """SIGTERM to each of `pids`; SIGKILL to those still running `grace_s` later."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        for pid in _running(pids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass  # ended meanwhile
        deadline = time.monotonic() + wait_s
        while _running(pids) and time.monotonic() < deadline:
            time.sleep(0.01)


def end_descendants(grace_s: float) -> list[str]:
    """End every process still running below this one; the names of those the user's code left
    (multicard's own, the loader processes of a data loader that was never closed, end as
    Python's exit would end them, unnamed)."""
    for child in multiprocessing.active_children():
        if child.daemon:  # what the interpreter's exit does to daemonic processes
            child.terminate()
    own = [child.pid for child in multiprocessing.active_children() if child.daemon and child.pid is not None]
    left = [pid for pid in descendants(os.getpid()) if not _helper(pid)]
    names = [_name(pid) for pid in left if pid not in own]
    end_processes(left, grace_s)
    return names
