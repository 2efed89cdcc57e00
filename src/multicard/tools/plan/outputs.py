"""The plan's outputs: a rich table, plan.json, and plan.png (memory per strategy, stacked by
component, against the device's memory and the usable budget)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from multicard.tools.plan.memory import COMPONENTS
from multicard.tools.plan.planner import Plan, Row

MIB, GIB = 2**20, 2**30
SHORT = {"parameters": "params", "gradients": "grads", "optimizer": "optim", "activations": "activ",
         "temporaries": "temps", "buckets": "comm", "loader": "loader", "runtime": "runtime"}  # fmt: skip


def _unit(plan: Plan) -> tuple[float, str]:
    totals = [r.memory.total for r in plan.rows if r.memory is not None]
    return (MIB, "MiB") if totals and max(totals) < 2 * GIB else (GIB, "GiB")


def _fmt(value: float, unit: float) -> str:
    return f"{value / unit:,.2f}" if unit == GIB else f"{value / unit:,.0f}"


def table(plan: Plan) -> Table:
    """Strategies as columns (those that cannot run here are listed under the table), components
    and results as rows: fits an 80-column terminal."""
    unit, name = _unit(plan)
    rows = [r for r in plan.rows if r.memory is not None]
    peaks = [r.memory for r in plan.rows if r.memory is not None]  # the same rows' memory
    t = Table(title=f"{plan.model_name} {plan.image_size}px {plan.precision}, global batch {plan.global_batch}, "
                    f"{plan.target.label}", title_justify="left")  # fmt: skip
    t.add_column(f"per device, {name}")
    for r in rows:
        t.add_column(r.candidate.key + (" ★" if r is plan.recommended else ""), justify="right")

    def line(label: str, cells: list[str], style: str = "") -> None:
        t.add_row(label, *cells, style=style)

    line("processes × micro-batch", [f"{r.processes}×{r.micro_batch}" for r in rows])
    for c in COMPONENTS:
        line(c if c != "buckets" else "comm buffers", [_fmt(m.parts.get(c, 0.0), unit) for m in peaks])
    if any(m.first_gpu_extra for m in peaks):
        line("first GPU extra (dp)", [_fmt(m.first_gpu_extra, unit) if m.first_gpu_extra else "" for m in peaks])
    line("total", [("" if m.total <= r.budget else "[red]") + _fmt(m.total, unit)
                   for r, m in zip(rows, peaks, strict=True)], style="bold")  # fmt: skip
    line("largest micro-batch", [str(r.max_micro_batch) for r in rows])
    line("grad_accum that fits", [str(r.accum) if r.accum else "[red]none" for r in rows])
    line("step ms", [f"{r.time.total_s * 1000:,.1f}" if r.time else "—" for r in rows])
    line("  of it comm exposed", [f"{r.time.exposed_s * 1000:,.1f}" if r.time else "—" for r in rows])
    line("img/s", [f"{r.img_per_s:,.0f}" if r.time else "—" for r in rows], style="bold")
    return t


def print_plan(plan: Plan, console: Console) -> None:
    console.print(table(plan))
    skipped: dict[str, list[str]] = {}
    for r in plan.rows:
        if r.memory is None:
            skipped.setdefault(r.reason, []).append(r.candidate.key)
    for reason, keys in skipped.items():
        console.print(f"n/a: {', '.join(keys)}: {reason}", highlight=False)
    unit, name = _unit(plan)
    budget = next((r for r in plan.rows if r.memory is not None), None)
    if budget is not None:
        console.print(f"memory at the configured micro-batch, each part as held at the moment of the peak "
                      f"(gradients not yet made when the peak ends the forward); "
                      f"fits: total ≤ {1 - plan.headroom:.0%} of "
                      f"{_fmt(budget.device_memory, unit)} {name} (headroom {plan.headroom:.0%}); "
                      f"{plan.flops_per_image / 1e9:,.1f} GFLOP per image (forward + backward)")  # fmt: skip
    for note in plan.notes:
        console.print(f"note: {note}")
    if plan.recommended is not None:
        console.print(f"recommended: {plan.why}")
        console.print(plan.recommended.command, soft_wrap=True, highlight=False)


def _row_dict(row: Row) -> dict[str, Any]:
    out: dict[str, Any] = {
        "strategy": row.candidate.key,
        "label": row.candidate.label,
        "status": row.status,
        "reason": row.reason,
        "overrides": list(row.candidate.overrides),
        "processes": row.processes,
        "devices": row.devices,
        "micro_batch": row.micro_batch,
        "device_memory_bytes": row.device_memory,
        "budget_bytes": row.budget,
        "max_micro_batch": row.max_micro_batch,
        "grad_accum": row.accum,
        "fit_micro_batch": row.fit_micro_batch,
        "command": row.command,
    }
    if row.memory is not None:
        out["memory_bytes"] = {**row.memory.parts, "first_gpu_extra": row.memory.first_gpu_extra}
        out["total_bytes"] = row.memory.total
        out["tensor_bytes"] = row.memory.tensors
        out["peak_op"] = f"{row.memory.phase}:{row.memory.op}"
    if row.time is not None:
        out["step_s"] = row.time.total_s
        out["time_s"] = {"compute": row.time.compute_s, "optimizer": row.time.optimizer_s,
                         "communication": row.time.comm_s, "exposed_communication": row.time.exposed_s}  # fmt: skip
        out["img_per_s"] = row.img_per_s
    return out


def as_dict(plan: Plan, measured: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    t = plan.target
    return {
        "target": {"label": t.label, "gpu": t.gpu.name if t.gpu else "cpu", "gpus_per_node": t.gpus, "nodes": t.nodes,
                   "intra": t.intra.name if t.intra else None, "inter": t.inter.name if t.inter else None},
        "config": plan.config_name,
        "model": plan.model_name,
        "image_size": plan.image_size,
        "precision": plan.precision,
        "global_batch": plan.global_batch,
        "parameters": plan.params,
        "gflop_per_image": plan.flops_per_image / 1e9,
        "headroom": plan.headroom,
        "rows": [_row_dict(r) for r in plan.rows],
        "recommended": plan.recommended.candidate.key if plan.recommended else None,
        "why": plan.why,
        "command": plan.recommended.command if plan.recommended else None,
        "notes": plan.notes,
        **({"measured": measured} if measured is not None else {}),
    }  # fmt: skip


def write_json(data: dict[str, Any], path: Path) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def plot(plan: Plan, path: Path) -> None:
    """One stacked bar per strategy (its memory per device by component), with the device's memory
    and the usable budget as lines."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = [r for r in plan.rows if r.memory is not None]
    peaks = [r.memory for r in plan.rows if r.memory is not None]  # the same rows' memory
    unit, name = _unit(plan)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 3), 4.8))
    labels = [r.candidate.label.replace(" (", "\n(") for r in rows]
    bottom = [0.0] * len(rows)
    for component in (*COMPONENTS, "first GPU extra"):
        values = [(m.first_gpu_extra if component == "first GPU extra" else m.parts.get(component, 0.0)) / unit
                  for m in peaks]  # fmt: skip
        if any(values):
            ax.bar(labels, values, bottom=bottom, label=component)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    if rows:
        ax.axhline(rows[0].device_memory / unit, color="black", linewidth=1, label="device memory")
        ax.axhline(rows[0].budget / unit, color="black", linestyle="--", linewidth=1,
                   label=f"usable ({1 - plan.headroom:.0%})")  # fmt: skip
    ax.set_ylabel(f"{name} per device")
    ax.set_title(f"{plan.model_name} {plan.image_size}px {plan.precision}, micro-batch as configured\n"
                 f"{plan.target.label}", fontsize=9)  # fmt: skip
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
