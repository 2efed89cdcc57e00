"""The training and evaluation loops, driven through a Strategy.

Host syncs happen only at logging intervals and epoch ends: per-step statistics stay on the
device until then. Every control-flow decision (NaN stop, best checkpoint) is taken from
values already reduced across ranks, so all ranks decide alike.
"""

from __future__ import annotations

import math
import random
import resource
import signal
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig

from multicard import checkpoint
from multicard.config import to_dict
from multicard.errors import TrainingDiverged
from multicard.precision import Precision
from multicard.stopping import GracefulStop, Stopped
from multicard.strategy import Strategy
from multicard.telemetry import Reporter


@dataclass(frozen=True)
class EvalResult:
    loss: float
    top1: float  # percent
    top5: float  # percent
    samples: int

    def as_dict(self) -> dict[str, Any]:
        return {"top1": self.top1, "top5": self.top5, "loss": self.loss, "samples": self.samples}


def logits_for_loss(out: torch.Tensor) -> torch.Tensor:
    # Reduced-precision logits are upcast so the loss and its statistics are computed in fp32.
    return out if out.dtype in (torch.float32, torch.float64) else out.float()


def prepare_input(x: torch.Tensor, precision: Precision, channels_last: bool) -> torch.Tensor:
    if precision.param_dtype != torch.float32:
        x = x.to(precision.param_dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    strategy: Strategy,
    channels_last: bool = False,
) -> EvalResult:
    """Exact metrics: each rank sums (loss, correct@1, correct@5, count) over its own share,
    then the sums are reduced. No sample is padded or counted twice."""
    was_training = model.training
    model.eval()
    device = strategy.ctx.device
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    for x, y in batches:
        x = prepare_input(x, strategy.precision, channels_last)
        with strategy.precision.autocast():
            out = model(x)
        logits = logits_for_loss(out)
        k = min(5, logits.shape[1])
        topk = logits.topk(k, dim=1).indices
        hits = topk == y.view(-1, 1)
        totals[0] += F.cross_entropy(logits, y, reduction="sum").double()
        totals[1] += hits[:, 0].sum()
        totals[2] += hits.any(dim=1).sum()
        totals[3] += y.numel()
    strategy.all_reduce_sum(totals)
    loss_sum, c1, c5, n = totals.tolist()
    model.train(was_training)
    if n == 0:
        return EvalResult(loss=float("nan"), top1=0.0, top5=0.0, samples=0)
    return EvalResult(loss=loss_sum / n, top1=100 * c1 / n, top5=100 * c5 / n, samples=int(n))


def peak_memory_mb(devices: list[torch.device]) -> list[float]:
    """Peak memory of each device this process uses (CPU: the process's peak RSS)."""
    out = []
    for device in devices:
        if device.type == "cuda":
            out.append(torch.cuda.max_memory_allocated(device) / 2**20)
        else:
            out.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return [round(v, 1) for v in out]


def total_steps(cfg: DictConfig, steps_per_epoch: int) -> int:
    """Optimizer steps of the whole run: train.epochs, cut short by train.max_steps if set."""
    steps = cfg.train.epochs * steps_per_epoch
    return min(steps, cfg.train.max_steps) if cfg.train.max_steps else steps


@dataclass
class Position:
    """Where a run stands; saved in every checkpoint so a resumed run continues exactly."""

    epoch: int = 0  # the epoch in progress (or the next one, at an epoch boundary)
    step_in_epoch: int = 0  # optimizer steps of `epoch` already done
    global_step: int = 0
    best_top1: float = -1.0
    epoch_totals: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # loss sum, correct, count


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


