"""One rank of a verify run: `python -m multicard.tools.verify.worker SPEC.json`.

Builds the run with `Assembly` as `multicard train` does and drives `Trainer.fit`.
A run does up to two things, in this order, recording what the checks compare:

- `train`: K optimizer steps from scratch, as "job" (the configured setup, with its faults; at
  step `cut`, inside an epoch, it writes the checkpoint a stop there writes, through the
  Checkpointer, and records its whole state there and at the end) or as "reference" (one process,
  never broken). Rank 0 saves the parameters and an evaluation of the reference parameters (or of
  its own) with this many processes, and the samples each rank is given in the first epochs.
- `resume`: continue the checkpoint at `resume` to step K, recording the state right after
  loading it and at the end. In a run that trained first, loading it replaces what the run had
  reached at step K, so any state the checkpoint lacks shows as a difference.

Faults break the setup on purpose, so users (and our tests) can see verify catch it:
no-set-epoch (the sampler never learns the epoch) or rank-seed (each rank shuffles with its
own seed) break the job's runs; rng (its random streams replaced by others) and data-position
(the step within the epoch forgotten) break the checkpoint it writes at the cut.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch

from multicard.base.config import config_from_dict
from multicard.base.errors import MulticardError
from multicard.checkpoint import Checkpointer, edit_resume_state
from multicard.engine.loop import Loop, Stateful
from multicard.engine.trainer import Callback, StepEnd, evaluate, rng_state
from multicard.run.assembly import Assembly
from multicard.run.session import seed_process
from multicard.runtime.environment import detect_env
from multicard.runtime.exits import die_with_launcher, end_process
from multicard.tools.verify.checks import RESUME_FAULTS, resume_cut

COVERAGE_EPOCHS = 2
OTHER_SEED = 1000  # `--break rng`: the streams of seed + this + rank replace the saved ones


def _inject(faults: list[str], loader: Any, rank: int) -> None:
    if "no-set-epoch" in faults:
        keep = loader.sampler.set_epoch
        loader.sampler.set_epoch = lambda epoch, start_step=0: keep(0, start_step)
    if "rank-seed" in faults:
        loader.sampler.seed += rank


def _sample_indices(loader: Any, epochs: int) -> list[list[int]]:
    """The indices this rank's sampler hands out in each of the first `epochs` epochs."""
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out.append([i for batch in loader.sampler for i in batch.tolist()])
    return out


def _global_batch(s: Assembly, epoch: int, step: int, walk: bool) -> list[int]:
    """The samples, over all ranks, of optimizer step `step` of `epoch`: reached by walking the
    epoch from its start (as an uninterrupted run reaches it) or by asking the loader to start
    there (as a resumed run does). Sorted: the order within a global batch depends on the world size."""
    loader: Any = s.trainer.train_loader  # its sampler too, as _inject reaches it: the recipe's loaders have one
    accum = s.batch_split.grad_accum
    loader.set_epoch(epoch, 0 if walk else step)
    skip = step * accum if walk else 0
    mine = [i for batch in itertools.islice(loader.sampler, skip, skip + accum) for i in batch.tolist()]
    return sorted(i for rank in s.strategy.all_gather_object(mine) for i in rank)


