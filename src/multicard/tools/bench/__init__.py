"""`multicard bench`: the same workload under each runner, strategy, world size and precision.

Default workload: resnet18 on 32×32 images already on the device (no decoding, no
augmentation), global batch 64, so the numbers isolate compute and communication; KEY=VALUE
overrides adjust it. With --config the file is the workload (e.g. configs/seed_cifar10.yaml
for the real input pipeline); the plain yardstick always feeds on-device data.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from multicard.base.config import load_config
from multicard.base.errors import UserError
from multicard.data import read_splits
from multicard.runtime.process_group import cpu_cores, cuda_count
from multicard.strategy import resolve
from multicard.tools.bench.cells import COMM_STEPS, MULTI_PROCESS, Variant, choose_cells
from multicard.tools.bench.outputs import plot, print_table, write_json
from multicard.tools.bench.runner import Timing, cell_config, make_rows, run_matrix

WORKLOAD = {
    "model.name": "resnet18",
    "data.name": "synthetic",
    "data.image_size": 32,
    "data.augment": False,
    "data.loader": "auto",  # the device loader for small images
    "data.val_size": 64,
    "train.global_batch_size": 64,
    "train.epochs": 1,
}


@dataclass
class BenchOptions:
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    runners: list[str] = field(default_factory=lambda: ["multicard", "plain"])
    strategies: list[str] = field(default_factory=lambda: ["single", "dp", "ddp"])
    world_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    precisions: list[str] = field(default_factory=lambda: ["fp32"])
    variants: list[Variant] = field(default_factory=list)
    warmup: int = 5
    steps: int = 30
    repeats: int = 1
    out: str = "runs/bench"
    logging: bool = False  # multicard's cells with the run's logging callbacks (bench --logging)


def environment() -> dict[str, Any]:
    gpus = cuda_count()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": cpu_cores(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def bench(options: BenchOptions, console: Console | None = None) -> list[dict[str, Any]]:
    """Choose, run and report the matrix; returns bench.json's rows."""
    console = console or Console(highlight=False)
    if not console.is_terminal:
        console.width = max(console.width, 160)  # a wide table in logs, not a column of ellipses
    if options.steps < 1 or options.warmup < 0 or options.repeats < 1:
        raise UserError("--steps and --repeats must be >= 1 and --warmup >= 0")
    out = Path(options.out)
    # A config file is a workload of its own (e.g. the real input pipeline); else the default one.
    workload = {} if options.config else dict(WORKLOAD)
    base = load_config(options.config, options.overrides, defaults=workload)
    needed = base.train.global_batch_size * (options.warmup + options.steps + COMM_STEPS + 1)
    if base.data.name == "synthetic":  # generate the images the timed steps read, no more
        base = load_config(options.config, [*options.overrides, f"data.train_size={needed}"], defaults=workload)
    if base.data.name != "synthetic":  # every cell reads it: a bad data.root is one line now, not a failed row per cell
        read_splits(base.data, base.seed)
    gpus, cores = cuda_count(), cpu_cores()
    matrix = choose_cells(
        options.runners, options.strategies, options.world_sizes, options.precisions, options.variants, gpus, cores
    )
    configs = {cell: cell_config(base, cell, gpus, out / "work" / f"cell-{i}") for i, cell in enumerate(matrix.cells)}
    for cell in list(matrix.cells):  # what `multicard train` would refuse here is a skipped cell, with its reason
        try:
            resolve(configs[cell], cell.processes, cell.processes, launched=cell.strategy in MULTI_PROCESS)
        except UserError as exc:
            matrix.cells.remove(cell)
            matrix.skipped.append((cell, str(exc)))
    timing = Timing(options.warmup, options.steps, options.repeats, options.logging)
    console.print(
        f"multicard bench: {len(matrix.cells)} cell(s) × {options.repeats} repeat(s), {len(matrix.skipped)} skipped; "
        f"model={base.model.name} data={base.data.name} global_batch={base.train.global_batch_size} "
        f"warmup={options.warmup} steps={options.steps}" + (" logging=on" if options.logging else "")
    )

    def progress(cell: Any, repeat: int, result: dict[str, Any]) -> None:
        what = f"{result['step_ms']['median']:.1f} ms/step" if "step_ms" in result else result.get("failed")
        console.print(f"  [{repeat + 1}/{options.repeats}] {cell.label}: {what}")

    results = run_matrix(matrix.cells, configs, timing, out / "work", progress)
    rows = make_rows(results, matrix.skipped, base.train.global_batch_size, gpus)
    out.mkdir(parents=True, exist_ok=True)
    write_json(rows, out / "bench.json")
    (out / "environment.json").write_text(json.dumps({**environment(), "options": _describe(options)}, indent=1))
    plot(rows, out / "bench.png")
    print_table(rows, console)
    console.print(f"wrote {out / 'bench.json'}, {out / 'bench.png'}")
    return rows


def _describe(options: BenchOptions) -> dict[str, Any]:
    d = dict(options.__dict__)
    d["variants"] = [f"{v.strategy}:{v.name}:{','.join(v.overrides)}" for v in options.variants]
    return d
