"""Hardening round 2, case 1: validation during training is the evaluation of the checkpoint the
run wrote, under every multi-process strategy (BatchNorm running statistics not synced)."""

from __future__ import annotations

import json

import pytest

from conftest import TINY, run_here
from multicard.cli.main import main

# float64 and BatchNorm (smallcnn's default), sync_bn=false (the default): each rank's last
# training forward updates its own running statistics from its own share of the batch.
RUN = [*TINY, "precision=fp64", "data.train_size=512", "data.val_size=203", "train.max_steps=12", "sync_bn=false"]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy, fmt", [("ddp", "file"), ("fsdp", "sharded")])
def test_27_1_validation_in_training_equals_eval_of_the_checkpoint(tmp_path, capsys, strategy, fmt):
    out = tmp_path / "run"
    options = [f"strategy={strategy}", f"checkpoint.format={fmt}", f"out_dir={out}"]
    run_here("train", "--nproc-per-node", "2", *RUN, *options)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r.get("kind") == "epoch"][-1]
    assert last["step"] == 12
    checkpoint = out / "checkpoints" / ("last.pt" if fmt == "file" else "last")
    results = []
    if strategy == "ddp":  # two ranks, as in training: the same float64 sums in the same order
        two = run_here("eval", "--checkpoint", str(checkpoint), "--json", "--nproc-per-node", "2")
        results.append((json.loads(two.strip().splitlines()[-1]), True))
    assert main(["eval", "--checkpoint", str(checkpoint), "--json"]) == 0
    results.append((json.loads(capsys.readouterr().out), False))
    for result, exact in results:
        assert (result["top1"], result["samples"]) == (last["val_top1"], last["val_samples"])
        if exact:
            assert result["loss"] == last["val_loss"]
        else:  # one rank adds the same per-sample losses in another order
            assert result["loss"] == pytest.approx(last["val_loss"], rel=1e-12, abs=0)
