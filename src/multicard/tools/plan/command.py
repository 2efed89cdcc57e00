"""`multicard plan`'s body, run by the CLI (its arguments: plan/arguments.py).

    multicard plan [--config F] [KEY=VALUE ...] (--gpu NAME | --memory-gb X) [--gpus N] [--nodes M]
                   [--interconnect NAME] [--json] [--measure] [--calibrate] [--out DIR]
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from multicard.base.config import load_config
from multicard.base.errors import ExitCode
from multicard.tools.plan.arguments import PlanOptions
from multicard.tools.plan.calibrate import calibrate
from multicard.tools.plan.calibration import Calibration, calibration_path
from multicard.tools.plan.measure import measure_here
from multicard.tools.plan.outputs import as_dict, plot, print_plan, write_json
from multicard.tools.plan.planner import make_plan
from multicard.tools.plan.target import make_target


def run_plan(o: PlanOptions) -> int:
    console = Console(stderr=o.json)
    if o.calibrate:
        calibrate_here(console)
        if not o.plans:
            return ExitCode.OK
    cfg = load_config(o.config, o.overrides)
    target = make_target(o.gpu, o.memory_gb, o.gpus, o.nodes, o.interconnect, Calibration.load(calibration_path()))
    plan = make_plan(cfg, o.config, o.overrides, target, o.headroom)
    measured = None
    if o.measure:
        measured = measure_here(cfg, o.config, o.overrides, gpus=o.gpus, memory_gb=o.memory_gb, steps=o.steps,
                                strategies=o.strategies, headroom=o.headroom, console=console)  # fmt: skip
    data = as_dict(plan, measured)
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(data, out / "plan.json")
    plot(plan, out / "plan.png")
    if o.json:
        print(json.dumps(data, indent=1))
    else:
        print_plan(plan, console)
        console.print(f"written: {out / 'plan.json'}, {out / 'plan.png'}", highlight=False)
    return ExitCode.OK


def calibrate_here(console: Console) -> None:
    """`--calibrate`: measure this machine and store its calibration record."""
    path = calibration_path()
    cal = calibrate(say=lambda line: console.print(line, highlight=False))
    cal.save(path)
    rates = ", ".join(
        f"{t} thread(s): {r['flops'] / 1e9:.0f} GFLOP/s (matmul {r['matmul_flops'] / 1e9:.0f}), "
        f"{r['bandwidth'] / 1e9:.1f} GB/s, "
        f"{r['fresh_bandwidth'] / 1e9:.1f} GB/s fresh"
        for t, r in sorted(cal.rates.items())
    )
    console.print(
        f"calibration written to {path}: {rates}; all-reduce {cal.allreduce_bus_bandwidth / 1e9:.2f} GB/s; "
        f"{cal.runtime_bytes / 2**20:.0f} MiB per process besides tensors",
        highlight=False,
    )
