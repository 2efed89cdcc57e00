"""This machine's memory as one process sees it: what is free, and the limit of its memory cgroup.

A limit is what Slurm (with cgroup memory constraints), containers and systemd put around a job:
the kernel kills the process when it goes over, whatever the machine has free.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_V1 = Path("/sys/fs/cgroup/memory")  # v1: the memory controller's own hierarchy
CGROUP_V2 = Path("/sys/fs/cgroup")  # v2: one unified hierarchy


def _own_groups() -> list[tuple[Path, Path, str]]:
    """(hierarchy root, this process's group, limit file name) for each memory hierarchy it is in."""
    groups: list[tuple[Path, Path, str]] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return groups
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            root, limit_file = CGROUP_V1, "memory.limit_in_bytes"
        elif hierarchy == "0" and controllers == "":
            root, limit_file = CGROUP_V2, "memory.max"
        else:
            continue
        where = root / path.lstrip("/")
        # Inside a container the group's path may be the host's while the mount is the group itself.
        groups.append((root, where if where.is_dir() else root, limit_file))
    return groups


def own_cgroup_v1() -> Path | None:
    """This process's cgroup v1 memory group directory, or None without that hierarchy."""
    for root, group, _ in _own_groups():
        if root == CGROUP_V1 and group.is_dir():
            return group
    return None


def cgroup_limit() -> int | None:
    """Bytes: the tightest memory limit on this process's cgroup and its ancestors; None if none."""
    limits = []
    for root, group, limit_file in _own_groups():
        for where in (group, *group.parents):
            try:
                text = (where / limit_file).read_text().strip()
            except OSError:
                text = ""
            if text.isdigit():
                limits.append(int(text))
            if where == root:
                break
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tightest = min(limits, default=None)
    return tightest if tightest is not None and tightest < physical else None  # v1's "unlimited" is huge


def available_memory() -> int:
    """Bytes this process can take: MemAvailable, or its cgroup's limit if lower."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_limit()
    return min(available, limit) if limit is not None else available
