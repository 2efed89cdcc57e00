"""Host memory allocator settings for sharded training on CPU.

FSDP gathers and frees unit-sized buffers many times per step. glibc's malloc raises its mmap
threshold each time such a buffer is freed, so from then on those sizes come from the heap and
freed memory stays resident: an fsdp×2 rank of vit_b_16 peaked at 2.7 GB, above ddp's 2.5 GB
(docs/benchmarks.md). Fixing the threshold keeps large buffers mapped separately, returned to the
system as soon as they are freed: the same rank peaked at 1.5 GB.

The price is time: every large buffer is a fresh mapping whose pages fault in when written. On
vit_b_16 at 4 images per rank a step took 7.9 s with the threshold fixed against 6.2 s with
glibc's own (peak 3.0 GB), 7.5 s fixed at 16 MiB (2.2 GB), 6.5 s at 32 MiB (3.2 GB); trimming
the heap after every step saved neither. So it is a choice (fsdp.cpu_release_memory): by default
memory wins where it can end the job, under a memory limit (a cgroup's: Slurm, containers), and
speed wins elsewhere; larger micro-batches amortise the faults (docs/benchmarks.md). It would
slow ddp, which reallocates its gradients every step, by half: so it is fsdp's alone.
"""

from __future__ import annotations

import ctypes
import sys

from multicard.host_memory import cgroup_limit

M_MMAP_THRESHOLD = -3  # mallopt parameter (glibc's malloc.h)
LARGE = 128 * 1024  # bytes: glibc's initial threshold, now kept fixed
# Bytes: the highest glibc raises its threshold to on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), so
# even without the fix an allocation this large is a fresh mapping each time.
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024


def wants_release(setting: str, capped: bool | None = None) -> bool:
    """fsdp.cpu_release_memory resolved: true, false, or auto — true under a memory limit
    (`capped`; by default whether this process's cgroup has one)."""
    setting = setting.lower()
    if setting == "auto":
        return cgroup_limit() is not None if capped is None else capped
    return setting == "true"


def release_large_buffers() -> bool:
    """Ask glibc to map every allocation of LARGE bytes or more separately; False where glibc's
    malloc is not the one in use (other platforms and allocators keep their own behaviour)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- present only in glibc
        return bool(libc.mallopt(M_MMAP_THRESHOLD, LARGE))
    except (OSError, AttributeError):
        return False
