"""One rank of a `multicard plan --measure` run: `python -m multicard.tools.plan.worker SPEC.json`.

The run is built by `Assembly`, exactly as `multicard train` builds it, and
driven by `Trainer.fit`: first `memory_steps` steps with memory measured (CPU: the profiler's
allocation events from before the session is built, through the first warm-up step; CUDA:
torch.cuda.max_memory_allocated), then `warmup` untimed and `steps` timed steps. Rank 0 writes
every rank's numbers as JSON.
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

from multicard.base.config import Config, config_from_dict, parse_devices
from multicard.engine.step_timer import StepTimer
from multicard.run.assembly import Assembly
from multicard.runtime.environment import detect_env
from multicard.runtime.exits import die_with_launcher, end_process
from multicard.runtime.process_group import resolve_gpus
from multicard.tools.bench.probes import raw_allreduce_ms
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
    env = detect_env()
    cuda = bool(resolve_gpus(parse_devices(cfg.devices)))
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_SILENT)
    # record_shapes: which ops used each block (window_peak places frees the profiler could not see)
    profiled = profile_memory and not cuda
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) if profiled else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    elif prof is not None:
        prof.start()
    with Assembly(cfg, env) as s:
        s.trainer  # noqa: B018 -- the whole run is built where the memory profile starts, as train builds it
        peak, before, rss, warmed = _memory_steps(s, memory_steps, warmup, cuda, prof)
        timer = StepTimer(s.ctx.device, warmup - warmed)
        s.trainer.fit([timer], until=memory_steps + warmup + steps, validate=False)
        timed = timer.times
        mine = {
            "rank": s.ctx.rank,
            "peak_bytes": peak,
            "before_steps_bytes": before,
            "step_s": statistics.median(timed) if timed else None,
            "step_s_all": timed,
            "split_ms": timer.breakdown(),
            "split_min_ms": timer.fastest_split(),
            "threads": torch.get_num_threads(),
            "device": str(s.ctx.device),
            "loader": s.data.loader,
            "micro_batch": s.batch_split.micro_batch,
            "rss_peak_bytes": rss,  # after the memory steps, before the profile is read
        }
        ranks = s.strategy.all_gather_object(mine)
        allreduce = {}
        if s.ctx.world_size > 1:  # the raw collective's time, for calibrate's bandwidth fit
            allreduce = {n: raw_allreduce_ms(n, s.ctx.device) for n in allreduce_bytes or []}
        return {"ranks": ranks, "allreduce_ms": allreduce} if s.ctx.is_main else None


def _memory_steps(s: Any, memory_steps: int, warmup: int, cuda: bool, prof: Any) -> tuple[int, int, int, int]:
    """(peak tensor bytes of the memory steps, bytes live before them, peak resident memory after
    them, warm-up steps run here). On a CPU the warm-up step still runs profiled: what it uses was
    alive through the memory steps (profiled_peak places the frees the profiler cannot see by
    each block's last use)."""
    with record_function(MARKER):
        s.trainer.fit([], until=memory_steps, validate=False)
    rss = peak_rss()
    if cuda:
        return torch.cuda.max_memory_allocated(s.ctx.device), 0, rss, 0
    if prof is None:
        return 0, 0, rss, 0
    warmed = min(1, warmup)
    s.trainer.fit([], until=memory_steps + warmed, validate=False)
    prof.stop()
    peak, before = window_peak(prof, MARKER)
    return peak, before, rss, warmed


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
