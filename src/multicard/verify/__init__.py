"""`multicard verify`: prove on this machine that N-process DDP trains like one process.

Two short float64 runs of the user's config at the same global batch, one process and N
processes, each in fresh processes started through torchrun's API. Checks: parameters after
K steps agree, evaluation of the same parameters is identical at both world sizes, and every
sample is used once per epoch with a new order each epoch.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from multicard.config import Config, load_config, to_dict, with_overrides
from multicard.errors import ExitCode, MulticardError, UserError
from multicard.launch import run_spec
from multicard.models import build_model
from multicard.verify.checks import (
    FAULTS,
    Outcome,
    check_coverage,
    compare_eval,
    compare_parameters,
    has_batchnorm,
    has_dropout,
)


class VerifyFailed(MulticardError):
    """A check found a difference: the setup does not train like a single process."""

    exit_code = ExitCode.VERIFY_FAILED


@dataclass
class VerifyOptions:
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    nproc: int = 2
    steps: int = 4
    fault: str | None = None
    out: str | None = None  # keep the runs' files here (default: a temporary directory)


def _run(cfg: Config, nproc: int, steps: int, workdir: Path, fault: str | None, reference: Path | None) -> dict:
    spec = {
        "config": to_dict(cfg),
        "steps": steps,
        "fault": fault,
        "reference": str(reference) if reference else None,
        "params": str(workdir / "params.pt"),
    }
    code, result = run_spec("multicard.verify.worker", spec, nproc, workdir)
    if result is None:
        raise MulticardError(f"the {nproc}-process verify run failed with exit code {code} (its error is above)")
    return result


def _variant(cfg: Config) -> str:
    """' (ZeRO-1)', ' (ZeRO-2)', ' (ZeRO-3)' or ''."""
    if cfg.strategy == "fsdp":
        return " (ZeRO-3)" if cfg.fsdp.reshard_after_forward else " (ZeRO-2)"
    return " (ZeRO-1)" if cfg.ddp.shard_optimizer else ""


def verify(options: VerifyOptions, console: Console | None = None) -> list[Outcome]:
    console = console or Console(highlight=False)
    if not console.is_terminal:
        console.width = max(console.width, 160)  # one line per check in logs
    if options.nproc < 2:
        raise UserError(f"--nproc-per-node {options.nproc}: verify compares N >= 2 processes with one")
    if options.steps < 1:
        raise UserError(f"--steps {options.steps} must be at least 1")
    if options.fault is not None and options.fault not in FAULTS:
        raise UserError(f"--break {options.fault} is not one of {', '.join(FAULTS)}")
    user = load_config(options.config, options.overrides)
    if user.train.global_batch_size % options.nproc:
        raise UserError(
            f"train.global_batch_size={user.train.global_batch_size} does not split over {options.nproc} processes; "
            f"choose a multiple of {options.nproc}"
        )
    fixed = ["precision=fp64", f"train.max_steps={options.steps}", "train.resume=never", "checkpoint.every_steps=0"]
    if user.data.name == "synthetic":  # two epochs inside K steps, so epoch changes are exercised
        fixed.append(f"data.train_size={user.train.global_batch_size * max(1, options.steps // 2)}")
    probe = build_model(user.model.name, 10, dict(user.model.kwargs))  # only inspected for BatchNorm and dropout
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="multicard-verify-") as tmp:
        root = Path(options.out or tmp)
        single_cfg = with_overrides(user, [*fixed, "strategy=single", f"out_dir={root / 'single'}"])
        strategy = user.strategy if user.strategy in ("ddp", "fsdp") else "ddp"  # the layout to check
        label = f"{strategy}×{options.nproc}" + _variant(user)
        multi_overrides = [*fixed, f"strategy={strategy}", f"out_dir={root / 'multi'}"]
        bn_note = ""
        if has_batchnorm(probe):
            multi_overrides.append("sync_bn=true")  # per-rank statistics would differ from one process's
            bn_note = " (BatchNorm over the global batch: sync_bn=true)"
        multi_cfg = with_overrides(user, multi_overrides)
        broken = f"; broken on purpose: {options.fault}" if options.fault else ""
        console.print(
            f"multicard verify: {user.model.name}, global batch {user.train.global_batch_size}, {options.steps} steps "
            f"in float64: 1 process vs {label}{bn_note}{broken}"
        )
        single = _run(single_cfg, 1, options.steps, root / "single", None, None)
        reference = root / "single" / "params.pt"
        multi = _run(multi_cfg, options.nproc, options.steps, root / "multi", options.fault, reference)
        if has_dropout(probe):
            why = "not comparable: dropout draws its masks per rank"
            outcomes.append(Outcome(f"{label} equals single", "skip", why))
        else:
            a = torch.load(root / "multi" / "params.pt", weights_only=True)
            b = torch.load(root / "single" / "params.pt", weights_only=True)
            outcomes.append(compare_parameters(a, b, label, options.steps))
        outcomes.append(compare_eval(multi["eval"], single["eval"], options.nproc))
        outcomes.append(check_coverage(multi["coverage"], multi["num_samples"], user.train.global_batch_size))
    for o in outcomes:
        mark = {"pass": "[green]PASS[/green]", "fail": "[red]FAIL[/red]", "skip": "[yellow]SKIP[/yellow]"}[o.status]
        console.print(f"{mark} {o.name}: {o.detail}")
    return outcomes
