"""The strategies a plan compares (candidates): each is the user's config with a few keys changed,
and carries the facts the planner asks of it."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HEADROOM = 0.10  # share of each device's memory left free (allocator fragmentation, spikes)


@dataclass(frozen=True)
class Candidate:
    key: str
    label: str
    kind: str  # Layout.kind: single, dp, ddp, zero1 or fsdp
    reshard_after_forward: bool = True  # fsdp: parameters gathered again for backward (ZeRO-3), or kept (ZeRO-2)
    replicate_nodes: bool = False  # fsdp: sharded within a node, replicated across nodes (HSDP)

    @property
    def one_process(self) -> bool:
        """Runs as one process (single, or dp over that process's GPUs)."""
        return self.kind in ("single", "dp")

    @property
    def splits_over_gpus(self) -> bool:
        """One process splits each micro-batch over its GPUs (DataParallel)."""
        return self.kind == "dp"

    def gpus_per_process(self, gpus: int) -> int:
        return gpus if self.splits_over_gpus else 1

    @property
    def overrides(self) -> tuple[str, ...]:
        """The config keys that select it (complete: they override the user's choice)."""
        if self.one_process:
            return (f"strategy={self.kind}",)
        if self.kind in ("ddp", "zero1"):
            return ("strategy=ddp", f"ddp.shard_optimizer={str(self.kind == 'zero1').lower()}")
        return ("strategy=fsdp", f"fsdp.reshard_after_forward={str(self.reshard_after_forward).lower()}",
                f"fsdp.replicate={'nodes' if self.replicate_nodes else 'none'}")  # fmt: skip


CANDIDATES = (
    Candidate("single", "single device", "single"),
    Candidate("dp", "DataParallel", "dp"),
    Candidate("ddp", "DDP", "ddp"),
    Candidate("zero1", "DDP + ZeRO-1", "zero1"),
    Candidate("zero2", "FSDP ZeRO-2", "fsdp", reshard_after_forward=False),
    Candidate("zero3", "FSDP ZeRO-3", "fsdp"),
    Candidate("hsdp", "HSDP (ZeRO-3 in a node)", "fsdp", replicate_nodes=True),
)
