"""multicard eval: validation during training is the evaluation of the checkpoint the run wrote, under
every multi-process strategy (BatchNorm running statistics not synced); data of other classes, and a
checkpoint that is missing or cut short, are refused in one line before any worker starts."""

from __future__ import annotations

import json

import pytest

from conftest import TINY, image_folder, one_line, run_here
from multicard.cli.main import main

# float64 and BatchNorm (smallcnn's default), sync_bn=false (the default): each rank's last
# training forward updates its own running statistics from its own share of the batch.
RUN = [*TINY, "precision=fp64", "data.train_size=512", "data.val_size=203", "train.max_steps=12", "sync_bn=false"]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy, fmt", [("ddp", "file"), ("fsdp", "sharded")])
def test_validation_in_training_equals_eval_of_the_checkpoint(tmp_path, capsys, strategy, fmt):
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


def test_eval_refuses_data_with_other_class_names(tmp_path, capsys):
    image_folder(tmp_path / "data" / "train", ["airplane", "cat", "dog"])
    common = ["model.name=smallcnn", "data.name=imagefolder", f"data.root={tmp_path / 'data'}", "data.image_size=8"]
    assert main(["train", *common, "train.global_batch_size=8", "train.epochs=1", f"out_dir={tmp_path / 'o'}"]) == 0
    image_folder(tmp_path / "other", ["cat", "dog", "horse"])
    capsys.readouterr()
    ckpt = str(tmp_path / "o" / "checkpoints" / "last.pt")
    assert main(["eval", "--checkpoint", ckpt, f"data.val_root={tmp_path / 'other'}"]) == 2
    err = one_line(capsys.readouterr().err)
    assert "only in the checkpoint: airplane" in err and "only in the data: horse" in err


def test_eval_with_a_launcher_checks_the_checkpoint_before_starting_workers(tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path / "none.pt"), "--nproc-per-node", "2"]) == 2
    assert "checkpoint not found" in one_line(capsys.readouterr().err)
    (tmp_path / "cut.pt").write_bytes(b"PK\x03\x04 cut short")
    assert main(["eval", "--checkpoint", str(tmp_path / "cut.pt"), "--nproc-per-node", "2"]) == 2
    assert "cannot be read" in one_line(capsys.readouterr().err)
