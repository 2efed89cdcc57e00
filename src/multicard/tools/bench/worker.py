"""One rank of one bench cell: `python -m multicard.tools.bench.worker SPEC.json`.

The multicard runner trains the cell's config with `multicard train`'s own recipe
(multicard.recipes.ImageClassifier, on multicard.Run), without validation or checkpoints and,
unless bench --logging asks for them, without records; callbacks of the run's loop time each
optimizer step and read its phase split, and under ddp a few more steps measure DDP's gradient
all-reduce. The other runners are the yardsticks (plain loop, frameworks). Rank 0 writes the
cell's result as JSON next to the spec.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from multicard.base.config import Config, config_from_dict, with_overrides
from multicard.base.errors import MulticardError
from multicard.recipes import ImageClassifier
from multicard.run import Callback, Loop, StepEnd
from multicard.runtime.clock import summary_ms
from multicard.runtime.environment import detect_env
from multicard.runtime.exits import die_with_launcher, end_process
from multicard.tools.bench.cells import COMM_STEPS
from multicard.tools.bench.probes import (
    RAW_REPEATS,
    CommTimer,
    HeldState,
    StepTimer,
    gradient_bytes,
    raw_allreduce_ms,
)


class CommProbe(Callback):
    """After step `after` (the timed ones): the gradients' bytes, a raw all_reduce of that many bytes,
    and (`hook`) DDP's achieved rate over the steps that follow, timed by a comm hook of CommTimer's;
    a cell of few timed steps measures these few times too. A compression hook (ddp.comm_hook) sends
    fewer bytes: its rate is not comparable, and not measured."""

    def __init__(self, after: int, repeats: int, hook: bool) -> None:
        self.after, self.repeats, self.hook = after, repeats, hook
        self.timer = CommTimer()
        self.result: dict[str, Any] = {}

    def on_step_end(self, loop: Loop, step: StepEnd) -> None:
        if step.global_step > self.after:
            self.timer.end_step()
        elif step.global_step == self.after:
            nbytes = gradient_bytes(loop.bare)
            raw_ms = raw_allreduce_ms(nbytes, loop.strategy.ctx.device, repeats=self.repeats)
            self.result = {"grad_mb": nbytes / 1e6, "raw_ms": raw_ms, "raw_gb_per_s": nbytes / raw_ms / 1e6}
            if self.hook:
                loop.model.register_comm_hook(None, self.timer.hook)

    def rates(self) -> dict[str, Any]:
        if not self.hook:
            return {**self.result, "ddp_gb_per_s": None}
        span_ms = sorted(self.timer.spans)[len(self.timer.spans) // 2] * 1000
        return {**self.result, "ddp_span_ms": span_ms, "ddp_gb_per_s": self.result["grad_mb"] / span_ms}  # MB/ms = GB/s


class PeakMemory(Callback):
    """Every device's peak memory, from the run's epoch record (its last: after every step)."""

    def __init__(self) -> None:
        self.mb: list[float] = []

    def on_epoch_end(self, loop: Loop, record: dict[str, Any], val: Any, best: bool) -> None:
        self.mb = record["peak_mem_mb"]


def run_multicard(cfg: Config, strategy: str, warmup: int, steps: int, logging: bool) -> dict[str, Any] | None:
    timed, hook = warmup + steps, cfg.ddp.comm_hook == "none"
    probe = CommProbe(timed, min(steps, RAW_REPEATS), hook) if strategy == "ddp" else None
    extra = min(steps, COMM_STEPS) if probe is not None and hook else 0
    cfg = with_overrides(cfg, [f"train.max_steps={timed + extra}"])
    timer, held, peaks = StepTimer(warmup, last=timed), HeldState(), PeakMemory()
    callbacks = [timer, held, peaks, *([probe] if probe is not None else [])]
    with ImageClassifier(cfg, callbacks=callbacks, evaluate=False, records=logging, checkpoints=False) as recipe:
        recipe.train()
        run = recipe.run
        held_per_rank = run.gather(held.mib)
        beats = run.gather(run.heartbeat_cost())
        if not run.is_main:
            return None
        comm = probe.rates() if probe is not None else None
        return {
            "step_ms": summary_ms(timer.times),
            "times": timer.times,
            "breakdown": timer.breakdown(),
            "allreduce": comm,
            "peak_mem_mb_per_device": peaks.mb,
            "held_mib_per_rank": held_per_rank,
            "heartbeat_per_rank": beats if any(beats) else None,
            "threads": torch.get_num_threads(),
            "loader": recipe.data.loader,
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
