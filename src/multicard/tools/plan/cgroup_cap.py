"""Run a command under a memory cap (a cgroup v1 memory controller), to check a predicted
largest batch for real: it must train under the cap, and a larger one must be killed.

The cap's cgroup is made below this process's own memory cgroup (so it nests inside whatever
limits this process already has) and removed on exit, whatever happened: any process still in
it is killed first. Needs root and a cgroup v1 memory hierarchy at /sys/fs/cgroup/memory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from multicard.base.host_memory import own_cgroup_v1

PREFIX = "multicard-cap-"


def available() -> str:
    """'' if memory caps work here, else why not."""
    if os.geteuid() != 0:
        return "needs root (to make cgroups)"
    parent = own_cgroup_v1()
    if parent is None:
        return "no cgroup v1 memory hierarchy at /sys/fs/cgroup/memory"
    if not os.access(parent, os.W_OK):
        return f"cannot make cgroups under {parent}"
    return ""


class MemoryCap:
    """`with MemoryCap(limit) as cap: code = cap.run(argv)`; the cgroup is gone after the block."""

    def __init__(self, limit_bytes: int | None) -> None:
        parent = own_cgroup_v1()
        if parent is None:
            raise RuntimeError(available())
        self.path = parent / f"{PREFIX}{uuid.uuid4().hex[:10]}"
        self.limit = limit_bytes

    def __enter__(self) -> MemoryCap:
        self.path.mkdir()
        if self.limit is not None:
            (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
        return self

    def run(self, argv: list[str], timeout: float, **popen: Any) -> subprocess.CompletedProcess:
        """Run argv inside the cgroup (it joins before exec, so nothing runs outside the cap)."""
        procs = str(self.path / "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return subprocess.run(argv, preexec_fn=join, timeout=timeout, capture_output=True, text=True, **popen)

    @property
    def max_usage(self) -> int:
        """Peak bytes charged to the cgroup (resident memory and page cache of its processes)."""
        return int((self.path / "memory.max_usage_in_bytes").read_text().split()[0])

    @property
    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def __exit__(self, *exc: object) -> None:
        remove(self.path)


def remove(path: Path, timeout: float = 10.0) -> None:
    """Kill what is left in the cgroup (only processes this one started) and remove it."""
    if not path.exists():
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            path.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # the killed processes leave the cgroup as the kernel reaps them


def remove_stale() -> None:
    """Empty caps left by a run that was itself killed before it could remove them."""
    parent = own_cgroup_v1()
    for child in parent.glob(f"{PREFIX}*") if parent is not None else []:
        if not (child / "cgroup.procs").read_text().split():
            child.rmdir()
