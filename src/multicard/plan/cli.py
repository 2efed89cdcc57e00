"""`multicard plan`: the command body (its arguments: plan/arguments.py).

    multicard plan [--config F] [KEY=VALUE ...] (--gpu NAME | --memory-gb X) [--gpus N] [--nodes M]
                   [--interconnect NAME] [--json] [--measure] [--calibrate] [--out DIR]

`python -m multicard.plan ...` runs the same command on its own.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from multicard.config import Config, load_config, with_overrides
from multicard.errors import ExitCode, MulticardError, UserError
from multicard.plan.arguments import SUMMARY, add_plan_parser, check_args
from multicard.plan.calibrate import Calibration, calibrate, calibration_path
from multicard.plan.hardware import gpu_for_device
from multicard.plan.measure import MEMORY_STEPS, run_steps
from multicard.plan.planner import Plan, make_plan
from multicard.plan.report import as_dict, plot, print_plan, write_json
from multicard.plan.target import Target, make_target
from multicard.preflight import check_output_folder
from multicard.process_group import cpu_cores, cuda_count, detect_env


def run_plan(args: argparse.Namespace) -> int:
    check_args(args)
    if detect_env().launched:
        raise UserError("multicard plan starts its own processes; run it without torchrun or srun")
    if args.gpu is not None or args.memory_gb is not None:  # a plan is written, not only a calibration
        check_output_folder(args.out, "--out")
    console = Console(stderr=args.json)
    path = calibration_path()
    if args.calibrate:
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
        if args.gpu is None and args.memory_gb is None:
            return ExitCode.OK
    cfg = load_config(args.config, args.overrides)
    target = make_target(args.gpu, args.memory_gb, args.gpus, args.nodes, args.interconnect, Calibration.load(path))
    plan = make_plan(cfg, args.config, args.overrides, target, args.headroom)
    measured = measure_here(cfg, args, console) if args.measure else None
    data = as_dict(plan, measured)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(data, out / "plan.json")
    plot(plan, out / "plan.png")
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print_plan(plan, console)
        console.print(f"written: {out / 'plan.json'}, {out / 'plan.png'}", highlight=False)
    return ExitCode.OK


# ------------------------------------------------------------------ --measure


def local_target(args: argparse.Namespace) -> Target:
    """This machine as a plan target: its GPUs if it has CUDA, else its CPU."""
    cal = Calibration.load(calibration_path())
    gpus = cuda_count()
    if gpus:
        import torch

        name = torch.cuda.get_device_name(0)
        entry = gpu_for_device(name)
        if entry is None:
            raise UserError(f"--measure: this machine's GPU ({name}) is not in multicard plan's table")
        return make_target(entry.name, None, min(args.gpus, gpus), 1, None, None)
    processes = max(1, min(args.gpus, cpu_cores()))
    if args.memory_gb is not None:
        return make_target(None, args.memory_gb, processes, 1, None, cal)
    return make_target("cpu", None, processes, 1, None, cal)


def measurement_config(cfg: Config, steps: int) -> Config:
    """The config as measured: few samples (enough for the steps), a throwaway out_dir."""
    total = MEMORY_STEPS + 1 + steps
    changes = [f"out_dir={tempfile.mkdtemp(prefix='multicard-plan-')}", "train.resume=never"]
    if cfg.data.name == "synthetic":
        changes += [f"data.train_size={cfg.train.global_batch_size * total}",
                    f"data.val_size={min(cfg.data.val_size, 64)}"]  # fmt: skip
    return with_overrides(cfg, changes)


def measure_here(cfg: Config, args: argparse.Namespace, console: Console) -> dict[str, dict[str, Any]]:
    """K real steps of every strategy that fits on this machine, beside the plan's prediction for
    it (the plan for this machine and the measured config)."""
    target = local_target(args)
    mcfg = measurement_config(cfg, args.steps)
    try:
        return _measure(mcfg, args, target, console)
    finally:
        shutil.rmtree(mcfg.out_dir, ignore_errors=True)


def _measure(mcfg: Config, args: argparse.Namespace, target: Target, console: Console) -> dict[str, dict[str, Any]]:
    plan = make_plan(mcfg, args.config, args.overrides, target, args.headroom)
    results: dict[str, dict[str, Any]] = {}
    chosen = set(args.strategies.split(",")) if args.strategies else None
    for row in plan.rows:
        if chosen is not None and row.candidate.key not in chosen:
            continue
        if not row.fits or row.fit_memory is None or row.time is None:
            results[row.candidate.key] = {"ok": False, "reason": row.reason or row.status}
            continue
        run_cfg = with_overrides(mcfg, [*row.candidate.overrides, f"train.grad_accum={row.accum}",
                                        *([] if target.cuda else ["devices=cpu"])])  # fmt: skip
        console.print(f"measure: {row.candidate.label}, {row.processes} process(es), micro-batch "
                      f"{row.fit_micro_batch} × {row.accum} accum", highlight=False)  # fmt: skip
        measured = run_steps(run_cfg, row.processes, args.steps)
        results[row.candidate.key] = {
            **measured.as_dict(),
            "micro_batch": row.fit_micro_batch,
            "grad_accum": row.accum,
            "predicted_tensor_bytes": row.fit_memory.tensors,
            "predicted_step_s": row.time.total_s,
        }
    console.print(measured_table(plan, results))
    return results


def measured_table(plan: Plan, results: dict[str, dict[str, Any]]) -> Table:
    t = Table(title=f"measured on {plan.target.label} vs predicted (tensor memory per process, step time)")
    for name in ("strategy", "micro × accum", "predicted MiB", "measured MiB", "ratio", "predicted ms",
                 "measured ms", "ratio"):  # fmt: skip
        t.add_column(name, justify="left" if name == "strategy" else "right")
    for row in plan.rows:
        r = results.get(row.candidate.key, {})
        if not r.get("ok"):
            t.add_row(row.candidate.label, f"[dim]{r.get('reason', '')}[/dim]")
            continue
        pm, mm = r["predicted_tensor_bytes"], r["peak_bytes"]
        pt, mt = r["predicted_step_s"], r["step_s"]
        t.add_row(
            row.candidate.label,
            f"{r['micro_batch']} × {r['grad_accum']}",
            *(f"{pm / 2**20:,.1f}", f"{mm / 2**20:,.1f}", f"{pm / mm:.3f}"),
            *(f"{pt * 1000:,.0f}", f"{mt * 1000:,.0f}", f"{pt / mt:.2f}"),
        )
    return t


# ------------------------------------------------------------------ standalone


def main(argv: list[str] | None = None) -> int:
    """`python -m multicard.plan ARGS` = `multicard plan ARGS`."""
    from multicard.cli import _Parser  # multicard's one-line argument errors

    parser = _Parser(prog="multicard", description=SUMMARY)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = add_plan_parser(sub)
    args = p.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    try:
        return run_plan(args)
    except MulticardError as exc:
        print(f"multicard: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("multicard: interrupted", file=sys.stderr)
        return ExitCode.SIGINT
