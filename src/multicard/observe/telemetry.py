"""Rank-0 side effects: console, progress bar, metrics.jsonl and TensorBoard.

`Reporter` does its work on the main rank and nothing elsewhere, so nothing else checks ranks
for output. `TrainingLog` is the loop's callback that reports a run through it (with the
straggler and data-bound notes), `TensorBoardLog` the one that writes TensorBoard's scalars.
Errors are not routed here: every rank prints its own (see cli.main).
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from multicard.base.atomic import probe_write, write_text_atomic
from multicard.base.config import DataConfig
from multicard.base.errors import UserError
from multicard.data.augmentation.transforms import is_small
from multicard.engine.loop import Callback, Loop, StepEnd
from multicard.engine.meters import EvalResult

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
    """Console, progress bar and metrics.jsonl: given the process context's `is_main`, it does its
    work on the main rank and nothing on the others."""

    def __init__(self, is_main: bool) -> None:
        self.is_main = is_main
        self.console = Console(highlight=False, soft_wrap=True)
        self._progress: Progress | None = None
        self._task: Any = None
        self._last_refresh = 0.0
        self._metrics: TextIO | None = None
        self._metrics_path = Path()
        self._due: tuple[Path, int | None, dict[Path, str]] | None = None  # run files not written yet

    def run_files(self, metrics: Path, resumed_at: int | None, texts: dict[Path, str]) -> None:
        """metrics.jsonl (`open_metrics`) and the files `texts` (config.yaml), written once the run
        has trained a step (`write_run_files`): a run refused before then (a tracker that cannot be
        reached, a bad item in the first batch) leaves its out_dir as it found it."""
        if self.is_main:
            self._due = (metrics, resumed_at, texts)

    def write_run_files(self) -> None:
        """Write the files `run_files` holds back, once (called after each step, and before a record)."""
        if self._due is not None:
            metrics, resumed_at, texts = self._due
            self._due = None
            self.open_metrics(metrics, resumed_at)
            for path, text in texts.items():
                write_text_atomic(path, text)

    def open_metrics(self, path: Path, resumed_at: int | None) -> None:
        """Start metrics.jsonl, or continue it from step `resumed_at` of a resumed run: records of
        later steps (written after that checkpoint by a run that then crashed) are dropped, so no
        step is recorded twice."""
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

    def record(self, kind: str, **fields: Any) -> None:
        """Append one JSON object to metrics.jsonl."""
        self.write_run_files()
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
            fields: dict[str, Any] = {"status": status} if status is not None else {}  # the bar's own field
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


# Keys of step and epoch records that are not a run's logged values (timings, rates, positions).
RECORD_KEYS = frozenset({
    "epoch", "step", "lr", "img_per_s", "data_ms", "compute_ms", "comm_exposed_ms", "optimizer_ms", "step_ms",
    "ranks", "fp16_skipped", "epoch_s", "peak_mem_mb",
})  # fmt: skip


def logged(record: dict[str, Any]) -> dict[str, float]:
    """The values a record reports about training (loss, top-1, a user's run.log values)."""
    return {k: v for k, v in record.items() if k not in RECORD_KEYS and isinstance(v, (int, float))}


def duration(seconds: float) -> str:
    """'2 h 05 min', '7 min 30 s', '45 s'."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s} s"


class Stragglers:
    """A rank that waits for its data, or is busy (not waiting for the others), ≥ RATIO × the
    median rank over WINDOW step records is named once: under DDP every rank's step takes as long
    as the slowest one's, and the others' wait for it can hide anywhere in theirs (a BatchNorm
    buffer broadcast makes them wait inside forward)."""

    RATIO, WINDOW = 1.2, 3
    SIGNIFICANT = 0.05  # a data wait below this share of the step is no one's bottleneck

    def __init__(self) -> None:
        self.window: deque[list[dict[str, float]]] = deque(maxlen=self.WINDOW)
        self.named: set[int] = set()

    def update(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """New stragglers after this record, as records for metrics.jsonl."""
        ranks = record.get("ranks")
        if not ranks:
            return []
        self.window.append(ranks)
        if len(self.window) < self.WINDOW:
            return []

        def mean(key: str) -> list[float]:
            return [statistics.mean(w[r][key] for w in self.window) for r in range(len(ranks))]

        busy, data, step = mean("busy_ms"), mean("data_ms"), mean("step_ms")
        median_busy, median_data = statistics.median(busy), statistics.median(data)
        found = []
        for rank in range(len(ranks)):
            slow_data = data[rank] >= self.RATIO * median_data and data[rank] >= self.SIGNIFICANT * step[rank]
            slow_work = median_busy > 0 and busy[rank] >= self.RATIO * median_busy
            if rank not in self.named and (slow_data or slow_work):
                self.named.add(rank)
                found.append({"step": record["step"], "rank": rank, "busy_ms": round(busy[rank], 1),
                              "median_busy_ms": round(median_busy, 1), "data_ms": round(data[rank], 1),
                              "median_data_ms": round(median_data, 1)})  # fmt: skip
        return found


class DataBound:
    """Says once when waiting for data takes more than SHARE of the step on some rank, over WINDOW
    step records: the input pipeline, not the model, sets the pace. The advice fits the loader
    that runs: `loader` is device (batches made in the training process), workers, or user (a
    user's loop, multicard.Run's run.loader)."""

    SHARE, WINDOW = 0.10, 3

    def __init__(self, data: DataConfig, loader: str) -> None:
        self.data, self.loader = data, loader
        self.window: deque[tuple[float, int]] = deque(maxlen=self.WINDOW)  # (worst share, its rank)
        self.said = False

    def update(self, record: dict[str, Any]) -> str | None:
        ranks = record.get("ranks") or [{"step_ms": record.get("step_ms", 0.0), "data_ms": record.get("data_ms", 0.0)}]
        shares = [r["data_ms"] / r["step_ms"] if r["step_ms"] else 0.0 for r in ranks]
        worst = max(range(len(shares)), key=shares.__getitem__)
        self.window.append((shares[worst], worst))
        if self.said or len(self.window) < self.WINDOW or min(share for share, _ in self.window) <= self.SHARE:
            return None
        self.said = True
        share = statistics.mean(share for share, _ in self.window)
        return (
            f"the input pipeline holds training back: waiting for data takes {share:.0%} of each step "
            f"(rank {worst}, up to step {record['step']}); {self.advice()}"
        )

    def advice(self) -> str:
        d = self.data
        if self.loader == "user":
            return "give run.loader more loader processes (num_workers=N), or make the dataset's items cheaper"
        if self.loader == "device":
            one_by_one = d.policy != "none" or d.color_jitter > 0 or d.random_erasing > 0
            each = " (data.policy, data.color_jitter and data.random_erasing one image at a time)" if one_by_one else ""
            return (
                f"data.loader=device makes the batches in the training process{each}: data.loader=workers makes "
                f"them in loader processes, beside training; multicard input-split shows where the input time goes"
            )
        device = ", or data.loader=device for images of up to 64 px" if is_small(d.image_size) else ""
        return (
            f"try more loader processes (data.num_workers, now {d.num_workers}), data.decode=gpu for JPEGs on "
            f"CUDA{device}; multicard input-split shows where the input time goes"
        )


class TrainingLog(Callback):
    """Reports a run: a progress bar with ETA, a line per epoch, step and epoch records in
    metrics.jsonl, and early on one line saying how long the run will take."""

    ESTIMATE_AFTER_S = 10.0  # time the first steps this long (or ESTIMATE_AFTER_STEPS) before estimating
    ESTIMATE_AFTER_STEPS = 20

    def __init__(self, reporter: Reporter, data: DataConfig, loader: str) -> None:
        self.reporter = reporter
        self.status = ""
        self._first: tuple[int, float] | None = None  # (step, time) after the first step, which warms up
        self._estimated = False
        self.stragglers = Stragglers()
        self.data_bound = DataBound(data, loader)

    def on_fit_start(self, loop: Loop) -> None:
        self.reporter.start_progress(loop.schedule.total_steps, done=loop.position.global_step)
        self._first, self._estimated = None, False

    def _estimate(self, loop: Loop, step: int) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = (step, now)
            return
        steps, elapsed = step - self._first[0], now - self._first[1]
        if elapsed < self.ESTIMATE_AFTER_S and steps < self.ESTIMATE_AFTER_STEPS:
            return
        self._estimated = True
        left = loop.schedule.total_steps - step
        per_step = elapsed / steps
        self.reporter.print(
            f"estimated time: {duration(left * per_step)} for the {left} steps left ({per_step:.2f} s per step "
            f"so far, evaluation not counted); Ctrl-C stops with a checkpoint, the same command resumes"
        )

    def on_log(self, loop: Loop, record: dict[str, Any]) -> None:
        self.reporter.record("step", **record)
        self.status = "  ".join(f"{name} {value:.4g}" for name, value in logged(record).items())
        if record["step"] > loop.schedule.log_every:  # the first window holds the warm-up
            for found in self.stragglers.update(record):
                self.reporter.record("straggler", **found)
                self.reporter.print(
                    f"straggler: rank {found['rank']} waits {found['data_ms']:.0f} ms per step for data (median rank "
                    f"{found['median_data_ms']:.0f} ms) and is busy {found['busy_ms']:.0f} ms (median "
                    f"{found['median_busy_ms']:.0f} ms); the other ranks wait for it in every step"
                )
            note = self.data_bound.update(record)
            if note is not None:
                self.reporter.record("data_bound", step=record["step"], message=note)
                self.reporter.print(note)
        if record.get("fp16_skipped"):
            skipped = record["fp16_skipped"]
            self.reporter.print(f"step {record['step']}: fp16 scaler skipped {skipped} NaN/inf micro-step(s)")

    def on_step_end(self, loop: Loop, step: StepEnd) -> None:
        self.reporter.write_run_files()  # the run has trained a step: its files are due
        self.reporter.advance(step.epoch, self.status)
        if not self._estimated:
            self._estimate(loop, step.global_step)

    def on_epoch_end(self, loop: Loop, record: dict[str, Any], val: EvalResult | None, best: bool) -> None:
        self.reporter.record("epoch", **record)
        if "train_loss" not in record:  # a user's loop (multicard.Run): the values it logged
            values = "".join(f"{name} {value:.4g} | " for name, value in logged(record).items())
            rate = f"{record['img_per_s']:.0f} img/s, {record['epoch_s']:.1f} s"
            self.reporter.print(f"epoch {record['epoch']}: {values}{rate}")
            return
        line = f"epoch {record['epoch']}: train loss {record['train_loss']:.4f} top-1 {record['train_top1']:.2f}%"
        if val is not None:
            line += f" | val loss {val.loss:.4f} top-1 {val.top1:.2f}% top-5 {val.top5:.2f}%"
        if "ema_val_top1" in record:
            line += f" | EMA top-1 {record['ema_val_top1']:.2f}%"
        self.reporter.print(f"{line} | {record['img_per_s']:.0f} img/s, {record['epoch_s']:.1f} s")

    def on_fit_end(self, loop: Loop) -> None:
        self.reporter.stop_progress()


class TensorBoardLog(Callback):
    """Scalars for TensorBoard in `folder`, written by rank 0: train loss/top-1, lr, img/s, the
    step-time split and each rank's step time at log steps; validation and peak memory at epoch
    ends. A resumed run purges what a crashed one wrote after its checkpoint, so each curve
    continues without duplicate steps. The event file is made with the first scalars: a run
    refused before its first step leaves none."""

    _open: Callable[[], Any] | None = None  # makes the writer, until it is made

    def __init__(self, folder: Path, is_main: bool, resumed_at: int | None) -> None:
        self.writer: Any = None  # torch's SummaryWriter (an optional extra's)
        if not is_main:
            return
        summary_writer = tensorboard_writer()
        purge_step = resumed_at + 1 if resumed_at is not None else None

        def open_writer() -> Any:
            try:
                return summary_writer(str(folder), purge_step=purge_step)
            except OSError as exc:  # checked before training (check_tensorboard_folder); changed since
                raise _tensorboard_unwritable(folder, exc) from None

        self._open = open_writer

    def _scalars(self, step: int, values: dict[str, float | None]) -> None:
        if self.writer is None and self._open is not None:
            self.writer, self._open = self._open(), None
        if self.writer is not None:
            for tag, value in values.items():
                if value is not None:
                    self.writer.add_scalar(tag, value, step)

    def on_log(self, loop: Loop, record: dict[str, Any]) -> None:
        step = record["step"]
        self._scalars(step, {
            **{f"train/{name}": value for name, value in logged(record).items()}, "train/lr": record["lr"],
            "train/img_per_s": record["img_per_s"], "time/data_ms": record.get("data_ms"),
            "time/compute_ms": record.get("compute_ms"), "time/comm_exposed_ms": record.get("comm_exposed_ms"),
            "time/optimizer_ms": record.get("optimizer_ms"), "time/step_ms": record.get("step_ms"),
        })  # fmt: skip
        for rank, r in enumerate(record.get("ranks", [])):
            self._scalars(step, {f"rank_step_ms/rank_{rank}": r["step_ms"]})

    def on_epoch_end(self, loop: Loop, record: dict[str, Any], val: EvalResult | None, best: bool) -> None:
        if "train_loss" in record:
            values: dict[str, float | None] = {
                "train/epoch_loss": record["train_loss"],
                "train/epoch_top1": record["train_top1"],
            }
        else:  # a user's loop (multicard.Run): the epoch's mean of each value it logged
            values = {f"epoch/{name}": value for name, value in logged(record).items()}
        if val is not None:
            values.update({"val/loss": val.loss, "val/top1": val.top1, "val/top5": val.top5})
        averaged = {f"ema_val/{k}": record.get(f"ema_val_{k}") for k in ("loss", "top1", "top5")}  # ema.decay
        values.update({k: v for k, v in averaged.items() if v is not None})
        values.update({f"memory/peak_mb/device_{i}": mb for i, mb in enumerate(record["peak_mem_mb"])})
        self._scalars(record["step"], values)
        if self.writer is not None:
            self.writer.flush()

    def on_fit_end(self, loop: Loop) -> None:
        if self.writer is not None:
            self.writer.close()


def tensorboard_writer() -> Any:
    """torch's SummaryWriter, or a one-line error naming the extra that provides TensorBoard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError(
            "log.tensorboard=true needs TensorBoard: pip install 'multicard[tensorboard]' "
            "(or set log.tensorboard=false)"
        ) from None
    return SummaryWriter


def _tensorboard_unwritable(folder: Path, exc: OSError) -> UserError:
    reason = exc.strerror or type(exc).__name__
    return UserError(
        f"log.tensorboard=true cannot write {folder} ({reason}); make it a writable folder, "
        f"choose another out_dir, or set log.tensorboard=false"
    )


def check_tensorboard_folder(folder: Path) -> None:
    """out_dir/tensorboard can take TensorBoard's event files: checked before anything starts, by
    the launcher as by each rank, because only rank 0 writes there and would fail alone, mid-run.
    A file is written and removed to see, as permission bits do not tell (root, read-only mounts)."""
    if folder.exists() and not folder.is_dir():
        raise UserError(
            f"{folder} is a file, not a folder for TensorBoard's event files; move it away, choose another "
            f"out_dir, or set log.tensorboard=false"
        )
    where = folder if folder.is_dir() else folder.parent
    if not where.is_dir():
        return  # out_dir does not exist yet: it is made (and checked) by prepare_out_dir
    try:
        probe_write(where)
    except OSError as exc:
        raise _tensorboard_unwritable(folder, exc) from None
