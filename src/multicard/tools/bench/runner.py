"""Run the planned cells, each in fresh processes, and turn their timings into rows.

Repeats alternate the cells (A B C, C B A, A B C ...) so slow drifts of the machine hit every
runner alike; ratios (vs the plain loop, efficiency vs single) are taken within a repeat, then their
median and spread are reported.
"""

from __future__ import annotations

import signal
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multicard.base.config import Config, to_dict, with_overrides
from multicard.base.errors import STOPPED_BY_SIGNAL, Stopped
from multicard.runtime.launch import run_spec
from multicard.tools.bench.cells import DEFAULT_VARIANT, Cell


class BenchStopped(Stopped):
    def __str__(self) -> str:
        return f"bench stopped by {signal.Signals(self.signum).name}"


@dataclass(frozen=True)
class Timing:
    """How every cell is run: untimed and timed steps, repeats, and whether multicard's cells
    attach the run's logging (metrics.jsonl, TensorBoard, trackers) as `multicard train` does."""

    warmup: int
    steps: int
    repeats: int
    logging: bool = False


def cell_config(base: Config, cell: Cell, gpus: int, out_dir: Path) -> Config:
    """The base config with this cell's strategy, devices, precision and variant applied."""
    if gpus == 0:
        devices = "cpu"
    else:
        devices = "[" + ",".join(str(i) for i in range(cell.world_size if cell.strategy != "single" else 1)) + "]"
    overrides = [
        f"strategy={cell.strategy}",
        f"devices={devices}",
        f"precision={cell.precision}",
        f"out_dir={out_dir}",
        "train.resume=never",
        *cell.variant.overrides,
    ]
    return with_overrides(base, overrides)


def run_cell(cell: Cell, cfg: Config, timing: Timing, workdir: Path) -> dict[str, Any]:
    """Launch the cell's processes through torchrun's API; its rank 0's result, or the failure."""
    spec = {
        "cell": cell.as_dict(), "config": to_dict(cfg), "warmup": timing.warmup, "steps": timing.steps,
        "logging": timing.logging,
    }  # fmt: skip
    code, result = run_spec("multicard.tools.bench.worker", spec, cell.processes, workdir)
    if code in STOPPED_BY_SIGNAL:  # a signal stopped the cell: stop the whole matrix, not just this cell
        raise BenchStopped(code - 128, step=0)
    return result if result is not None else {"failed": f"worker exited with code {code}"}


def run_matrix(
    cells: list[Cell],
    configs: dict[Cell, Config],
    timing: Timing,
    workdir: Path,
    on_result: Callable[[Cell, int, dict[str, Any]], None] = lambda cell, repeat, result: None,
) -> dict[Cell, list[dict[str, Any]]]:
    """Every cell once per repeat, the order reversed every other repeat (A B, B A, A B …): a
    machine that slows or speeds up over minutes favours no cell, and cells compared with each
    other (multicard and the plain loop) run next to each other."""
    results: dict[Cell, list[dict[str, Any]]] = {cell: [] for cell in cells}
    for repeat in range(timing.repeats):
        order = list(enumerate(cells))
        for i, cell in order if repeat % 2 == 0 else reversed(order):
            result = run_cell(cell, configs[cell], timing, workdir / f"r{repeat}-c{i}")
            results[cell].append(result)
            on_result(cell, repeat, result)
    return results


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _ratios(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[float]:
    """Per-repeat ratio of step-time medians a / b, over repeats where both ran."""
    both = [(x, y) for x, y in zip(a, b, strict=True) if "step_ms" in x and "step_ms" in y]
    return [x["step_ms"]["median"] / y["step_ms"]["median"] for x, y in both]


def _costliest(per_rank: list[dict[str, float] | None] | None) -> dict[str, float] | None:
    """The heartbeat cost of the rank whose beats took the largest share of its time."""
    beats = [b for b in per_rank or [] if b and b["beats"]]
    return max(beats, key=lambda b: b["wall_share"]) if beats else None


def _single_of(cell: Cell) -> Cell:
    return Cell(cell.runner, "single", 1, cell.precision, DEFAULT_VARIANT)


def make_rows(
    results: dict[Cell, list[dict[str, Any]]], skipped: list[tuple[Cell, str]], global_batch: int, gpus: int
) -> list[dict[str, Any]]:
    """One row per cell: medians over repeats, ratios within repeats, skipped cells with reasons."""
    rows = []
    for cell, runs in results.items():
        row: dict[str, Any] = cell.as_dict()
        ok = [r for r in runs if "step_ms" in r]
        if not ok:
            row.update(status="failed", reason=runs[0].get("failed", "no result") if runs else "not run")
            rows.append(row)
            continue
        medians = [r["step_ms"]["median"] for r in ok]
        step_ms = statistics.median(medians)
        middle = ok[medians.index(sorted(medians)[len(medians) // 2])]  # the median repeat's details
        peaks = [mb for r in ok for mb in r.get("peak_mem_mb_per_device", [])]
        row.update(
            status="ok",
            img_per_s=global_batch / step_ms * 1000,
            step_ms_median=step_ms,
            step_ms_p10=middle["step_ms"]["p10"],
            step_ms_p90=middle["step_ms"]["p90"],
            step_ms_repeats=medians,
            peak_mem_mb=max(peaks) if peaks else None,
            peak_mem_mb_per_device=middle.get("peak_mem_mb_per_device"),
            held_mib_per_rank=middle.get("held_mib_per_rank"),
            heartbeat=_costliest(middle.get("heartbeat_per_rank")),
            breakdown=middle.get("breakdown"),
            allreduce=middle.get("allreduce"),
            threads=middle.get("threads"),
        )
        single = _single_of(cell)
        if single in results:
            # Same hardware: on CPU a single process uses every core; on GPUs it uses one of N.
            devices = cell.world_size if gpus else 1
            ratios = [1 / (r * devices) for r in _ratios(runs, results[single])]
            row["efficiency"] = _spread(ratios)
        plain = Cell("plain", cell.strategy, cell.world_size, cell.precision, DEFAULT_VARIANT)
        if cell.runner != "plain" and plain in results:
            row["vs_plain"] = _spread(_ratios(runs, results[plain]))
        rows.append(row)
    for cell, reason in skipped:
        rows.append({**cell.as_dict(), "status": "skipped", "reason": reason})
    return rows
