"""`multicard plan`'s arguments, kept apart from the planner so `multicard --help` stays quick."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from multicard.base.errors import UserError
from multicard.tools.plan.candidates import CANDIDATES, DEFAULT_HEADROOM
from multicard.tools.plan.hardware import known_names
from multicard.tools.plan.links import LINKS

SUMMARY = "per-device memory and step time of each strategy on a named GPU, before renting it"


def add_plan_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help=SUMMARY, description=SUMMARY[0].upper() + SUMMARY[1:] + ".")
    p.add_argument("--config", help="YAML config file (the run to plan)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. model.name=resnet50")
    p.add_argument("--gpu", help=f"the GPU: cpu (this machine) or one of {', '.join(known_names())}")
    p.add_argument("--memory-gb", type=float, help="plan for this machine with X GB per process instead")
    p.add_argument("--gpus", type=int, default=1, help="GPUs per node (CPU: processes) (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--interconnect", help=f"link between nodes (one node: between its GPUs): "
                                          f"{', '.join(link.name for link in LINKS)}")  # fmt: skip
    p.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                   help=f"share of device memory left free (default {DEFAULT_HEADROOM})")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    p.add_argument("--measure", action="store_true", help="also run real steps of each strategy that can run here")
    p.add_argument("--steps", type=int, default=3, help="--measure: timed steps per strategy (default 3)")
    p.add_argument("--strategies", help="--measure: only these (of single,dp,ddp,zero1,zero2,zero3,hsdp)")
    p.add_argument("--calibrate", action="store_true", help="measure this machine's rates first and store them")
    p.add_argument("--out", default="runs/plan", help="where plan.json and plan.png go (default runs/plan)")
    return p


@dataclass(frozen=True)
class PlanOptions:
    """What `multicard plan` was asked for (its flags, checked)."""

    config: str | None
    overrides: list[str]
    gpu: str | None
    memory_gb: float | None
    gpus: int
    nodes: int
    interconnect: str | None
    headroom: float
    json: bool
    measure: bool
    steps: int
    strategies: list[str] | None  # --measure: only these candidates
    calibrate: bool
    out: str

    @property
    def plans(self) -> bool:
        """A plan is written (not only a calibration)."""
        return self.gpu is not None or self.memory_gb is not None


def plan_options(args: argparse.Namespace) -> PlanOptions:
    check_args(args)
    return PlanOptions(
        config=args.config, overrides=args.overrides, gpu=args.gpu, memory_gb=args.memory_gb, gpus=args.gpus,
        nodes=args.nodes, interconnect=args.interconnect, headroom=args.headroom, json=args.json,
        measure=args.measure, steps=args.steps, strategies=[k for k in (args.strategies or "").split(",") if k] or None,
        calibrate=args.calibrate, out=args.out,
    )  # fmt: skip


def check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.headroom < 1:
        raise UserError(f"--headroom {args.headroom} must be in [0, 1)")
    if args.steps < 1:
        raise UserError(f"--steps {args.steps} must be at least 1")
    keys = [c.key for c in CANDIDATES]
    unknown = [k for k in (args.strategies or "").split(",") if k and k not in keys]
    if unknown:
        raise UserError(f"--strategies {args.strategies}: {unknown[0]} is not one of {','.join(keys)}")
    if (args.gpu is None or args.gpu.lower() == "cpu") and args.nodes > 1:
        raise UserError("--nodes applies to a named GPU (--gpu NAME); this machine is one node")
    if args.gpu is None and args.memory_gb is None and not args.calibrate:
        raise UserError("give --gpu NAME (or cpu) or --memory-gb X: what to plan for")
    if args.gpu is not None and args.memory_gb is not None:
        raise UserError("give either --gpu or --memory-gb, not both")
