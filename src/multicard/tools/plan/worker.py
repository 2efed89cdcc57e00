"""One rank of a `multicard plan --measure` run: `python -m multicard.tools.plan.worker SPEC.json`.

The run is `multicard train`'s own recipe (multicard.recipes.ImageClassifier, on multicard.Run),
without validation, records or checkpoints; callbacks of its loop measure: first `memory_steps`
steps with memory measured (CPU: the profiler's allocation events from before the run is built,
through the first warm-up step; CUDA: torch.cuda.max_memory_allocated), then `warmup` untimed and
`steps` timed steps. Rank 0 writes every rank's numbers as JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from multicard.base.config import Config, config_from_dict, parse_devices, with_overrides
from multicard.recipes import ImageClassifier
from multicard.run import Callback, Loop, StepEnd
from multicard.runtime.environment import detect_env
from multicard.runtime.exits import die_with_launcher, end_process
from multicard.runtime.process_group import resolve_gpus
from multicard.tools.bench.probes import StepTimer, raw_allreduce_ms
from multicard.tools.plan.profiled_peak import window_peak

MARKER = "multicard.tools.plan.steps"
# Kineto, the profiler's backend, logs to stderr at every start and stop (`USDT ... profiler_start`,
# and on a machine without GPUs `gpuGetDeviceCount failed with code 35`): noise in plan's output.
# Its levels run from 0 (verbose) to 5 (USDT); 6 silences them all. Read when the profiler first
# starts; an exported KINETO_LOG_LEVEL wins.
KINETO_SILENT = "6"


def peak_rss() -> int:
    """This process's peak resident memory (VmHWM), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class MemorySteps(Callback):
    """The first `steps` steps with memory measured (CPU: the profiler's allocation events inside
    MARKER's window; CUDA: torch.cuda.max_memory_allocated); on a CPU the warm-up's first step still
    runs profiled: what it uses was alive through the memory steps (profiled_peak places the frees the
    profiler cannot see by each block's last use)."""

    def __init__(self, steps: int, warmup: int, cuda: bool, prof: Any) -> None:
        self.steps, self.cuda, self.prof = steps, cuda, prof
        self.warmed = min(1, warmup) if prof is not None and not cuda else 0
        self.marker = record_function(MARKER)
        self.peak = self.before = self.rss = 0

    def on_fit_start(self, loop: Loop) -> None:
        self.marker.__enter__()

    def on_step_end(self, loop: Loop, step: StepEnd) -> None:
        if step.global_step == self.steps:
            self.marker.__exit__(None, None, None)
            self.rss = peak_rss()
            if self.cuda:
                self.peak = torch.cuda.max_memory_allocated(loop.strategy.ctx.device)
        if self.prof is not None and step.global_step == self.steps + self.warmed:
            self.prof.stop()
            self.peak, self.before = window_peak(self.prof, MARKER)


def run_rank(
    cfg: Config,
    memory_steps: int,
    warmup: int,
    steps: int,
    allreduce_bytes: list[int] | None = None,
    profile_memory: bool = True,
) -> dict[str, Any] | None:
    """Run the steps; CPU tensor memory is profiled only with `profile_memory` (the profiler holds
    memory of its own, which the resident-memory peak would then include)."""
    cuda = bool(resolve_gpus(parse_devices(cfg.devices)))
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_SILENT)
    # record_shapes: which ops used each block (window_peak places frees the profiler could not see)
    profiled = profile_memory and not cuda
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) if profiled else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    elif prof is not None:
        prof.start()  # before the run is built, as train builds it
    memory = MemorySteps(memory_steps, warmup, cuda, prof)
    timer = StepTimer(memory_steps + warmup)  # after the memory window's callback: its work is not a step's
    cfg = with_overrides(cfg, [f"train.max_steps={memory_steps + warmup + steps}"])
    with ImageClassifier(cfg, callbacks=[memory, timer], evaluate=False, records=False, checkpoints=False) as recipe:
        recipe.train()
        run, timed = recipe.run, timer.times
        mine = {
            "rank": run.rank,
            "peak_bytes": memory.peak,
            "before_steps_bytes": memory.before,
            "step_s": statistics.median(timed) if timed else None,
            "step_s_all": timed,
            "split_ms": timer.breakdown(),
            "split_min_ms": timer.fastest_split(),
            "threads": torch.get_num_threads(),
            "device": str(run.device),
            "loader": recipe.data.loader,
            "micro_batch": run.batch_split.micro_batch,
            "rss_peak_bytes": memory.rss,  # after the memory steps, before the profile is read
        }
        ranks = run.gather(mine)
        allreduce = {}
        if run.world_size > 1:  # the raw collective's time, for calibrate's bandwidth fit
            allreduce = {n: raw_allreduce_ms(n, run.device) for n in allreduce_bytes or []}
        return {"ranks": ranks, "allreduce_ms": allreduce} if run.is_main else None


def main(argv: list[str]) -> int:
    die_with_launcher(detect_env())
    spec = json.loads(Path(argv[0]).read_text())
    result = run_rank(config_from_dict(spec["config"]), spec["memory_steps"], spec["warmup"], spec["steps"],
                      spec.get("allreduce_bytes"), spec.get("profile_memory", True))  # fmt: skip
    if result is not None:
        Path(spec["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))  # everything is measured and written: see end_process
