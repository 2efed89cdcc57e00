"""The plan: each strategy's memory per device, the largest micro-batch that fits, the
gradient accumulation that keeps the configured global batch, the step time, and which to run.

Every strategy is the user's config with a few keys changed (Candidate.overrides), checked by
the config's own validation (and Config.check_fsdp for fsdp), so the command printed at the
end is one `multicard train` accepts.
"""

from __future__ import annotations

import functools
import shlex
from dataclasses import dataclass, field
from typing import Any

from multicard.base.config import Config, load_config, to_dict, with_overrides
from multicard.base.errors import UserError
from multicard.base.malloc import wants_release
from multicard.data import BatchSplit
from multicard.tools.plan.candidates import CANDIDATES, DEFAULT_HEADROOM, Candidate
from multicard.tools.plan.dataset import DataFacts, data_facts, resident_bytes
from multicard.tools.plan.memory import ELEMENT, Layout, Memory, largest_batch, peak
from multicard.tools.plan.step_model import StepModel, step_model
from multicard.tools.plan.target import Target
from multicard.tools.plan.timing import StepTime, step_time


@dataclass
class Row:
    candidate: Candidate
    status: str  # fits | too big | n/a
    reason: str = ""
    processes: int = 1
    devices: int = 1
    micro_batch: int = 0  # per process at the configured train.grad_accum
    memory: Memory | None = None  # at that micro-batch
    budget: float = 0.0  # bytes usable per device (memory × (1 − headroom))
    device_memory: float = 0.0
    max_micro_batch: int = 0
    accum: int | None = None  # the smallest train.grad_accum that fits
    fit_micro_batch: int = 0
    fit_memory: Memory | None = None
    smallest: tuple[int, Memory] | None = None  # (micro-batch, memory) at the largest accumulation
    time: StepTime | None = None
    img_per_s: float = 0.0
    command: str = ""
    overrides: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.status == "fits"


@dataclass
class Plan:
    config_name: str
    target: Target
    global_batch: int
    precision: str
    model_name: str
    image_size: int
    headroom: float
    rows: list[Row]
    recommended: Row | None
    why: str
    notes: list[str]
    flops_per_image: float
    params: int


def _layout(c: Candidate, target: Target, cfg: Config, accum: int) -> Layout:
    layout = functools.partial(Layout, accum=accum, precision=cfg.precision, cuda=target.cuda)
    if c.kind == "dp":
        return layout("dp", replicas=target.gpus)
    if c.kind == "single":
        return layout("single")
    if c.kind in ("ddp", "zero1"):
        return layout(c.kind, shard=target.devices, bucket_view=cfg.ddp.gradient_as_bucket_view)
    shard = target.gpus if c.replicate_nodes else target.devices
    return layout("fsdp", shard=shard, reshard_after_forward=c.reshard_after_forward)


def _applicable(c: Candidate, target: Target) -> str:
    """Why the candidate cannot run on the target ('' if it can)."""
    if c.splits_over_gpus and (not target.cuda or target.gpus < 2 or target.nodes > 1):
        return "needs 2 or more CUDA GPUs in one node"
    if not c.one_process and target.devices < 2:
        return "one device: the same work as single"
    if c.replicate_nodes and target.nodes < 2:
        return "replicates across nodes: needs --nodes 2 or more"
    return ""


def _processes(c: Candidate, target: Target) -> tuple[int, int]:
    """(world size, processes per node)."""
    if c.one_process:
        return 1, 1
    return target.devices, target.gpus


def _time(model: StepModel, c: Candidate, target: Target, cfg: Config, n: int, accum: int) -> StepTime:
    world, per_node = _processes(c, target)
    rates = target.rates(cfg.precision, per_node)
    net = target.net(per_node)
    compressed = cfg.ddp.comm_hook in ("fp16", "bf16")
    return step_time(
        model, c.kind, rates, net, n, accum, per_node, target.nodes if world > 1 else 1,
        replicas=c.gpus_per_process(target.gpus),
        shard_per_node=target.gpus if c.replicate_nodes else None,
        reshard_after_forward=c.reshard_after_forward,
        release_memory=target.gpu is None and wants_release(cfg.fsdp.cpu_release_memory, target.capped),
        compute_bytes=ELEMENT[cfg.precision],  # FSDP gathers parameters in the compute dtype
        comm_bytes=2 if compressed else (8 if cfg.precision == "fp64" else 4),  # gradients keep the parameters' dtype
        bucket_bytes=cfg.ddp.bucket_cap_mb * 2**20,
    )  # fmt: skip


