"""Measured peak of live tensor bytes on the CPU, from the profiler's allocation events.

CPU tensors have no allocator statistics (torch.cuda.max_memory_allocated has no CPU twin).
The profiler with `profile_memory=True` records every c10 allocation and free, temporaries
inside kernels included. Started before the run is built, the running sum of those events is
the bytes live at each moment; its maximum inside a marked window is the peak there.

The profiler sees a free only in a thread it follows. gloo's work objects hold the tensors of
a collective (and the copy its reduce-scatter makes of the input), and gloo's worker thread
sometimes drops a work object after the code that waited for it has dropped its own references:
then that free goes unrecorded, and the running sum keeps the block (an FSDP step all-gathers
and reduce-scatters every unit: up to several units too many, more or less from run to run).
So a block made in the window by a collective, or handed to one, whose free is never recorded
is taken as freed after its last use: the end of the last op that read or wrote it (with
`record_shapes`, the profiler lists each op's tensors; profile a step past the window, so that
a block kept for later steps, such as DDP's buckets, is seen in use after it), and for a
collective's own block the end of the code that called the collective (which has waited for it
by then). And an allocation at an address still counted live frees the block counted there
first (an address cannot be live twice). Blocks are told apart by address and time: the
profiler's own allocation ids go wrong at an address whose free it missed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch

_ALLOCATION = torch._C._profiler._EventType.Allocation
_TORCH_OP = torch._C._profiler._EventType.TorchOp
_COLLECTIVE = "c10d::"  # the profiler's names of torch.distributed's collective ops


@dataclass
class _Block:
    """One allocation the profiler recorded."""

    size: int
    address: int
    born: int
    freed: int | None = None  # when its free was recorded
    by_collective: bool = False  # made inside a collective op, or handed to one
    last_use: int = 0  # end of the last op that used it (a collective's own block: its caller's end)


@dataclass
class _Profile:
    """What window_peak reads from a profile: allocations and frees (time, bytes, address, the
    caller's end for a block a collective made itself), op uses (start, end, address, whether
    the op is a collective) and the marked window."""

    allocations: list[tuple[int, int, int, int]]
    uses: list[tuple[int, int, int, bool]]
    window: tuple[int, int]


def _collective_caller_end(event: Any) -> int:
    """The end of the code that called the collective op `event` happened in (0: none)."""
    op = event.parent
    while op is not None and not op.name.startswith(_COLLECTIVE):
        op = op.parent
    return 0 if op is None else (op.parent or op).end_time_ns


def _addresses(values: Any) -> list[int]:
    """Storage addresses of the tensors among an op's recorded inputs (lists flattened)."""
    found: list[int] = []
    for value in values:
        if isinstance(value, list):
            found += _addresses(value)
        elif hasattr(value, "storage_data_ptr"):
            found.append(value.storage_data_ptr)
    return found


def _read(prof: Any, marker: str) -> _Profile:
    allocations: list[tuple[int, int, int, int]] = []
    uses: list[tuple[int, int, int, bool]] = []
    window: tuple[int, int] | None = None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _ALLOCATION and event.extra_fields.device.type == "cpu":
            fields = event.extra_fields
            caller_end = _collective_caller_end(event) if fields.alloc_size > 0 else 0
            allocations.append((event.start_time_ns, fields.alloc_size, fields.ptr, caller_end))
        elif event.tag == _TORCH_OP:
            collective = event.name.startswith(_COLLECTIVE)
            uses += [(event.start_time_ns, event.end_time_ns, address, collective)
                     for address in _addresses(event.extra_fields.inputs)]  # fmt: skip
        if event.name == marker and window is None:
            window = (event.start_time_ns, event.end_time_ns)
        stack.extend(event.children)
    if window is None:
        raise RuntimeError(f"the profile has no {marker!r} window")
    return _Profile(sorted(allocations), uses, window)


def _blocks(profile: _Profile) -> list[_Block]:
    """Every recorded allocation with its recorded free (the one at its address before the next
    allocation there) and its uses (ops that ran while it was the newest block at their address)."""
    blocks: list[_Block] = []
    at_address: dict[int, list[_Block]] = {}  # address -> its blocks, oldest first
    for when, size, address, caller_end in profile.allocations:
        if size > 0:
            block = _Block(size, address, when, by_collective=caller_end > 0, last_use=caller_end)
            blocks.append(block)
            at_address.setdefault(address, []).append(block)
        elif (there := at_address.get(address)) and there[-1].freed is None:
            there[-1].freed = when
    births = {address: [b.born for b in there] for address, there in at_address.items()}
    for start, end, address, collective in profile.uses:
        index = bisect.bisect_right(births.get(address, []), start) - 1
        if index >= 0:
            there = at_address[address]
            there[index].last_use = max(there[index].last_use, end)
            there[index].by_collective |= collective
    return blocks


def _events(blocks: list[_Block], window: tuple[int, int]) -> list[tuple[int, int, int]]:
    """(time, bytes (negative: a free), block index) in time order, frees first at one moment."""
    events = []
    for index, block in enumerate(blocks):
        events.append((block.born, block.size, index))
        if block.freed is not None:
            events.append((block.freed, -block.size, index))
        elif block.by_collective and block.born >= window[0]:  # freed unseen, after its last use
            events.append((max(block.born, block.last_use), -block.size, index))
    return sorted(events)


def window_peak(prof: Any, marker: str) -> tuple[int, int]:
    """(peak bytes live inside the `record_function(marker)` window, bytes live when it opened),
    counting every CPU allocation since the profiler started."""
    profile = _read(prof, marker)
    blocks = _blocks(profile)
    window = profile.window
    live_blocks: set[int] = set()
    counted_at: dict[int, int] = {}  # address -> the block last counted there
    live = 0
    at_start: int | None = None
    peak = 0
    for when, delta, index in _events(blocks, window):
        if at_start is None and when >= window[0]:
            at_start = peak = live
        if delta > 0:
            earlier = counted_at.get(blocks[index].address)
            if earlier in live_blocks:  # that block was freed unseen
                live_blocks.discard(earlier)
                live -= blocks[earlier].size
            counted_at[blocks[index].address] = index
            live_blocks.add(index)
            live += delta
        elif index in live_blocks:
            live_blocks.discard(index)
            live += delta
        if window[0] <= when <= window[1]:
            peak = max(peak, live)
    return peak, at_start if at_start is not None else live
