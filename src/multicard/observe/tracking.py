"""Experiment trackers beside TensorBoard: MLflow (log.mlflow) and Weights & Biases (log.wandb).

`TrackerLog` is the TensorBoard callback with another writer: the trackers get exactly the
scalars TensorBoard gets, at the same steps (log steps and epoch ends, values already reduced:
no host sync of their own), from rank 0 only. Besides: the resolved config as parameters, the
final and best validation metrics, config.yaml and the report figure as files.

A resumed run continues the same tracker runs: their ids and the last step each kind of record
reached them are kept in out_dir/trackers.json, so the steps a crashed run sent after its last
checkpoint are not sent twice. A tracker that fails is dropped with one warning (metrics.jsonl
and TensorBoard go on), or ends the run where log.on_tracker_error=fail.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from multicard.base.atomic import write_text_atomic
from multicard.base.config import Config, LogConfig, to_dict
from multicard.base.errors import Stopped, UserError
from multicard.engine.loop import Loop, StepEnd
from multicard.engine.meters import EvalResult
from multicard.observe.run_records import run_figure
from multicard.observe.telemetry import TensorBoardLog

TRACKERS_FILE = "trackers.json"  # in out_dir: the runs a resumed run continues
# A tracker server that went away costs a few seconds once, not minutes of retries (the user's
# own MLFLOW_HTTP_* settings win)
MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}
MLFLOW_PARAMS_PER_CALL = 100  # MLflow's limit for one log_batch
MLFLOW_PARAM_CHARS = 6000  # MLflow's limit for a parameter's value
REASON_CHARS = 240  # of a tracker's error, in our one line


def flat_params(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """('train.epochs', 5), ... for a nested config."""
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from flat_params(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def wandb_mode(setting: str) -> str:
    """log.wandb_mode, where auto follows WANDB_MODE (online, offline, disabled, …) and is offline
    without it: nothing leaves the machine unless the user says so."""
    return setting if setting != "auto" else os.environ.get("WANDB_MODE") or "offline"


class MlflowRun:
    """One MLflow run, through MlflowClient (no global active run): the tracking URI of
    log.mlflow_uri, else MLFLOW_TRACKING_URI, else a local store in out_dir/mlruns."""

    name, key = "MLflow", "mlflow"

    def __init__(self, log: LogConfig, out_dir: Path, run_name: str, previous: dict[str, Any]) -> None:
        for var, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(var, value)
        self.uri = log.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or (out_dir / "mlruns").resolve().as_uri()
        if urlparse(self.uri).scheme in ("", "file"):  # a folder: MLflow 3 keeps its file store only on request
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if previous.get("run_id") and previous.get("uri") == self.uri:
            self.run_id, self.created = previous["run_id"], False
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment_name = log.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "multicard"
            experiment = self.client.get_experiment_by_name(experiment_name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            self.created = True

    def ids(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "uri": self.uri}

    def params(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:MLFLOW_PARAM_CHARS]) for k, v in flat_params(config)]
        for i in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i : i + MLFLOW_PARAMS_PER_CALL])

    def metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    summary = metrics  # MLflow keeps the final metrics as metrics

    def file(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, {"done": "FINISHED", "stopped": "KILLED"}.get(outcome, "FAILED"))


class WandbRun:
    """One W&B run in out_dir/wandb: offline unless log.wandb_mode or WANDB_MODE says online
    (`wandb sync out_dir/wandb/offline-run-*` uploads offline runs later, resumed parts into one)."""

    name, key = "W&B", "wandb"

    def __init__(self, log: LogConfig, out_dir: Path, run_name: str, previous: dict[str, Any]) -> None:
        import wandb

        mode = wandb_mode(log.wandb_mode)
        self.created = not previous.get("run_id")
        self.run = wandb.init(
            project=log.wandb_project or os.environ.get("WANDB_PROJECT") or "multicard",
            name=run_name,
            id=previous.get("run_id"),
            resume="allow",
            dir=str(out_dir),
            mode=mode,  # type: ignore[arg-type]  # log.wandb_mode or WANDB_MODE: a string wandb checks itself
            # Its console capture would wrap multicard's output; git lookups and system sampling cost
            # start-up time and CPU that the run's steps are measured against.
            settings=wandb.Settings(console="off", silent=True, disable_git=True, x_disable_stats=True),
        )

    def ids(self) -> dict[str, Any]:
        return {"run_id": self.run.id}

    def params(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def summary(self, step: int, values: dict[str, float]) -> None:
        self.run.summary.update(values)

    def file(self, path: Path) -> None:
        copy = Path(self.run.dir) / path.name  # a copy, as the run's files are (a link would change with out_dir)
        shutil.copy2(path, copy)
        self.run.save(str(copy), base_path=self.run.dir, policy="now")

    def finish(self, outcome: str) -> None:
        self.run.finish(exit_code=0 if outcome in ("done", "stopped") else 1)


TRACKERS: dict[str, type[MlflowRun] | type[WandbRun]] = {"mlflow": MlflowRun, "wandb": WandbRun}  # by config key


class TrackerWriter:
    """What TensorBoardLog writes to, for the trackers: a step's scalars gathered and sent in one
    call each. A tracker that fails is dropped (see Trackers.attempt)."""

    def __init__(self, trackers: Trackers) -> None:
        self.trackers = trackers
        self.step: int | None = None
        self.values: dict[str, float] = {}
        self.due: list[Any] = []  # the runs the record being written goes to

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if step != self.step:
            self.send()
            self.step = step
        self.values[tag] = value

    def send(self) -> None:
        if self.values and self.step is not None:
            step, values = self.step, self.values
            self.trackers.each("log metrics", lambda run: run.metrics(step, values), only=lambda run: run in self.due)
        self.values = {}

    flush = close = send  # what TensorBoardLog calls on its writer


class Trackers:
    """The tracker runs of rank 0, started (or continued) at construction; a failure is one
    warning and the tracker is dropped, or a UserError where log.on_tracker_error=fail."""

    def __init__(self, log: LogConfig, out_dir: Path, resumed: bool) -> None:
        self.log = log
        self.path = out_dir / TRACKERS_FILE
        self.state: dict[str, Any] = self._read() if resumed else {}
        self.runs: list[Any] = []
        for key in (k for k in TRACKERS if getattr(log, k)):
            previous = self.state.get(key, {})
            run = self.attempt(key, "start a run", partial(TRACKERS[key], log, out_dir, out_dir.name, previous))
            if run is not None:
                self.runs.append(run)
                # continued: the steps it has already are not sent again
                self.state[key] = {**(previous if not run.created else {}), **run.ids()}
        self.save()

    def _read(self) -> dict[str, Any]:
        try:
            state = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}  # none yet, or not ours: new tracker runs
        return state if isinstance(state, dict) else {}

    def save(self) -> None:
        write_text_atomic(self.path, json.dumps(self.state, indent=1) + "\n")

    def sent_until(self, key: str, kind: str) -> int:
        """The last step of `kind` ('step' or 'epoch' records) that reached tracker `key`."""
        return int(self.state.get(key, {}).get(kind, -1))

    def mark(self, kind: str, step: int) -> None:
        for run in self.runs:  # those that took it (a failed one was dropped)
            self.state[run.key][kind] = max(step, self.sent_until(run.key, kind))
        self.save()

    def attempt(self, key: str, what: str, call: Callable[[], Any]) -> Any:
        name = TRACKERS[key].name
        try:
            return call()
        except Exception as exc:  # the tracker's own errors (network, server, its API): none ends training
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            reason = reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS] + "…"
            if self.log.on_tracker_error == "fail":
                raise UserError(
                    f"{name} failed to {what} ({reason}); make the tracker reachable, set log.{key}=false, "
                    f"or set log.on_tracker_error=warn to train on without it"
                ) from None
            print(
                f"multicard: warning: {name} failed to {what} ({reason}); training goes on without it "
                f"(metrics.jsonl and TensorBoard keep every record); log.on_tracker_error=fail stops the run instead",
                file=sys.stderr,
                flush=True,
            )
            self.runs = [r for r in self.runs if r.key != key]
            return None

    def each(self, what: str, call: Callable[[Any], Any], only: Callable[[Any], bool] = lambda run: True) -> None:
        for run in list(self.runs):
            if only(run):
                self.attempt(run.key, what, partial(call, run))


class TrackerLog(TensorBoardLog):
    """The trackers' callback: TensorBoardLog's scalars, written to the trackers (rank 0 only;
    other ranks hold no writer and do nothing)."""

    def __init__(self, cfg: Config, out_dir: Path, is_main: bool, resumed_at: int | None) -> None:
        self.writer = None  # TensorBoardLog's scalars go here: a TrackerWriter on rank 0
        self.out_dir = out_dir
        self.last_val: EvalResult | None = None
        self.trackers: Trackers | None = None
        self.config_sent = False  # config.yaml is uploaded once written, after the first step (Reporter.run_files)
        if not is_main:
            return
        self.trackers = Trackers(cfg.log, out_dir, resumed=resumed_at is not None)
        self.writer = TrackerWriter(self.trackers)
        config = to_dict(cfg)
        self.trackers.each("log the config", lambda run: run.params(config), only=lambda run: run.created)

    def _send(self, kind: str, step: int, write: Callable[[], None]) -> None:
        """Write a record's scalars to the trackers it has not reached yet (a run that crashed after
        its last checkpoint sent some already), then note that it reached them."""
        if self.trackers is None or self.writer is None:
            return
        due = [run for run in self.trackers.runs if step > self.trackers.sent_until(run.key, kind)]
        if due:
            self.writer.due = due
            write()
            self.writer.send()
            self.trackers.mark(kind, step)

    def on_log(self, loop: Loop, record: dict[str, Any]) -> None:
        self._send("step", record["step"], lambda: super(TrackerLog, self).on_log(loop, record))

    def on_step_end(self, loop: Loop, step: StepEnd) -> None:
        if self.trackers is not None and not self.config_sent:  # after TrainingLog's on_step_end, which writes it
            self.config_sent = True
            self._file(self.out_dir / "config.yaml", "upload config.yaml")

    def on_epoch_end(self, loop: Loop, record: dict[str, Any], val: EvalResult | None, best: bool) -> None:
        if val is not None:
            self.last_val = val
        self._send("epoch", record["step"], lambda: super(TrackerLog, self).on_epoch_end(loop, record, val, best))

    def on_fit_end(self, loop: Loop) -> None:
        if self.trackers is None:
            return
        ending = loop.ending  # the exception that ended training, if any
        if ending is None or (isinstance(ending, Stopped) and loop.finished):  # a stop on the last step: done
            outcome = "done"
            if loop.finished:
                self._summary(loop)
        else:
            outcome = "stopped" if isinstance(ending, Stopped) else "failed"
        figure = run_figure(self.out_dir) if outcome != "failed" else None  # `multicard report`'s, as report.png
        if figure is not None:
            self._file(figure, "upload report.png")
        self.trackers.each("end its run", lambda run: run.finish(outcome))

    def _summary(self, loop: Loop) -> None:
        assert self.trackers is not None
        values: dict[str, float] = {}
        if self.last_val is not None:
            v = self.last_val
            values.update({"final/val_loss": v.loss, "final/val_top1": v.top1, "final/val_top5": v.top5})
        monitor: Any = loop.components.get("best")  # the run's Monitor (best=KEY): a checkpoint part, so the
        if monitor is not None and monitor.best is not None:  # best of the whole run, resumes included
            values[f"best/{monitor.key}"] = monitor.best
        if values:
            step = loop.position.global_step
            self.trackers.each("log the final metrics", lambda run: run.summary(step, values))

    def _file(self, path: Path, what: str) -> None:
        assert self.trackers is not None
        self.trackers.each(what, lambda run: run.file(path))
