"""What `multicard bench` runs: cells of runner × strategy × world size × precision × variant.

A cell is one measurement in fresh processes. Cells that cannot run here (dp without CUDA,
more processes than devices, a framework that is not installed) are listed as skipped with
the reason, so the table says why a row is empty instead of failing.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, field
from typing import Any

from multicard.base.errors import UserError

RUNNERS = ("multicard", "plain", "lightning", "accelerate")
STRATEGIES = ("single", "dp", "ddp", "fsdp")
MULTI_PROCESS = ("ddp", "fsdp")  # strategies whose world size is a process count
# After the timed steps, DDP cells run this many more (fewer if fewer are timed) with a timing
# comm hook (its achieved rate).
COMM_STEPS = 5
FRAMEWORK_MODULES = {"lightning": "lightning", "accelerate": "accelerate"}


@dataclass(frozen=True)
class Variant:
    """A named set of config overrides for one strategy's cells, e.g. ZeRO-2 for fsdp."""

    name: str
    overrides: tuple[str, ...] = ()
    strategy: str = ""  # ddp or fsdp: the cells it adds to; "" for the default (every strategy)


DEFAULT_VARIANT = Variant("default")


def parse_variant(text: str, strategy: str) -> Variant:
    """'NAME:KEY=VALUE,KEY=VALUE' → a Variant of `strategy`'s cells (the keys are config keys)."""
    name, sep, rest = text.partition(":")
    overrides = tuple(item for item in rest.split(",") if item) if sep else ()
    if not name or not sep or not overrides or any("=" not in o for o in overrides):
        example = "bf16:ddp.comm_hook=bf16" if strategy == "ddp" else "zero2:fsdp.reshard_after_forward=false"
        raise UserError(f"--{strategy}-variant '{text}' is not NAME:KEY=VALUE[,KEY=VALUE], e.g. {example}")
    return Variant(name, overrides, strategy)


@dataclass(frozen=True)
class Cell:
    runner: str
    strategy: str
    world_size: int  # processes for ddp, GPUs for dp, 1 for single
    precision: str
    variant: Variant = DEFAULT_VARIANT

    @property
    def processes(self) -> int:
        return self.world_size if self.strategy in MULTI_PROCESS else 1

    @property
    def label(self) -> str:
        extra = "" if self.variant == DEFAULT_VARIANT else f"+{self.variant.name}"
        return f"{self.runner}/{self.strategy}×{self.world_size}/{self.precision}{extra}"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["variant"] = self.variant.name
        return d


@dataclass
class CellMatrix:
    cells: list[Cell] = field(default_factory=list)
    skipped: list[tuple[Cell, str]] = field(default_factory=list)


def _check_choice(values: list[str], allowed: tuple[str, ...], flag: str) -> None:
    bad = [v for v in values if v not in allowed]
    if bad:
        raise UserError(f"{flag} {bad[0]} is not one of {', '.join(allowed)}")


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def skip_reason(cell: Cell, gpus: int, cpu_cores: int) -> str | None:
    """Why this cell cannot run on this machine, or None."""
    module = FRAMEWORK_MODULES.get(cell.runner)
    if module is not None and not installed(module):
        return f"{module} is not installed (pip install 'multicard[bench]')"
    if cell.strategy == "single" and cell.world_size != 1:
        return "single runs one process on one device"
    if cell.strategy == "dp":
        if gpus == 0:
            return "DataParallel needs CUDA GPUs"
        if cell.world_size > gpus:
            return f"needs {cell.world_size} GPUs, {gpus} present"
        if cell.runner != "multicard" and cell.runner != "plain":
            return f"{cell.runner} has no DataParallel strategy"
    if cell.strategy == "fsdp" and cell.runner != "multicard":
        return f"{cell.runner} has no fsdp runner here"
    if cell.strategy in MULTI_PROCESS:
        have, what = (gpus, "GPU(s)") if gpus else (cpu_cores, "CPU cores")
        if cell.world_size > have:
            return f"needs {cell.world_size} processes, only {have} {what}"
    return None


def choose_cells(
    runners: list[str],
    strategies: list[str],
    world_sizes: list[int],
    precisions: list[str],
    variants: list[Variant],
    gpus: int,
    cpu_cores: int,
) -> CellMatrix:
    """Every combination that makes sense, in a stable order (runners vary fastest)."""
    _check_choice(runners, RUNNERS, "--runners")
    _check_choice(strategies, STRATEGIES, "--strategies")
    if any(w < 1 for w in world_sizes):
        raise UserError("--world-sizes must be positive integers, e.g. 1,2")
    matrix = CellMatrix()
    for precision in precisions:
        for strategy in strategies:
            sizes = [1] if strategy == "single" else world_sizes
            for world_size in sizes:
                for variant in [DEFAULT_VARIANT, *(v for v in variants if v.strategy == strategy)]:
                    for runner in runners:
                        cell = Cell(runner, strategy, world_size, precision, variant)
                        if variant != DEFAULT_VARIANT and runner != "multicard":
                            continue  # variants are multicard's options; other runners have no row
                        reason = skip_reason(cell, gpus, cpu_cores)
                        if reason is None:
                            matrix.cells.append(cell)
                        else:
                            matrix.skipped.append((cell, reason))
    return matrix