def plan_row(model: StepModel, c: Candidate, target: Target, cfg: Config, facts: DataFacts, headroom: float) -> Row:
    row = Row(c, "n/a")
    why = _applicable(c, target)
    if why:
        row.reason = why
        return row
    try:
        ccfg = with_overrides(cfg, list(c.overrides))
        world, per_node = _processes(c, target)
        if c.kind == "fsdp":
            ccfg.check_fsdp(world, per_node)
        plan = BatchSplit(cfg.train.global_batch_size, cfg.train.grad_accum, world)
    except UserError as exc:
        row.reason = str(exc)
        return row
    row.processes, row.devices = world, world * c.gpus_per_process(target.gpus)
    row.micro_batch = plan.micro_batch
    row.device_memory = target.memory(per_node)
    row.budget = row.device_memory * (1 - headroom)
    loader, kind = resident_bytes(cfg.data, facts, row.device_memory, target.cuda)
    runtime = target.runtime_bytes(distributed=world > 1, loader=kind)
    fixed = {"loader": float(loader), "runtime": float(runtime)}
    row.memory = peak(model, _layout(c, target, cfg, cfg.train.grad_accum), plan.micro_batch, fixed)
    step = c.gpus_per_process(target.gpus)  # dp splits each micro-batch evenly over its GPUs
    row.max_micro_batch = largest_batch(model, _layout(c, target, cfg, 1), row.budget, loader + runtime, step)
    for k in range(1, cfg.train.global_batch_size + 1):  # each accumulation that splits the global batch
        n, rest = divmod(cfg.train.global_batch_size, world * k)
        if rest or n % step:
            continue
        memory = peak(model, _layout(c, target, cfg, k), n, fixed)
        row.smallest = (n, memory)
        if memory.total <= row.budget:
            row.accum, row.fit_micro_batch, row.fit_memory = k, n, memory
            break
    row.status = "fits" if row.accum is not None else "too big"
    if row.accum is not None:
        row.time = _time(model, c, target, cfg, row.fit_micro_batch, row.accum)
        row.img_per_s = cfg.train.global_batch_size / row.time.total_s
    elif row.smallest is not None:
        row.reason = f"does not fit even at micro-batch {row.smallest[0]}"
    return row


def _differs(cfg: Config, override: str) -> bool:
    """Whether KEY=VALUE changes `cfg` (so the command says only what is not already so)."""
    key, value = override.split("=", 1)
    current: Any = to_dict(cfg)
    for part in key.split("."):
        current = current[part]
    return str(current).lower() != value.lower()


def command(row: Row, cfg_path: str | None, user_overrides: list[str], target: Target, cfg: Config) -> str:
    """The `multicard train` line that runs this row's strategy with its accumulation."""
    keys = {o.split("=", 1)[0] for o in row.candidate.overrides} | {"train.grad_accum", "devices"}
    kept = [o for o in user_overrides if o.split("=", 1)[0] not in keys]
    base = load_config(cfg_path, kept)  # what the command says before this row's changes
    extra = [o for o in row.candidate.overrides if _differs(base, o)]
    if row.accum != base.train.grad_accum:
        extra.append(f"train.grad_accum={row.accum}")
    if row.candidate.splits_over_gpus:
        extra.append("devices=[" + ",".join(str(i) for i in range(target.gpus)) + "]")
    elif not target.cuda and base.devices != "cpu":
        extra.append("devices=cpu")
    elif target.cuda and base.devices == "cpu":
        extra.append("devices=auto")
    parts = ["multicard", "train", *(["--config", cfg_path] if cfg_path else []), *kept, *extra]
    if not row.candidate.one_process:
        parts += ["--nproc-per-node", str(target.gpus)]
        if target.nodes > 1:
            parts += ["--nnodes", str(target.nodes), "--node-rank", "R", "--master-addr", "HOST0",
                      "--master-port", "29400"]  # fmt: skip
    return " ".join(shlex.quote(p) if p not in ("R", "HOST0") else p for p in parts)


PREFERENCE = ("single", "ddp", "zero1", "zero2", "zero3", "hsdp", "dp")  # fewer moving parts first
CLOSE = 0.03  # step times within 3% count as equal