def _cpu(tree: Any) -> Any:
    """A copy of a state on the CPU: training goes on changing the live tensors."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cpu(v) for v in tree)
    return tree


def _state(run: Stateful, next_batch: list[int] | None = None) -> dict[str, Any]:
    """The run's whole state (model and optimizer gathered on rank 0), of the trainer or the loop it
    drives; every rank calls it."""
    state = _cpu(run.state_dict(whole=True))
    return state if next_batch is None else {**state, "next_batch": next_batch}


class StopAt(Callback):
    """At step `step`: write the checkpoint a stop there writes and record the state there."""

    def __init__(self, step: int, checkpointer: Checkpointer, next_batch: list[int]) -> None:
        self.step, self.checkpointer, self.next_batch = step, checkpointer, next_batch
        self.path: Path | str | None = None
        self.state: dict[str, Any] = {}

    def on_step_end(self, loop: Loop, step: StepEnd) -> None:
        if step.global_step == self.step:
            self.path = self.checkpointer.save(loop)
            self.checkpointer.finish_writing()
            self.state = _state(loop, self.next_batch)


def _break_checkpoint(path: Path | str, faults: list[str], seed: int) -> None:
    """Rank 0: drop state from the checkpoint at `path` on purpose (`--break rng`, `data-position`)."""

    def drop(resume: dict[str, Any]) -> None:
        if "rng" in faults:
            streams = []
            for rank in range(len(resume["rng"])):
                seed_process(seed + OTHER_SEED + rank)  # this run is done: its own streams no longer matter
                streams.append(rng_state())
            resume["rng"] = streams
        if "data-position" in faults:
            resume["position"]["step_in_epoch"] = 0

    edit_resume_state(path, drop)


def _train(s: Assembly, spec: dict[str, Any], summary: dict[str, Any], states: dict[str, Any]) -> None:
    trainer, loader, job = s.trainer, s.trainer.train_loader, spec["train"] == "job"
    if job:
        _inject(spec["faults"], loader, s.ctx.rank)
    coverage = s.strategy.all_gather_object(_sample_indices(loader, COVERAGE_EPOCHS))
    spe = trainer.schedule.steps_per_epoch
    cut = resume_cut(spec["steps"], spe) if spec.get("stop") else None
    stop = None
    if cut is not None:
        stop = StopAt(cut, s.checkpointer, _global_batch(s, cut // spe, cut % spe, walk=True))
    trainer.fit([stop] if stop else [], until=spec["steps"], validate=False)
    if stop is not None:
        states.update(cut=stop.state, end=_state(trainer))
    params = s.strategy.whole_model_state(trainer.bare)
    reference = spec.get("reference")
    if reference:  # evaluate the job's parameters with this many processes
        s.strategy.load_whole_model_state(trainer.bare, torch.load(reference, weights_only=True))
    summary["eval"] = evaluate(trainer.bare, s.data.val, s.strategy).as_dict()
    summary["coverage"] = [[coverage[r][e] for r in range(len(coverage))] for e in range(COVERAGE_EPOCHS)]
    summary["num_samples"] = loader.num_samples
    if s.ctx.is_main:
        torch.save(params, spec["params"])
    if stop is not None and stop.path is not None:
        summary["cut"] = {"step": cut, "epoch": cut // spe, "step_in_epoch": cut % spe, "steps_per_epoch": spe}
        summary["checkpoint"] = str(stop.path)
        breaks = [f for f in spec["faults"] if f in RESUME_FAULTS]
        if breaks and s.ctx.is_main:
            _break_checkpoint(stop.path, breaks, s.cfg.seed)
        s.strategy.barrier()


def _resume(s: Assembly, spec: dict[str, Any], states: dict[str, Any]) -> None:
    trainer = s.trainer
    if spec["train"] != "job":
        _inject(spec["faults"], trainer.train_loader, s.ctx.rank)  # the job resumes as it was set up
    s.checkpointer.restore(Path(spec["resume"]), trainer.loop)
    pos = trainer.position
    states["resumed"] = _state(trainer, _global_batch(s, pos.epoch, pos.step_in_epoch, walk=False))
    trainer.fit(until=spec["steps"], validate=False)
    states["resumed_end"] = _state(trainer)


def main(argv: list[str]) -> int:
    env = detect_env()
    die_with_launcher(env)
    spec = json.loads(Path(argv[0]).read_text())
    summary: dict[str, Any] = {}
    states: dict[str, Any] = {}
    try:
        with Assembly(config_from_dict(spec["config"]), env) as s:
            if spec["train"]:
                _train(s, spec, summary, states)
            if spec.get("resume"):
                _resume(s, spec, states)
            if s.ctx.is_main:
                torch.save(states, spec["states"])
    except MulticardError as exc:  # rank 0's reason is said once, by `multicard verify`
        summary = {"failed": str(exc), "exit_code": int(exc.exit_code)}
        if not env.is_main:
            return exc.exit_code
    if env.is_main:
        Path(spec["result"]).write_text(json.dumps(summary))
    return summary.get("exit_code", 0)


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))  # the rank's result is written: see end_process
