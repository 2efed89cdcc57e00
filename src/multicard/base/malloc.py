"""Host memory allocator settings for training on the CPU (glibc's malloc).

Every CPU run keeps what it frees for its next step (keep_freed_memory): glibc gives the freed top
of its heap back to the system at once, so the gradients freed after each optimizer step were
faulted in again by the next backward (+7% per step of a resnet18 on 2 cores; a loop that frees
them just before backward, as many hand-written loops do, escapes it only because activations lie
above them then). It is what CUDA's caching allocator does on a GPU.

Sharded training may choose the opposite for large buffers. FSDP gathers and frees unit-sized
buffers many times per step; once glibc's mmap threshold has risen above them they come from the
heap and freed memory stays resident: an fsdp×2 rank of vit_b_16 peaked at 2.7 GB, above ddp's 2.5 GB
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
import os
import sys
from collections.abc import Mapping

from multicard.base.host_memory import cgroup_limit

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc's malloc.h)
LARGE = 128 * 1024  # bytes: glibc's initial threshold, now kept fixed
# Bytes: the highest glibc raises its threshold to on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), so
# even without the fix an allocation this large is a fresh mapping each time.
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
KEEP_ALL = (1 << 31) - 1  # bytes: the largest trim threshold mallopt takes; in effect, never give back


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
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, LARGE))


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Keep the memory tensors free for the next step: allocations below MMAP_THRESHOLD_MAX come
    from the heap from the start (glibc reaches that threshold only as a process runs) and the heap
    is never trimmed. Not where the user chose glibc's malloc settings or preloads another
    allocator, nor where glibc's malloc is not the one in use. True if set."""
    chosen = {"MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD"} & set(environ) or (
        "malloc" in environ.get("GLIBC_TUNABLES", "")
    )
    libc = _glibc()
    if chosen or libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and libc.mallopt(M_TRIM_THRESHOLD, KEEP_ALL))


def _glibc() -> ctypes.CDLL | None:
    """This process's C library if it is glibc (whose malloc these settings are for), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- present only in glibc
        return libc
    except (OSError, AttributeError):
        return None
