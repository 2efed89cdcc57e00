"""One rank of one bench cell: `python -m multicard.tools.bench.worker SPEC.json`.

The multicard runner builds its run with `Assembly`, exactly as `multicard train`
does, and drives `Trainer.fit` with callbacks that time each optimizer step and read its
phase split; the other runners are the yardsticks (plain loop, frameworks). Rank 0 writes the
cell's result as JSON next to the spec.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from multicard.base.config import Config, config_from_dict
from multicard.base.errors import MulticardError
from multicard.engine.loop import Loop
from multicard.engine.phases import summary_ms
from multicard.engine.step_timer import StepTimer
from multicard.engine.trainer import Callback, StepEnd, peak_memory_mb
from multicard.run.assembly import Assembly
from multicard.run.preflight import check_extras
from multicard.runtime.environment import detect_env
from multicard.runtime.exits import die_with_launcher, end_process
from multicard.tools.bench.cells import COMM_STEPS
from multicard.tools.bench.probes import (
    RAW_REPEATS,
    CommTimer,
    gradient_bytes,
    held_bytes,
    optimizer_tensors,
    raw_allreduce_ms,
)


class HeldState(Callback):
    """MiB of parameters, gradients and optimizer state this rank holds, read once a step's
    gradients exist (optimizer state is there from the second step on)."""

    def __init__(self) -> None:
        self.mib: dict[str, float] = {}

    def on_gradients(self, loop: Loop) -> None:
        if loop.position.global_step < 1 or self.mib:
            return  # once: not on steps that are timed after it
        assert loop.bare is not None and loop.optimizer is not None  # attached: it is training
        params = list(loop.bare.parameters())
        self.mib = {
            "params": held_bytes(params) / 2**20,
            "grads": held_bytes(p.grad for p in params) / 2**20,
            "optimizer": held_bytes(optimizer_tensors(loop.optimizer)) / 2**20,
        }


class CommSpans(Callback):
    def __init__(self, timer: CommTimer) -> None:
        self.timer = timer

    def on_step_end(self, loop: Loop, step: StepEnd) -> None:
        self.timer.end_step()


def _allreduce(s: Assembly, start: int, steps: int) -> dict[str, Any]:
    """Gradient bytes, a raw all_reduce of that many bytes, and DDP's achieved rate in training;
    a cell of few timed steps measures these few times too."""
    nbytes = gradient_bytes(s.trainer.bare)
    raw_ms = raw_allreduce_ms(nbytes, s.ctx.device, repeats=min(steps, RAW_REPEATS))
    out: dict[str, Any] = {"grad_mb": nbytes / 1e6, "raw_ms": raw_ms, "raw_gb_per_s": nbytes / raw_ms / 1e6}
    if s.cfg.ddp.comm_hook != "none":
        out["ddp_gb_per_s"] = None  # a compression hook sends fewer bytes; its rate is not comparable
        return out
    timer = CommTimer()
    s.trainer.model.register_comm_hook(None, timer.hook)
    s.trainer.fit([CommSpans(timer)], until=start + min(steps, COMM_STEPS), validate=False)
    span_ms = sorted(timer.spans)[len(timer.spans) // 2] * 1000
    out.update(ddp_span_ms=span_ms, ddp_gb_per_s=nbytes / span_ms / 1e6)
    return out


def run_logs_of(s: Assembly) -> list[Callback]:
    """The run's logging callbacks as `multicard train` attaches them, writing into the cell's out_dir."""
    check_extras(s.cfg)
    s.out_dir.mkdir(parents=True, exist_ok=True)
    s.open_records(None)
    return s.logs(None)


def run_multicard(cfg: Config, strategy: str, warmup: int, steps: int, logging: bool) -> dict[str, Any] | None:
    with Assembly(cfg, detect_env()) as s:
        trainer = s.trainer  # built before the timer starts
        timer = StepTimer(s.ctx.device, warmup)
        held = HeldState()
        trainer.fit([timer, held, *(run_logs_of(s) if logging else [])], until=warmup + steps, validate=False)
        comm = _allreduce(s, warmup + steps, steps) if strategy == "ddp" else None
        peaks = [mb for rank in s.strategy.all_gather_object(peak_memory_mb(s.strategy.devices)) for mb in rank]
        held_per_rank = s.strategy.all_gather_object(held.mib)
        beats = s.strategy.all_gather_object(s.watchdog.cost.summary() if s.watchdog else None)
        if not s.ctx.is_main:
            return None
        return {
            "step_ms": summary_ms(timer.times),
            "times": timer.times,
            "breakdown": timer.breakdown(),
            "allreduce": comm,
            "peak_mem_mb_per_device": peaks,
            "held_mib_per_rank": held_per_rank,
            "heartbeat_per_rank": beats if any(beats) else None,
            "threads": torch.get_num_threads(),
            "loader": s.data.loader,
        }


def main(argv: list[str]) -> int:
    die_with_launcher(detect_env())
    spec = json.loads(Path(argv[0]).read_text())
    runner, strategy = spec["cell"]["runner"], spec["cell"]["strategy"]
    cfg = config_from_dict(spec["config"])
    warmup, steps = spec["warmup"], spec["steps"]
    if runner == "multicard":
        try:
            result = run_multicard(cfg, strategy, warmup, steps, spec.get("logging", False))
        except MulticardError as exc:  # said in one line, and the cell's row gives the reason
            print(f"multicard bench: {exc}", file=sys.stderr)
            if detect_env().is_main:
                Path(spec["result"]).write_text(json.dumps({"failed": str(exc)}))
            return exc.exit_code
    elif runner == "plain":
        from multicard_yardsticks.plain import run_plain

        result = run_plain(cfg, strategy, spec["cell"]["world_size"], warmup, steps)
    else:
        from multicard_yardsticks.frameworks import run_framework

        result = run_framework(runner, cfg, strategy, spec["cell"]["world_size"], warmup, steps)
    if result is not None:
        Path(spec["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))  # the cell's result is written: see end_process
