"""Rank-0 side effects: console, progress bar and metrics.jsonl.

`Reporter` does its work on the main rank and nothing elsewhere, so nothing else checks ranks
for output. `TrainingLog` is the trainer callback that reports a run through it. Errors are not
routed here: every rank prints its own (see cli.main).
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

from multicard.atomic import write_text_atomic
from multicard.errors import UserError
from multicard.trainer import Callback, EvalResult, StepEnd, Trainer

REFRESH_S = 0.5  # progress bar redraw interval


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return float("inf")  # a line cut short by a crash: dropped


def _unwritable(path: Path, exc: OSError) -> UserError:
    reason = exc.strerror or type(exc).__name__
    return UserError(
        f"cannot write {path} ({reason}); free space in {path.parent} or choose another out_dir "
        f"(checkpoints written so far are intact)"
    )


class Reporter:
    def __init__(self, is_main: bool) -> None:
        self.is_main = is_main
        self.console = Console(highlight=False, soft_wrap=True)
        self._progress: Progress | None = None
        self._task: Any = None
        self._last_refresh = 0.0
        self._metrics = None
        self._metrics_path = Path()

    def open_metrics(self, path: Path, resumed_at: int | None) -> None:
        """Start metrics.jsonl, or continue it from step `resumed_at` of a resumed run: records of
        later steps (written after that checkpoint by a run that then crashed) are dropped, so no
        step is recorded twice."""
        if not self.is_main:
            return
        self._metrics_path = path
        try:
            if resumed_at is not None and path.is_file():
                kept = [line for line in path.read_text(encoding="utf-8").splitlines() if _step_of(line) <= resumed_at]
                write_text_atomic(path, "".join(line + "\n" for line in kept))
            self._metrics = open(path, "a" if resumed_at is not None else "w", encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise _unwritable(path, exc) from None

    def print(self, message: str) -> None:
        if self.is_main:
            self.console.print(message)

    def write_text(self, path: Path, text: str) -> None:
        if self.is_main:
            write_text_atomic(path, text)

    def record(self, kind: str, **fields: Any) -> None:
        """Append one JSON object to metrics.jsonl."""
        if self._metrics is not None:
            try:
                self._metrics.write(json.dumps({"kind": kind, **fields}) + "\n")
                self._metrics.flush()
            except OSError as exc:
                raise _unwritable(self._metrics_path, exc) from None

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
        self._metrics_path = Path()


def duration(seconds: float) -> str:
    """'2 h 05 min', '7 min 30 s', '45 s'."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s} s"


class TrainingLog(Callback):
    """Reports a run: a progress bar with ETA, a line per epoch, step and epoch records in
    metrics.jsonl, and early on one line saying how long the run will take."""

    ESTIMATE_AFTER_S = 10.0  # time the first steps this long (or ESTIMATE_AFTER_STEPS) before estimating
    ESTIMATE_AFTER_STEPS = 20

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.status = ""
        self._first: tuple[int, float] | None = None  # (step, time) after the first step, which warms up
        self._estimated = False

    def on_fit_start(self, trainer: Trainer) -> None:
        self.reporter.start_progress(trainer.schedule.total_steps, done=trainer.position.global_step)
        self._first, self._estimated = None, False

    def _estimate(self, trainer: Trainer, step: int) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = (step, now)
            return
        steps, elapsed = step - self._first[0], now - self._first[1]
        if elapsed < self.ESTIMATE_AFTER_S and steps < self.ESTIMATE_AFTER_STEPS:
            return
        self._estimated = True
        left = trainer.schedule.total_steps - step
        per_step = elapsed / steps
        self.reporter.print(
            f"estimated time: {duration(left * per_step)} for the {left} steps left ({per_step:.2f} s per step "
            f"so far, evaluation not counted); Ctrl-C stops with a checkpoint, the same command resumes"
        )

    def on_log(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.reporter.record("step", **record)
        self.status = f"loss {record['loss']:.4f}"
        if record.get("fp16_skipped"):
            skipped = record["fp16_skipped"]
            self.reporter.print(f"step {record['step']}: fp16 scaler skipped {skipped} NaN/inf micro-step(s)")

    def on_step_end(self, trainer: Trainer, step: StepEnd) -> None:
        self.reporter.advance(step.epoch, self.status)
        if not self._estimated:
            self._estimate(trainer, step.global_step)

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any], val: EvalResult | None, best: bool) -> None:
        self.reporter.record("epoch", **record)
        line = f"epoch {record['epoch']}: train loss {record['train_loss']:.4f} top-1 {record['train_top1']:.2f}%"
        if val is not None:
            line += f" | val loss {val.loss:.4f} top-1 {val.top1:.2f}% top-5 {val.top5:.2f}%"
        self.reporter.print(f"{line} | {record['img_per_s']:.0f} img/s, {record['epoch_s']:.1f} s")

    def on_fit_end(self, trainer: Trainer) -> None:
        self.reporter.stop_progress()
