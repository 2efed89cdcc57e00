"""`multicard verify`: prove on this machine that N-process DDP trains like one process, and
that a stopped job resumes exactly where it stopped.

Short float64 runs of the user's config at the same global batch, each in fresh processes
started through torchrun's API:

1. the job: N processes for K steps; with the resume check it writes the checkpoint a stop
   writes at a step inside an epoch, and records its whole state there and at step K;
2. (resume) the job resumed from that checkpoint in fresh processes of the same layout;
3. one process: the reference run for K steps, then (resume) the job resumed there too, in a run
   of its own: any state the checkpoint lacks shows as a difference.

Checks: parity (parameters after K steps agree), eval (the same parameters evaluate
identically at both world sizes), coverage (every sample once per epoch, a new order each
epoch), resume (both resumed runs continue the uninterrupted job: bitwise in the same layout,
within 1e-10 in one process; else the differing parts are named: model, optimizer, scheduler,
RNG, data position). A verify that proves nothing is no pass: chosen checks that would all be
skipped are refused before any run, and runs that left every check skipped end in an error.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from multicard.base.config import Config, load_config, to_dict, with_overrides
from multicard.base.errors import ExitCode, MulticardError, UserError
from multicard.runtime.launch import run_spec
from multicard.runtime.process_group import threads_per_process
from multicard.strategy import build_model
from multicard.tools.verify.checks import (
    CHECKS,
    FAULTS,
    RESUME_FAULTS,
    RESUME_RTOL,
    Outcome,
    check_coverage,
    compare_eval,
    compare_parameters,
    compare_resumed,
    has_batchnorm,
    has_dropout,
    max_relative_difference,
    resume_cut,
)

DROPOUT = "not comparable: dropout draws its masks per rank"
ONE_PROCESS = ["strategy=single", "ddp.shard_optimizer=false"]  # the reference run: nothing to shard


class VerifyFailed(MulticardError):
    """A check found a difference: the setup does not train like a single process."""

    exit_code = ExitCode.VERIFY_FAILED


class RunFailed(MulticardError):
    """A verify run refused the setup: its reason, with its exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = ExitCode(exit_code)


@dataclass
class VerifyOptions:
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    nproc: int = 2
    steps: int = 4
    faults: list[str] = field(default_factory=list)  # `--break`: see checks.FAULTS
    out: str | None = None  # keep the runs' files here (default: a temporary directory)
    checks: list[str] = field(default_factory=lambda: list(CHECKS))


@dataclass(frozen=True)
class Runs:
    """The configs of one verify: the job (N processes), its resumed copy, the one-process run."""

    job: Config
    resumed: Config
    single: Config
    label: str  # the job's layout, e.g. 'ddp×2', 'fsdp×2 (ZeRO-2)'
    note: str  # how BatchNorm is compared ('' without BatchNorm)


def _run(cfg: Config, nproc: int, spec: dict[str, Any]) -> dict[str, Any]:
    workdir = Path(cfg.out_dir)
    spec = {"config": to_dict(cfg), "params": str(workdir / "params.pt"), "states": str(workdir / "states.pt"), **spec}
    code, result = run_spec("multicard.tools.verify.worker", spec, nproc, workdir)
    if result is None:
        raise MulticardError(f"the {nproc}-process verify run failed with exit code {code} (its error is above)")
    if "failed" in result:  # the run's own one-line reason (a config the workers refuse)
        raise RunFailed(result["failed"], result["exit_code"])
    return result


def _saved(cfg: Config, name: str) -> dict[str, Any]:
    """What the run of `cfg` saved at its spec's `name`, "params" or "states" (see _run)."""
    return torch.load(Path(cfg.out_dir) / f"{name}.pt", weights_only=True)


def _variant(cfg: Config) -> str:
    """' (ZeRO-1)', ' (ZeRO-2)', ' (ZeRO-3)' or ''."""
    if cfg.strategy == "fsdp":
        return " (ZeRO-3)" if cfg.fsdp.reshard_after_forward else " (ZeRO-2)"
    return " (ZeRO-1)" if cfg.ddp.shard_optimizer else ""


def _check_options(options: VerifyOptions) -> None:
    if options.nproc < 2:
        raise UserError(f"--nproc-per-node {options.nproc}: verify compares N >= 2 processes with one")
    if options.steps < 1:
        raise UserError(f"--steps {options.steps} must be at least 1")
    for fault in options.faults:
        if fault not in FAULTS:
            raise UserError(f"--break {fault} is not one of {', '.join(FAULTS)}")
    if not options.checks or any(c not in CHECKS for c in options.checks):
        raise UserError(f"--checks {','.join(options.checks)!r}: choose from {', '.join(CHECKS)} (comma-separated)")
    dropped = [f for f in options.faults if f in RESUME_FAULTS]
    if dropped and "resume" not in options.checks:
        raise UserError(f"--break {dropped[0]} breaks what the resume check tests; add resume to --checks")


