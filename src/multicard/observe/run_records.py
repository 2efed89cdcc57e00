"""What a run wrote, read back: its records from metrics.jsonl (`load_run`), a summary line, and
the figure `multicard report` draws and trackers upload (loss and top-1 per log step and epoch,
learning rate, img/s, each rank's step time).
"""


from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multicard.base.errors import UserError


@dataclass
class Run:
    name: str
    steps: list[dict[str, Any]] = field(default_factory=list)  # "step" records
    epochs: list[dict[str, Any]] = field(default_factory=list)  # "epoch" records
    stragglers: list[dict[str, Any]] = field(default_factory=list)


# Fields each kind of record must hold as numbers for the summary and the figure; a record
# without them (or with a string where a number goes) is skipped like a line a crash cut short.
NEEDED = {
    "step": ("step", "loss", "top1", "lr", "img_per_s"),
    "epoch": ("epoch", "step"),
    "straggler": ("step", "rank"),
}
NUMERIC = ("epoch_s", "step_ms", "val_top1", "val_loss", "train_loss", "train_top1")  # optional, else null


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _readable(record: Any) -> bool:
    if not isinstance(record, dict):
        return False
    kind = record.get("kind")
    if kind is not None and not isinstance(kind, str):
        return False  # a kind that names none (a list is not even a key of one)
    needed = NEEDED.get(kind, ()) if kind is not None else ()
    return all(_number(record.get(k)) for k in needed) and all(
        record.get(k) is None or _number(record[k]) for k in NUMERIC
    )


def load_run(run_dir: Path) -> Run:
    """A run's records. Lines that are not records (cut short by a crash, edited, another file's)
    are skipped, and one warning says how many."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{run_dir} holds no metrics.jsonl; give the out_dir of a multicard run")
    run = Run(run_dir.name if run_dir.name not in ("", ".") else str(run_dir))
    kinds = {"step": run.steps, "epoch": run.epochs, "straggler": run.stragglers}
    skipped = 0
    for line in metrics.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not _readable(record):
            skipped += bool(line.strip())
            continue
        kinds.get(record.get("kind"), []).append(record)
    if skipped:
        print(
            f"multicard: warning: skipped {skipped} unreadable line(s) of {metrics} (cut short, not a JSON "
            f"record, or a value that is not a number)",
            file=sys.stderr,
        )
    if not run.steps and not run.epochs:
        raise UserError(f"{metrics} holds no step or epoch records yet; report a run that has trained")
    return run


def summary(run: Run) -> str:
    """'name: best val top-1 93.10% (epoch 9), final 93.10%; 640 steps in 31.2 s at 2115 img/s'."""
    parts = [f"{run.name}:"]
    vals = [e for e in run.epochs if e.get("val_top1") is not None and math.isfinite(e["val_top1"])]
    if vals:
        best = max(vals, key=lambda e: e["val_top1"])
        final = vals[-1]["val_top1"]
        parts.append(f"best val top-1 {best['val_top1']:.2f}% (epoch {best['epoch']}), final {final:.2f}%;")
    last_step = max((r["step"] for r in run.steps + run.epochs), default=0)
    seconds = sum(e.get("epoch_s", 0.0) for e in run.epochs)
    rates = [r["img_per_s"] for r in run.steps if r.get("img_per_s")]
    parts.append(f"{last_step} steps")
    if seconds:
        parts.append(f"in {seconds:.1f} s")
    if rates:
        parts.append(f"at {statistics.median(rates):.0f} img/s (median)")
    if run.stragglers:
        named = ", ".join(f"rank {s['rank']}" for s in run.stragglers)
        parts.append(f"; stragglers: {named}")
    return " ".join(parts)


def figure(runs: list[Run]) -> Any:
    """The matplotlib figure of the runs (each run one colour; validation dashed)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    loss, top1, lr, speed, rank_time, unused = axes.flat
    unused.axis("off")
    for i, run in enumerate(runs):
        colour = f"C{i % 10}"
        steps = [r["step"] for r in run.steps]
        loss.plot(steps, [r["loss"] for r in run.steps], color=colour, label=f"{run.name} train")
        top1.plot(steps, [r["top1"] for r in run.steps], color=colour, label=f"{run.name} train")
        lr.plot(steps, [r["lr"] for r in run.steps], color=colour, label=run.name)
        speed.plot(steps, [r["img_per_s"] for r in run.steps], color=colour, label=run.name)
        vals = [e for e in run.epochs if e.get("val_loss") is not None]
        if vals:
            at = [e["step"] for e in vals]
            style = {"color": colour, "linestyle": "--", "marker": "o", "label": f"{run.name} val"}
            loss.plot(at, [e["val_loss"] for e in vals], **style)
            top1.plot(at, [e["val_top1"] for e in vals], **style)
        ranked = [(r["step"], r.get("ranks") or [{"step_ms": r["step_ms"]}]) for r in run.steps if "step_ms" in r]
        for rank in range(len(ranked[0][1]) if ranked else 0):
            times = [ranks[rank]["step_ms"] for _, ranks in ranked]
            rank_time.plot([step for step, _ in ranked], times, color=colour, alpha=0.4 + 0.6 / (rank + 1),
                           label=f"{run.name} rank {rank}")  # fmt: skip
        for s in run.stragglers:
            rank_time.axvline(s["step"], color=colour, linestyle=":", linewidth=1)
    for ax, title, ylabel in (
        (loss, "Loss", "cross-entropy"),
        (top1, "Top-1", "%"),
        (lr, "Learning rate", "lr"),
        (speed, "Throughput", "images / s"),
        (rank_time, "Step time per rank", "ms"),
    ):
        ax.set(title=title, xlabel="optimizer step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def run_figure(run_dir: Path) -> Path | None:
    """This run's figure as run_dir/report.png (what trackers upload at the end); None when the
    run has no records yet or the folder cannot take the file (the checkpoints' writes say so)."""
    try:
        fig = figure([load_run(run_dir)])
    except UserError:
        return None
    import matplotlib.pyplot as plt

    target = run_dir / "report.png"
    try:
        fig.savefig(target, dpi=110)
    except OSError:
        return None
    finally:
        plt.close(fig)
    return target
