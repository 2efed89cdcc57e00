"""Measured peak of live tensor bytes on the CPU, from the profiler's allocation events.

CPU tensors have no allocator statistics (torch.cuda.max_memory_allocated has no CPU twin).
The profiler with `profile_memory=True` records every c10 allocation and free, temporaries
inside kernels included. Started before the run is built, the running sum of those events is
the bytes live at each moment; its maximum inside a marked window is the peak there.
"""

from __future__ import annotations

from typing import Any

import torch

_ALLOCATION = torch._C._profiler._EventType.Allocation


def window_peak(prof: Any, marker: str) -> tuple[int, int]:
    """(peak bytes live inside the `record_function(marker)` window, bytes live when it opened),
    counting every CPU allocation since the profiler started."""
    events: list[tuple[int, int]] = []
    window: tuple[int, int] | None = None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _ALLOCATION:
            if event.extra_fields.device.type == "cpu":
                events.append((event.start_time_ns, event.extra_fields.alloc_size))
        elif event.name == marker and window is None:
            window = (event.start_time_ns, event.end_time_ns)
        stack.extend(event.children)
    if window is None:
        raise RuntimeError(f"the profile has no {marker!r} window")
    events.sort()
    live = 0
    at_start: int | None = None
    peak = 0
    for when, delta in events:
        if at_start is None and when >= window[0]:
            at_start = peak = live
        live += delta
        if window[0] <= when <= window[1]:
            peak = max(peak, live)
    return peak, at_start if at_start is not None else live