def _synthetic_epoch(steps: int) -> int:
    """Optimizer steps per epoch of verify's runs on synthetic data: two epochs in K steps."""
    return max(1, steps // 2)


def _nowhere_to_stop(options: VerifyOptions) -> UserError:
    fault = next(f for f in options.faults if f in RESUME_FAULTS)
    return UserError(
        f"--break {fault} needs a step inside an epoch to stop the job at, and none of its {options.steps} steps "
        f"but the last is; raise --steps (4 or more on synthetic data)"
    )


def _configs(options: VerifyOptions, user: Config, root: Path, probe: torch.nn.Module) -> Runs:
    steps = options.steps
    fixed = ["precision=fp64", f"train.max_steps={steps}", "train.resume=never", "checkpoint.every_steps=0",
             f"checkpoint.keep_last={steps + 1}"]  # every checkpoint kept: the one a stop writes inside an epoch too
    if user.data.name == "synthetic":  # two epochs inside K steps, so epoch changes are exercised
        fixed.append(f"data.train_size={user.train.global_batch_size * _synthetic_epoch(steps)}")
    strategy = user.strategy if user.strategy in ("ddp", "fsdp") else "ddp"  # the layout to check
    multi = [*fixed, f"strategy={strategy}"]
    note = ""
    if has_batchnorm(probe):
        multi.append("sync_bn=true")  # per-rank statistics would differ from one process's
        note = " (BatchNorm over the global batch: sync_bn=true)"
    return Runs(
        job=with_overrides(user, [*multi, f"out_dir={root / 'multi'}"]),
        resumed=with_overrides(user, [*multi, f"out_dir={root / 'resumed'}"]),
        single=with_overrides(user, [*fixed, *ONE_PROCESS, f"out_dir={root / 'single'}"]),
        label=f"{strategy}×{options.nproc}" + _variant(user),
        note=note,
    )


def verify(options: VerifyOptions, console: Console | None = None) -> list[Outcome]:
    console = console or Console(highlight=False)
    _check_options(options)
    user = load_config(options.config, options.overrides)
    if user.train.global_batch_size % options.nproc:
        raise UserError(
            f"train.global_batch_size={user.train.global_batch_size} does not split over {options.nproc} processes; "
            f"choose a multiple of {options.nproc}"
        )
    dropping = any(f in RESUME_FAULTS for f in options.faults)  # --break rng / data-position
    synthetic = user.data.name == "synthetic"
    no_cut = resume_cut(options.steps, _synthetic_epoch(options.steps) if synthetic else options.steps) is None
    if dropping and no_cut:
        raise _nowhere_to_stop(options)
    probe = build_model(user.model.name, 10, dict(user.model.kwargs))  # only inspected for BatchNorm and dropout
    dropout = has_dropout(probe)
    _refuse_checking_nothing(options, dropout, no_cut)
    checks, steps, faults = set(options.checks), options.steps, options.faults
    with tempfile.TemporaryDirectory(prefix="multicard-verify-") as tmp:
        runs = _configs(options, user, Path(options.out or tmp), probe)
        broken = f"; broken on purpose: {', '.join(faults)}" if faults else ""
        console.print(
            f"multicard verify: {user.model.name}, global batch {user.train.global_batch_size}, {steps} steps "
            f"in float64: 1 process vs {runs.label}{runs.note}{broken}",
            soft_wrap=True,
        )
        job, single = _run_all(options, runs, dropout)
        outcomes = []
        if "parity" in checks:
            skip = Outcome(f"{runs.label} equals single", "skip", DROPOUT)
            outcomes.append(skip if dropout else _parity(runs, steps))
        if "eval" in checks:
            outcomes.append(compare_eval(job["eval"], single["eval"], options.nproc))
        if "coverage" in checks:
            outcomes.append(
                check_coverage(job["coverage"], job["num_samples"], user.train.global_batch_size, user.data.repeats)
            )
        if "resume" in checks:
            outcomes.extend(_resume_outcomes(runs, steps, job.get("cut"), dropout))
    for o in outcomes:
        mark = {"pass": "[green]PASS[/green]", "fail": "[red]FAIL[/red]", "skip": "[yellow]SKIP[/yellow]"}[o.status]
        console.print(f"{mark} {o.name}: {o.detail}", soft_wrap=True)  # one line per check
    if all(o.status == "skip" for o in outcomes):  # what the runs found made every check skip
        why = "; ".join(dict.fromkeys(o.detail for o in outcomes))
        raise UserError(f"nothing was checked: every selected check was skipped ({why}); choose --checks that can run")
    return outcomes


def _refuse_checking_nothing(options: VerifyOptions, dropout: bool, no_cut: bool) -> None:
    """Before any run: a selection of checks that would all be skipped is refused (a verify that
    proved nothing is no pass), naming what to change."""
    skipped = {}
    if dropout:
        skipped["parity"] = (
            "parity cannot compare a model with dropout (its masks differ per rank): add eval, coverage or resume "
            "to --checks"
        )
    if no_cut:
        skipped["resume"] = (
            f"resume needs a step inside an epoch to stop the job at and none of its {options.steps} steps but the "
            f"last is: raise --steps (4 or more on synthetic data)"
        )
    if set(options.checks) <= set(skipped):
        why = "; ".join(skipped[c] for c in dict.fromkeys(options.checks))
        raise UserError(f"--checks {','.join(options.checks)} would check nothing: {why}")


def _run_all(options: VerifyOptions, runs: Runs, dropout: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job, its resumed copy and the one-process run (each only if a chosen check needs it);
    the job's and the one-process run's summaries."""
    steps, faults, checks = options.steps, options.faults, set(options.checks)
    job = _run(runs.job, options.nproc, {"train": "job", "steps": steps, "faults": faults, "stop": "resume" in checks})
    checkpoint = job.get("checkpoint")  # written inside an epoch, when the resume check runs
    if checkpoint is None and any(f in RESUME_FAULTS for f in faults):  # the training set has one step per epoch
        raise _nowhere_to_stop(options)
    if checkpoint is not None:
        _run(runs.resumed, options.nproc, {"train": None, "resume": checkpoint, "steps": steps, "faults": faults})
    across = checkpoint is not None and not dropout
    reference = bool(checks - {"resume"})
    if not (reference or across):
        return job, {}
    spec = {
        "train": "reference" if reference else None,
        "reference": str(Path(runs.job.out_dir) / "checkpoints"),  # its last checkpoint, evaluated by one process
        "resume": checkpoint if across else None,
        "steps": steps,
        "faults": faults,
    }
    return job, _run(runs.single, 1, spec)


def _parity(runs: Runs, steps: int) -> Outcome:
    """The job's parameters against one process's; past PARAM_RTOL, against the floor one process
    makes with itself at another thread count (the one-process run again)."""
    multi, single = _saved(runs.job, "params"), _saved(runs.single, "params")
    outcome = compare_parameters(multi, single, runs.label, steps)
    if not outcome.failed:
        return outcome
    threads = threads_per_process(runs.single.threads, 1)
    other = with_overrides(runs.single, [f"threads={1 if threads > 1 else 2}",
                                         f"out_dir={Path(runs.single.out_dir).parent / 'floor'}"])  # fmt: skip
    _run(other, 1, {"train": "reference", "reference": None, "resume": None, "steps": steps, "faults": []})
    floor, _ = max_relative_difference(_saved(other, "params"), single)
    return compare_parameters(multi, single, runs.label, steps, floor)


def _resume_outcomes(runs: Runs, steps: int, cut: dict[str, int] | None, dropout: bool) -> list[Outcome]:
    """The job stopped inside an epoch and resumed in its own layout (bitwise) and in one process
    (float64 tolerance), against the uninterrupted job right after resuming and at step K."""
    if cut is None:
        why = f"no step of the {steps} but the last is inside an epoch, to stop at: raise --steps"
        return [Outcome("resume inside an epoch", "skip", why)]
    stopped = f"{runs.label} stopped at step {cut['step']} (step {cut['step_in_epoch']} of epoch {cut['epoch']})"
    end = f"after step {steps}"
    job, same = _saved(runs.job, "states"), _saved(runs.resumed, "states")
    points = [("after resuming", same["resumed"], job["cut"]), (end, same["resumed_end"], job["end"])]
    outcomes = [compare_resumed(f"{stopped}, resumed as {runs.label}: continues bitwise", points, 0.0)]
    name = f"{stopped}, resumed as 1 process: continues (float64)"
    if dropout:
        return [*outcomes, Outcome(name, "skip", DROPOUT)]
    one = _saved(runs.single, "states")

    def rank0(state: dict[str, Any]) -> dict[str, Any]:  # one process continues rank 0's random streams
        return {**state, "rng": state["rng"][:1]}

    points = [
        ("after resuming", rank0(one["resumed"]), rank0(job["cut"])),
        (end, rank0(one["resumed_end"]), rank0(job["end"])),
    ]
    return [*outcomes, compare_resumed(name, points, RESUME_RTOL)]
