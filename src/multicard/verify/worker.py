"""One rank of a verify run: `python -m multicard.verify.worker SPEC.json`.

Builds the run with `run.session` as `multicard train` does, records the samples each rank
is given in the first epochs, trains K optimizer steps, and (rank 0) saves the parameters and
an evaluation of the reference parameters with this many processes.

`fault` breaks the setup on purpose, so users (and our tests) can see verify catch it:
no-set-epoch (the sampler never learns the epoch) or rank-seed (each rank shuffles with its
own seed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from multicard import run
from multicard.config import config_from_dict
from multicard.dist import detect_env
from multicard.engine import evaluate

FAULTS = ("no-set-epoch", "rank-seed")
COVERAGE_EPOCHS = 2


def _inject(fault: str | None, loader: Any, rank: int) -> None:
    if fault == "no-set-epoch":
        keep = loader.sampler.set_epoch
        loader.sampler.set_epoch = lambda epoch, start_step=0: keep(0, start_step)
    elif fault == "rank-seed":
        loader.sampler.seed += rank


def _sample_indices(loader: Any, epochs: int) -> list[list[int]]:
    """The indices this rank's sampler hands out in each of the first `epochs` epochs."""
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out.append([i for batch in loader.sampler for i in batch.tolist()])
    return out


def _train(s: run.Session, steps: int) -> None:
    trainer, epoch = s.trainer, 0
    while trainer.pos.global_step < steps:
        trainer.train_epoch(epoch, min(trainer.steps_per_epoch, steps - trainer.pos.global_step))
        epoch += 1
        trainer.pos.step_in_epoch = 0


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    cfg = config_from_dict(spec["config"])
    steps, fault = spec["steps"], spec.get("fault")
    with run.session(cfg, detect_env(), quiet=True) as s:
        loader = s.trainer.train_loader
        _inject(fault, loader, s.ctx.rank)
        coverage = s.strategy.all_gather_object(_sample_indices(loader, COVERAGE_EPOCHS))
        _train(s, steps)
        params = {k: v.detach().cpu().clone() for k, v in s.trainer.bare.state_dict().items()}
        reference = spec.get("reference")
        if reference:  # evaluate the single run's parameters with this many processes
            s.trainer.bare.load_state_dict(torch.load(reference, map_location=s.ctx.device))
        result = evaluate(s.trainer.bare, s.data.val, s.strategy, cfg.model.channels_last)
        if s.ctx.is_main:
            torch.save(params, spec["params"])
            summary = {
                "eval": result.as_dict(),
                "coverage": [[coverage[r][e] for r in range(len(coverage))] for e in range(COVERAGE_EPOCHS)],
                "num_samples": loader.num_samples,
            }
            Path(spec["result"]).write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
