"""The sections of what a run tells: debug (stall reports) and log (TensorBoard, trackers), with their rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from multicard.base.config.rules import choice
from multicard.base.errors import UserError


@dataclass(frozen=True)
class DebugConfig:
    # Seconds without progress on any rank before a stall is reported (stacks of every rank in
    # out_dir/stall/); auto: the larger of 120 s and 20 × the median step, from the first step on; 0: off
    stall_s: Any = "auto"
    on_stall: str = "report"  # report: say it and keep waiting | abort: end the job (exit 5)

    def check(self) -> None:
        choice(self.on_stall, "debug.on_stall", ("report", "abort"))
        stall_seconds(self)


def stall_seconds(debug: DebugConfig) -> float | None:
    """debug.stall_s as seconds; None for auto (decided from step times), 0 for off."""
    if debug.stall_s == "auto":
        return None
    if isinstance(debug.stall_s, bool) or not isinstance(debug.stall_s, (int, float)) or debug.stall_s < 0:
        raise UserError(f"debug.stall_s={debug.stall_s} must be auto, 0 (off) or a number of seconds")
    return float(debug.stall_s)


@dataclass(frozen=True)
class LogConfig:
    tensorboard: bool = False  # scalars in out_dir/tensorboard (rank 0; pip install 'multicard[tensorboard]')
    # Experiment trackers, rank 0, TensorBoard's scalars at its steps plus config, final metrics, report
    # figure (docs/tracking.md). MLflow: pip install 'multicard[mlflow]'
    mlflow: bool = False
    mlflow_uri: str | None = None  # tracking URI; None: MLFLOW_TRACKING_URI, else out_dir/mlruns
    mlflow_experiment: str | None = None  # None: MLFLOW_EXPERIMENT_NAME, else multicard
    wandb: bool = False  # Weights & Biases in out_dir/wandb: pip install 'multicard[wandb]'
    wandb_project: str | None = None  # None: WANDB_PROJECT, else multicard
    wandb_mode: str = "auto"  # auto: WANDB_MODE, else offline (sync later: wandb sync) | offline | online
    on_tracker_error: str = "warn"  # warn: one warning, train on without that tracker | fail: end the run (exit 2)

    def check(self) -> None:
        choice(self.wandb_mode, "log.wandb_mode", ("auto", "offline", "online"))
        choice(self.on_tracker_error, "log.on_tracker_error", ("warn", "fail"))
