"""The strategies a plan compares: each is the user's config with a few keys changed."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HEADROOM = 0.10  # share of each device's memory left free (allocator fragmentation, spikes)


@dataclass(frozen=True)
class Candidate:
    key: str
    label: str
    kind: str  # Layout.kind
    overrides: tuple[str, ...]  # config keys that select it (complete: they override the user's choice)


CANDIDATES = (
    Candidate("single", "single device", "single", ("strategy=single",)),
    Candidate("dp", "DataParallel", "dp", ("strategy=dp",)),
    Candidate("ddp", "DDP", "ddp", ("strategy=ddp", "ddp.shard_optimizer=false")),
    Candidate("zero1", "DDP + ZeRO-1", "zero1", ("strategy=ddp", "ddp.shard_optimizer=true")),
    Candidate("zero2", "FSDP ZeRO-2", "fsdp",
              ("strategy=fsdp", "fsdp.reshard_after_forward=false", "fsdp.replicate=none")),
    Candidate("zero3", "FSDP ZeRO-3", "fsdp",
              ("strategy=fsdp", "fsdp.reshard_after_forward=true", "fsdp.replicate=none")),
    Candidate("hsdp", "HSDP (ZeRO-3 in a node)", "fsdp",
              ("strategy=fsdp", "fsdp.reshard_after_forward=true", "fsdp.replicate=nodes")),
)  # fmt: skip
