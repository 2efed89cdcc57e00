"""One rank of a verify run: `python -m multicard.verify.worker SPEC.json`.

Builds the run with `session.open_session` as `multicard train` does, records the samples each
rank is given in the first epochs, trains K optimizer steps through `Trainer.fit`, and (rank 0)
saves the parameters and an evaluation of the reference parameters with this many processes.

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

from multicard.config import config_from_dict
from multicard.process_group import detect_env, die_with_launcher, end_process
from multicard.session import open_session
from multicard.trainer import evaluate

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


def main(argv: list[str]) -> int:
    die_with_launcher(detect_env())
    spec = json.loads(Path(argv[0]).read_text())
    cfg = config_from_dict(spec["config"])
    steps, fault = spec["steps"], spec.get("fault")
    with open_session(cfg, detect_env()) as s:
        loader = s.trainer.train_loader
        _inject(fault, loader, s.ctx.rank)
        coverage = s.strategy.all_gather_object(_sample_indices(loader, COVERAGE_EPOCHS))
        s.trainer.fit(until=steps, validate=False)
        params = s.strategy.whole_model_state(s.trainer.bare)
        reference = spec.get("reference")
        if reference:  # evaluate the single run's parameters with this many processes
            s.strategy.load_whole_model_state(s.trainer.bare, torch.load(reference, weights_only=True))
        result = evaluate(s.trainer.bare, s.data.val, s.strategy)
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
    end_process(main(sys.argv[1:]))  # the rank's result is written: see end_process
