"""bench's outputs: a rich table on the console, bench.json (a list of rows) and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def _num(value: float | None, fmt: str = "{:.0f}") -> str:
    return "—" if value is None else fmt.format(value)


def _ratio(spread: dict[str, float] | None) -> str:
    if not spread:
        return "—"
    if spread["n"] == 1:
        return f"{spread['median']:.3f}"
    return f"{spread['median']:.3f} [{spread['min']:.2f}–{spread['max']:.2f}]"


def _held(per_rank: list[dict[str, float]] | None) -> str:
    """Rank 0's parameters/gradients/optimizer state (MiB), with the largest rank's total when ranks differ."""
    if not per_rank or not per_rank[0]:
        return "—"
    first = per_rank[0]
    text = f"{first['params']:.0f}/{first['grads']:.0f}/{first['optimizer']:.0f}"
    totals = [sum(r.values()) for r in per_rank if r]
    return text if max(totals) - min(totals) < 1 else f"{text} (max {max(totals):.0f})"


def _label(row: dict[str, Any]) -> str:
    label = f"{row['runner']}/{row['strategy']}×{row['world_size']}/{row['precision']}"
    return label if row.get("variant", "default") == "default" else f"{label}+{row['variant']}"


def table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="multicard bench", show_lines=False)
    columns = (
        "cell", "img/s", "step ms", "efficiency", "÷ plain", "peak MB", "param/grad/opt MiB per rank",
        "data/fb/comm/opt ms", "all-reduce GB/s",
    )  # fmt: skip
    for name in columns:
        t.add_column(name, justify="left" if name == "cell" else "right")
    for row in rows:
        label = _label(row)
        if row["status"] != "ok":
            t.add_row(label, f"[dim]{row['status']}: {row.get('reason', '')}[/dim]", *[""] * 7)
            continue
        b = row.get("breakdown")
        parts = ("data_ms", "compute_ms", "comm_exposed_ms", "optimizer_ms")
        split = "—" if not b else "/".join(f"{b[k]:.1f}" for k in parts)
        a = row.get("allreduce")
        rate = "—"
        if a:
            achieved = "—" if a.get("ddp_gb_per_s") is None else f"{a['ddp_gb_per_s']:.2f}"
            rate = f"{achieved} (raw {a['raw_gb_per_s']:.2f})"
        step = f"{row['step_ms_median']:.1f} [{row['step_ms_p10']:.1f}–{row['step_ms_p90']:.1f}]"
        t.add_row(
            label,
            _num(row["img_per_s"]),
            step,
            _ratio(row.get("efficiency")),
            _ratio(row.get("vs_plain")),
            _num(row.get("peak_mem_mb")),
            _held(row.get("held_mib_per_rank")),
            split,
            rate,
        )
    return t


def write_json(rows: list[dict[str, Any]], path: Path) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rows, indent=1))
    tmp.replace(path)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Throughput and efficiency against world size, one line per runner/strategy/precision/variant."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    ok = [row for row in rows if row["status"] == "ok"]
    singles = {(r["runner"], r["precision"]): r for r in ok if r["strategy"] == "single"}

    def point(row: dict[str, Any]) -> tuple[int, float, float | None]:
        eff = row.get("efficiency")
        return row["world_size"], row["img_per_s"], eff["median"] if eff else None

    # One line per runner × strategy × precision × variant, starting from the same runner's single.
    lines: dict[str, list[tuple[int, float, float | None]]] = {}
    for row in ok:
        if row["strategy"] == "single":
            continue
        key = f"{row['runner']} {row['strategy']} {row['precision']}"
        if row.get("variant", "default") != "default":
            key += f" +{row['variant']}"
        single = singles.get((row["runner"], row["precision"]))
        lines.setdefault(key, [point(single)] if single else []).append(point(row))
    if not lines:  # single cells only: one point each
        lines = {f"{r['runner']} single {r['precision']}": [point(r)] for r in singles.values()}
    fig, (ax_tp, ax_eff) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, points in sorted(lines.items()):
        points.sort()
        ax_tp.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=key)
        eff_points = [(p[0], p[2]) for p in points if p[2] is not None]
        if eff_points:
            ax_eff.plot([p[0] for p in eff_points], [p[1] for p in eff_points], marker="o", label=key)
    ax_tp.set(xlabel="world size", ylabel="images / s", title="Throughput")
    ax_eff.set(xlabel="world size", ylabel="efficiency vs single", title="Scaling efficiency")
    ax_eff.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    for ax in (ax_tp, ax_eff):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if lines:
        ax_tp.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def heartbeat_lines(rows: list[dict[str, Any]]) -> list[str]:
    """What stall detection's heartbeats cost, per cell that ran them: the share of wall time
    spent in them (an upper bound on what they can take from the training thread)."""
    lines = []
    for row in rows:
        hb = row.get("heartbeat")
        if row["status"] == "ok" and hb:
            lines.append(
                f"heartbeats of {_label(row)}: at most {100 * hb['wall_share']:.3f}% of step time "
                f"({hb['wall_ms_per_beat']:.2f} ms per beat, {hb['cpu_ms_per_beat']:.2f} ms of it CPU; costliest rank)"
            )
    return lines


def print_table(rows: list[dict[str, Any]], console: Console | None = None) -> None:
    console = console or Console()
    console.print(table(rows))
    for line in heartbeat_lines(rows):
        console.print(line)