class Trainer:
    """Owns the model, optimizer, schedule and scaler for one run."""

    def __init__(
        self,
        cfg: DictConfig,
        strategy: Strategy,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        train_loader: Any,
        val_loader: Any,
        steps_per_epoch: int,
        reporter: Reporter,
        out_dir: Path,
        stop: GracefulStop | None = None,
    ) -> None:
        self.cfg = cfg
        self.strategy = strategy
        self.model = model
        self.bare = strategy.unwrap(model)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = strategy.precision.grad_scaler()
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.steps_per_epoch = steps_per_epoch
        self.reporter = reporter
        self.ckpt_dir = out_dir / "checkpoints"
        self.pos = Position()
        self.total_steps = total_steps(cfg, steps_per_epoch)
        self.stop = stop
        self.on_step: Callable[[], None] | None = None  # called after every optimizer step (bench's clock)

    # ------------------------------------------------------------ resume

    def restore(self, state: dict[str, Any], path: str | Path) -> None:
        """Continue from the checkpoint at `path` (any strategy and world size, this global batch)."""
        checkpoint.load_model_state(self.bare, state["model"], path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        resume = state["resume"]
        self.pos = Position(**resume["position"])
        rngs = resume["rng"]
        # Same world size: each rank continues its own streams; otherwise rank 0's seed them all.
        set_rng_state(rngs[self.strategy.ctx.rank] if len(rngs) == self.strategy.ctx.world_size else rngs[0])

    @property
    def finished(self) -> bool:
        return self.pos.global_step >= self.total_steps

    # ------------------------------------------------------------ training

    def fit(self) -> EvalResult | None:
        """Train to the end of the schedule, evaluating and checkpointing after each epoch."""
        epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        result = None
        self.reporter.start_progress(self.total_steps, done=self.pos.global_step)
        try:
            for epoch in range(self.pos.epoch, epochs):
                steps = min(self.steps_per_epoch, self.total_steps - epoch * self.steps_per_epoch)
                result = self._run_epoch(epoch, steps)
        finally:
            self.reporter.stop_progress()
        return result

    def _run_epoch(self, epoch: int, steps: int) -> EvalResult:
        start = time.perf_counter()
        done_before = self.pos.epoch_totals[2]
        train_loss, train_top1, samples = self.train_epoch(epoch, steps)
        train_s = time.perf_counter() - start
        val = evaluate(self.bare, self.val_loader, self.strategy, self.cfg.model.channels_last)
        per_rank = self.strategy.all_gather_object(peak_memory_mb(self.strategy.devices))
        peaks = [mb for rank_peaks in per_rank for mb in rank_peaks]
        epoch_s = time.perf_counter() - start
        record = {
            "epoch": epoch,
            "step": self.pos.global_step,
            "train_loss": train_loss,
            "train_top1": train_top1,
            "val_loss": val.loss,
            "val_top1": val.top1,
            "val_top5": val.top5,
            "val_samples": val.samples,
            "lr": self.optimizer.param_groups[0]["lr"],
            "img_per_s": (samples - done_before) / train_s,
            "epoch_s": epoch_s,
            "peak_mem_mb": peaks,
        }
        self.reporter.record("epoch", **record)
        self.reporter.print(
            f"epoch {epoch}: train loss {train_loss:.4f} top-1 {train_top1:.2f}% | "
            f"val loss {val.loss:.4f} top-1 {val.top1:.2f}% top-5 {val.top5:.2f}% | "
            f"{record['img_per_s']:.0f} img/s, {epoch_s:.1f} s"
        )
        is_best = val.top1 > self.pos.best_top1  # reduced metrics: every rank decides alike
        self.pos.best_top1 = max(self.pos.best_top1, val.top1)
        if self.pos.step_in_epoch == self.steps_per_epoch:  # else train.max_steps cut the epoch short
            self.pos = Position(epoch + 1, 0, self.pos.global_step, self.pos.best_top1)
        self._save(val, best=is_best)
        return val

    def train_epoch(self, epoch: int, steps: int) -> tuple[float, float, int]:
        """Run the epoch's optimizer steps from where it stands; return its (mean loss, top-1 %, samples)."""
        cfg, strategy, model, pos = self.cfg, self.strategy, self.model, self.pos
        accum = cfg.train.grad_accum
        channels_last = cfg.model.channels_last
        smoothing = cfg.train.label_smoothing
        every = cfg.checkpoint.every_steps
        precision = strategy.precision
        model.train()
        self.train_loader.set_epoch(epoch, pos.step_in_epoch)
        batches = iter(self.train_loader)
        # loss sum (finite losses), correct, count, micro-steps whose loss was NaN/inf
        window = torch.zeros(4, dtype=torch.float64, device=strategy.ctx.device)
        window_start = time.perf_counter()
        for i in range(pos.step_in_epoch, steps):
            for micro in range(accum):
                x, y = next(batches)
                x = prepare_input(x, precision, channels_last)
                sync = micro == accum - 1
                with nullcontext() if sync else strategy.no_sync(model):
                    logits = logits_for_loss(model(x))
                    loss = F.cross_entropy(logits, y, label_smoothing=smoothing)
                    self.scaler.scale(loss / accum).backward()
                with torch.no_grad():
                    finite = torch.isfinite(loss.detach())
                    window[0] += torch.where(finite, loss.detach(), 0.0) * y.numel()
                    window[1] += (logits.argmax(dim=1) == y).sum()
                    window[2] += y.numel()
                    window[3] += ~finite
            self.optimizer_step()
            if self.on_step is not None:
                self.on_step()
            pos.global_step += 1
            pos.step_in_epoch = i + 1
            signum = self.stop.poll() if self.stop is not None else 0
            checkpoint_due = bool(every) and pos.global_step % every == 0 and i < steps - 1
            status = None
            if pos.global_step % cfg.log_every == 0 or i == steps - 1 or checkpoint_due or signum:
                loss_sum, correct, count = self._reduce_window(window)
                elapsed = time.perf_counter() - window_start
                window_start = time.perf_counter()
                pos.epoch_totals = [a + b for a, b in zip(pos.epoch_totals, (loss_sum, correct, count), strict=True)]
                self.reporter.record(
                    "step",
                    epoch=epoch,
                    step=pos.global_step,
                    loss=loss_sum / count,
                    top1=100 * correct / count,
                    lr=self.optimizer.param_groups[0]["lr"],
                    img_per_s=count / elapsed,
                )
                status = f"loss {loss_sum / count:.4f}"
            self.reporter.advance(epoch, status)
            if signum:
                path = self._save(None, best=False)
                raise Stopped(
                    f"stopped by {signal.Signals(signum).name} at step {pos.global_step}; checkpoint {path} "
                    f"written; run the same command to resume",
                    signum,
                )
            if checkpoint_due:
                self._save(None, best=False)
        loss_sum, correct, count = pos.epoch_totals
        return loss_sum / count, 100 * correct / count, int(count)

    def optimizer_step(self) -> None:
        if self.cfg.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _reduce_window(self, window: torch.Tensor) -> tuple[float, float, float]:
        """Sum the window over ranks (one host sync); a NaN/inf loss on any rank stops every
        rank, except under the fp16 scaler, which skips those steps and lowers its scale."""
        reduced = self.strategy.all_reduce_sum(window.clone())
        window.zero_()
        loss_sum, correct, count, nonfinite = reduced.tolist()
        if nonfinite and not self.scaler.is_enabled():
            raise TrainingDiverged(
                f"loss is NaN/inf at step {self.pos.global_step}; lower optim.lr, "
                f"set clip_grad_norm, or use precision=fp32 (the last good checkpoint is kept)"
            )
        if nonfinite:
            skipped = int(nonfinite)
            self.reporter.print(f"step {self.pos.global_step}: fp16 scaler skipped {skipped} NaN/inf micro-step(s)")
        return loss_sum, correct, count

    def _save(self, val: EvalResult | None, best: bool) -> Path:
        """step-N.pt (with last.pt and, when best, best.pt pointing at it); rank 0 writes, all wait."""
        rngs = self.strategy.all_gather_object(rng_state())
        path = checkpoint.step_path(self.ckpt_dir, self.pos.global_step)
        if self.strategy.ctx.is_main:
            state = checkpoint.make_state(
                model=self.bare.state_dict(),
                optimizer=self.optimizer.state_dict(),
                scheduler=self.scheduler.state_dict(),
                scaler=self.scaler.state_dict(),
                epoch=self.pos.epoch - (1 if self.pos.step_in_epoch == 0 else 0),
                step=self.pos.global_step,
                val=val.as_dict() if val is not None else None,
                config=to_dict(self.cfg),
                resume={
                    "position": asdict(self.pos),
                    "rng": rngs,
                    "steps_per_epoch": self.steps_per_epoch,
                    "world_size": self.strategy.ctx.world_size,
                },
            )
            checkpoint.save_step(state, self.ckpt_dir, self.pos.global_step, self.cfg.checkpoint.keep_last, best)
        self.strategy.barrier()
        return path
