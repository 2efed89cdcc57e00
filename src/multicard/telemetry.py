"""Rank-0 side effects: console, progress bar and metrics.jsonl.

`Reporter` does its work on the main rank and nothing elsewhere, so the engine never checks
ranks itself. Errors are not routed here: every rank prints its own (see cli.main).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

REFRESH_S = 0.5  # progress bar redraw interval


class Reporter:
    def __init__(self, is_main: bool, out_dir: Path | None) -> None:
        self.is_main = is_main
        self.console = Console(highlight=False, soft_wrap=True)
        self._progress: Progress | None = None
        self._task: Any = None
        self._last_refresh = 0.0
        self._metrics = None
        if out_dir is not None:
            self.open_metrics(out_dir / "metrics.jsonl", append=False)

    def open_metrics(self, path: Path, append: bool) -> None:
        """Start metrics.jsonl, or continue it when the run resumes."""
        if self.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._metrics = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115

    def print(self, message: str) -> None:
        if self.is_main:
            self.console.print(message)

    def write_text(self, path: Path, text: str) -> None:
        if self.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")

    def record(self, kind: str, **fields: Any) -> None:
        """Append one JSON object to metrics.jsonl."""
        if self._metrics is not None:
            self._metrics.write(json.dumps({"kind": kind, **fields}) + "\n")
            self._metrics.flush()

    def start_progress(self, total_steps: int, done: int = 0) -> None:
        if not self.is_main:
            return
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
            auto_refresh=False,  # a refresh thread would steal CPU from training; see advance()
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=total_steps, completed=done, status="")
        self._last_refresh = time.monotonic()

    def advance(self, epoch: int, status: str | None = None) -> None:
        if self._progress is not None:
            fields = {"status": status} if status is not None else {}
            self._progress.update(self._task, advance=1, description=f"epoch {epoch}", **fields)
            now = time.monotonic()
            if now - self._last_refresh >= REFRESH_S:
                self._last_refresh = now
                self._progress.refresh()

    def stop_progress(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def close(self) -> None:
        self.stop_progress()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
