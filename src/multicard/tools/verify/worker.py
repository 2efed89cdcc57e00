"""One rank of a verify run: `python -m multicard.tools.verify.worker SPEC.json`.

Trains the config with `multicard train`'s own recipe (multicard.recipes.ImageClassifier, on
multicard.Run: K steps are train.max_steps), without validation or records; callbacks of its loop
record what the checks compare. A verify run does up to two things, in this order:

- `train`: K optimizer steps from scratch, as "job" (the configured setup, with its faults; at
  step `cut`, inside an epoch, it writes the checkpoint a stop there writes (run.save) and records
  its whole state there and at the end) or as "reference" (one process, never broken). Rank 0
  saves the parameters and an evaluation of the reference parameters (the job's last checkpoint)
  or of its own with this many processes, and the samples each rank is given in the first epochs.
- `resume`: continue the checkpoint at `resume` to step K in a run of its own (train.resume),
  recording the state right after loading it and at the end: any state the checkpoint lacks
  shows as a difference from the uninterrupted job's.

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

from multicard.base.config import Config, config_from_dict, with_overrides
from multicard.base.errors import MulticardError
from multicard.checkpoint import edit_resume_state, snapshot
from multicard.recipes import ImageClassifier
from multicard.run import Callback, Loop, Run, StepEnd
from multicard.runtime.environment import detect_env
from multicard.runtime.exits import die_with_launcher, end_process
from multicard.runtime.seeding import rng_state, seed_process
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


def _global_batch(recipe: ImageClassifier, epoch: int, step: int, walk: bool) -> list[int]:
    """The samples, over all ranks, of optimizer step `step` of `epoch`: reached by walking the
    epoch from its start (as an uninterrupted run reaches it) or by asking the loader to start
    there (as a resumed run does). Sorted: the order within a global batch depends on the world size."""
    loader: Any = recipe.data.train  # its sampler too, as _inject reaches it: the recipe's loaders have one
    accum = recipe.run.batch_split.grad_accum
    loader.set_epoch(epoch, 0 if walk else step)
    skip = step * accum if walk else 0
    mine = [i for batch in itertools.islice(loader.sampler, skip, skip + accum) for i in batch.tolist()]
    return sorted(i for rank in recipe.run.gather(mine) for i in rank)


def _state(loop: Loop, next_batch: list[int] | None = None) -> dict[str, Any]:
    """The run's whole state (model and optimizer gathered on rank 0), copied to the CPU (training goes
    on changing the live tensors); every rank calls it."""
    state = snapshot(loop.state_dict(whole=True))
    return state if next_batch is None else {**state, "next_batch": next_batch}


class Record(Callback):
    """The run's loop, for its states; at step `cut` (if any): the checkpoint a stop there writes,
    and the state there; at the start (`started`: a resumed run's), the state right after loading."""

    def __init__(self, started: bool = False) -> None:
        self.started = started
        self.cut: int | None = None
        self.run: Run | None = None
        self.next_batch: Any = None  # the samples of the step after the cut, or a function giving them
        self.loop: Loop | None = None
        self.path: Path | str | None = None
        self.state: dict[str, Any] = {}

    def on_fit_start(self, loop: Loop) -> None:
        self.loop = loop
        if self.started:
            self.state = _state(loop, self.next_batch(loop.position))

    def on_step_end(self, loop: Loop, step: StepEnd) -> None:
        if step.global_step == self.cut and self.run is not None:
            self.path = self.run.save()
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


def _train(cfg: Config, spec: dict[str, Any], summary: dict[str, Any], states: dict[str, Any]) -> None:
    record, job = Record(), spec["train"] == "job"
    with ImageClassifier(cfg, callbacks=[record], evaluate=False, records=False) as recipe:
        run, loader = recipe.run, recipe.data.train
        assert loader is not None  # a training run's
        if job:
            _inject(spec["faults"], loader, run.rank)
        coverage = run.gather(_sample_indices(loader, COVERAGE_EPOCHS))
        spe = recipe.batches.steps_per_epoch
        cut = resume_cut(spec["steps"], spe) if spec.get("stop") else None
        if cut is not None:
            record.cut, record.run = cut, run
            record.next_batch = _global_batch(recipe, cut // spe, cut % spe, walk=True)
        recipe.train()
        assert record.loop is not None
        end = _state(record.loop)
        if cut is not None:
            states.update(cut=record.state, end=end)
        reference = spec.get("reference")
        if reference:  # evaluate the job's parameters (its last checkpoint) with this many processes
            last = Path(reference) / "last.pt"  # a single file, or the sharded format's step directory
            run.load_weights(recipe.model, str(last if last.exists() else last.with_suffix("")))
        summary["eval"] = recipe.evaluate().as_dict()
        summary["coverage"] = [[coverage[r][e] for r in range(len(coverage))] for e in range(COVERAGE_EPOCHS)]
        summary["num_samples"] = loader.num_samples
        if run.is_main:
            torch.save(end["model"], spec["params"])
        if cut is not None and record.path is not None:
            summary["cut"] = {"step": cut, "epoch": cut // spe, "step_in_epoch": cut % spe, "steps_per_epoch": spe}
            summary["checkpoint"] = str(record.path)
            breaks = [f for f in spec["faults"] if f in RESUME_FAULTS]
            if breaks and run.is_main:
                _break_checkpoint(record.path, breaks, cfg.seed)
            run.barrier()


def _resume(cfg: Config, spec: dict[str, Any], states: dict[str, Any]) -> None:
    record = Record(started=True)
    with ImageClassifier(with_overrides(cfg, [f"train.resume={spec['resume']}"]), callbacks=[record],
                         evaluate=False, records=False) as recipe:  # fmt: skip
        if spec["train"] != "job":
            _inject(spec["faults"], recipe.data.train, recipe.run.rank)  # the job resumes as it was set up
        record.next_batch = lambda pos: _global_batch(recipe, pos.epoch, pos.step_in_epoch, walk=False)
        recipe.train()
        assert record.loop is not None
        states["resumed"], states["resumed_end"] = record.state, _state(record.loop)


def main(argv: list[str]) -> int:
    env = detect_env()
    die_with_launcher(env)
    spec = json.loads(Path(argv[0]).read_text())
    summary: dict[str, Any] = {}
    states: dict[str, Any] = {}
    try:
        cfg = config_from_dict(spec["config"])
        if spec["train"]:
            _train(cfg, spec, summary, states)
        if spec.get("resume"):
            _resume(cfg, spec, states)
        if env.is_main:
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
