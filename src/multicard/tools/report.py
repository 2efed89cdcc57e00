"""`multicard report RUN_DIR [RUN_DIR ...]`: pictures and a summary of runs, from metrics.jsonl.

One figure overlays every run: loss and top-1 (training per log step, validation per epoch),
learning rate, img/s, and each rank's step time. The summary gives per run its best and final
validation top-1, training time and throughput.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from multicard.base.errors import UserError
from multicard.observe.run_records import figure, load_run, summary


def report(run_dirs: list[str], out: str) -> Any:
    """Print each run's summary, write the figure to `out`; the figure."""
    target = Path(out).expanduser()
    if target.is_dir():
        raise UserError(f"--out {out} is a directory; give a file name, e.g. {Path(out) / 'report.png'}")
    folder = next(parent for parent in target.parents if parent.exists())
    if not folder.is_dir():
        raise UserError(f"--out {out}: {folder} is a file, not a folder; choose another path")
    runs = [load_run(Path(d)) for d in run_dirs]
    for run in runs:
        print(summary(run))
    fig = figure(runs)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, dpi=110)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UserError(f"--out {out} cannot be written ({reason}); choose another path") from None
    except ValueError as exc:  # matplotlib knows no such format
        raise UserError(f"--out {out}: {exc}; give a .png file name") from None
    print(f"wrote {target}")
    return fig
