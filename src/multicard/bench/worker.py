"""One rank of one bench cell: `python -m multicard.bench.worker SPEC.json`.

The multicard runner builds its run with `run.session`, exactly as `multicard train` does, and
times the trainer's own steps; the other runners are the yardsticks (plain loop, frameworks).
Rank 0 writes the cell's result as JSON next to the spec.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from multicard import run
from multicard.bench.measure import CommTimer, StepClock, gradient_bytes, raw_allreduce_ms, step_breakdown, summary_ms
from multicard.config import config_from_dict
from multicard.dist import detect_env
from multicard.engine import logits_for_loss, peak_memory_mb, prepare_input
from multicard.stopping import GracefulStop


def _breakdown(s: run.Session, steps: int) -> dict[str, float]:
    trainer, strategy, cfg = s.trainer, s.strategy, s.cfg
    trainer.train_loader.set_epoch(1)
    raw = iter(trainer.train_loader)
    batches = ((prepare_input(x, strategy.precision, cfg.model.channels_last), y) for x, y in raw)
    return step_breakdown(
        trainer.model,
        batches,
        lambda out, y: F.cross_entropy(logits_for_loss(out), y),
        lambda: strategy.no_sync(trainer.model),
        trainer.optimizer_step,
        s.ctx.device,
        steps,
    )


def _allreduce(s: run.Session, steps: int) -> dict[str, Any]:
    """Gradient bytes, a raw all_reduce of that many bytes, and DDP's achieved rate in training."""
    nbytes = gradient_bytes(s.trainer.bare)
    raw_ms = raw_allreduce_ms(nbytes, s.ctx.device)
    out: dict[str, Any] = {"grad_mb": nbytes / 1e6, "raw_ms": raw_ms, "raw_gb_per_s": nbytes / raw_ms / 1e6}
    if s.cfg.ddp.comm_hook != "none":
        out["ddp_gb_per_s"] = None  # a compression hook sends fewer bytes; its rate is not comparable
        return out
    timer = CommTimer()
    s.trainer.model.register_comm_hook(None, timer.hook)
    s.trainer.train_loader.set_epoch(2)
    batches = iter(s.trainer.train_loader)
    for _ in range(steps):
        x, y = next(batches)
        x = prepare_input(x, s.strategy.precision, s.cfg.model.channels_last)
        F.cross_entropy(logits_for_loss(s.trainer.model(x)), y).backward()
        s.trainer.optimizer_step()
        timer.end_step()
    span_ms = sorted(timer.spans)[len(timer.spans) // 2] * 1000
    out.update(ddp_span_ms=span_ms, ddp_gb_per_s=nbytes / span_ms / 1e6)
    return out


def run_multicard(cfg: DictConfig, strategy: str, warmup: int, steps: int) -> dict[str, Any] | None:
    env = detect_env()
    with run.session(cfg, env, quiet=True) as s, GracefulStop(s.strategy.start_max) as stop:
        trainer = s.trainer
        trainer.stop = stop  # training polls for signals every step; so does the bench
        clock = StepClock(s.ctx.device, warmup)
        trainer.on_step = clock
        trainer.train_epoch(0, warmup + steps)
        trainer.on_step = None
        breakdown = _breakdown(s, max(3, steps // 4))
        comm = _allreduce(s, max(3, steps // 4)) if strategy == "ddp" else None
        peaks = [mb for rank in s.strategy.all_gather_object(peak_memory_mb(s.strategy.devices)) for mb in rank]
        if not s.ctx.is_main:
            return None
        return {
            "step_ms": summary_ms(clock.times),
            "times": clock.times,
            "breakdown": breakdown,
            "allreduce": comm,
            "peak_mem_mb_per_device": peaks,
            "threads": torch.get_num_threads(),
            "loader": s.data.loader,
        }


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    runner, strategy = spec["cell"]["runner"], spec["cell"]["strategy"]
    cfg = config_from_dict(spec["config"])
    warmup, steps = spec["warmup"], spec["steps"]
    if runner == "multicard":
        result = run_multicard(cfg, strategy, warmup, steps)
    elif runner == "plain":
        from multicard.bench.plain import run_plain

        result = run_plain(cfg, strategy, spec["cell"]["world_size"], warmup, steps)
    else:
        from multicard.bench.frameworks import run_framework

        result = run_framework(runner, cfg, strategy, spec["cell"]["world_size"], warmup, steps)
    if result is not None:
        Path(spec["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