def recommend(rows: list[Row]) -> tuple[Row | None, str]:
    """The fastest strategy that fits with headroom; among those within CLOSE of it, the simplest."""
    fitting = [(r, r.time.total_s) for r in rows if r.fits and r.time is not None]  # (row, step seconds)
    if not fitting:
        return None, ""
    fastest = min(s for _, s in fitting)
    close = [r for r, s in fitting if s <= fastest * (1 + CLOSE)]
    best = min(close, key=lambda r: PREFERENCE.index(r.candidate.key))
    assert best.fit_memory is not None and best.time is not None
    why = (f"{best.candidate.label} is the fastest that fits with {1 - best.budget / best.device_memory:.0%} headroom "
           f"({best.img_per_s:,.0f} img/s, {best.fit_memory.total / 2**30:.1f} of "
           f"{best.device_memory / 2**30:.1f} GiB per device)")  # fmt: skip
    if len(close) > 1:
        others = ", ".join(r.candidate.label for r in close if r is not best)
        why += f"; {others} within {CLOSE:.0%} of it, but with more moving parts"
    slower = [r for r, _ in sorted(fitting, key=lambda rs: rs[1]) if r not in close]
    if slower:
        why += f"; next: {slower[0].candidate.label} at {slower[0].img_per_s:,.0f} img/s"
    unfit = [r.candidate.label for r in rows if r.status == "too big"]
    if unfit:
        why += f"; {', '.join(unfit)} do not fit"
    if best.accum and best.accum > 1:
        why += f"; train.grad_accum={best.accum} keeps the global batch with micro-batches of {best.fit_micro_batch}"
    return best, why


def nothing_fits(rows: list[Row], target: Target, cfg: Config) -> UserError:
    """The one-line error for a config that fits no strategy: the closest one and its largest part."""
    sized = [(r, r.smallest) for r in rows if r.smallest is not None]
    if not sized:
        reasons = "; ".join(f"{r.candidate.label}: {r.reason}" for r in rows)
        return UserError(f"no strategy can run this config on {target.label} ({reasons})")
    row, (n, memory) = min(sized, key=lambda rs: rs[1][1].total / rs[0].budget)
    part, size = max(((k, v) for k, v in memory.parts.items() if k != "runtime"), key=lambda kv: kv[1])
    return UserError(
        f"model.name={cfg.model.name} at data.image_size={cfg.data.image_size} fits no strategy on {target.label}: "
        f"the closest, {row.candidate.label}, needs {memory.total / 2**30:.1f} GiB per device at micro-batch {n} "
        f"where {row.budget / 2**30:.1f} GiB can be used; its largest part is {part} ({size / 2**30:.1f} GiB); "
        f"{ADVICE.get(part, ADVICE['parameters'])}"
    )


ADVICE = {
    "activations": "lower data.image_size, use precision=bf16, or a device with more memory",
    "loader": "use data.loader=workers (images read per batch) or fewer images held (data.train_size)",
    "parameters": "shard over more devices (--gpus, --nodes), use optim.name=sgd or precision=bf16, "
    "a device with more memory, or a smaller model",
}


def make_plan(cfg: Config, cfg_path: str | None, overrides: list[str], target: Target,
              headroom: float = DEFAULT_HEADROOM) -> Plan:  # fmt: skip
    facts = data_facts(cfg.data, cfg.seed)
    model = step_model(cfg, facts.num_classes)
    rows = [plan_row(model, c, target, cfg, facts, headroom) for c in CANDIDATES]
    for r in rows:
        if r.fits:
            r.command = command(r, cfg_path, overrides, target, cfg)
    best, why = recommend(rows)
    if best is None:
        raise nothing_fits(rows, target, cfg)
    notes = [facts.note] if facts.note else []
    if cfg.compile:
        notes.append("compile=true: planned as eager execution (compiled steps usually hold less activation memory)")
    if target.gpu is None and (target.calibration is None or not target.calibration.calibrated):
        notes.append("this machine is not calibrated: step times are rough (run multicard plan --calibrate once)")
    trace = model.trace
    per_image = float((model.flops.at(2) - model.flops.at(1))[model.forward_backward].sum())
    return Plan(cfg_path or "(defaults)", target, cfg.train.global_batch_size, cfg.precision, cfg.model.name,
                cfg.data.image_size, headroom, rows, best, why, notes, per_image,
                sum(p.numel for p in trace.params))  # fmt: skip
