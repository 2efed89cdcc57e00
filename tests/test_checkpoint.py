"""Checkpoints: written atomically, damaged or foreign files refused in one line, a checkpoint of
another model named by the tensors that differ, crafted pickles never run, weights loaded into a new run;
continuing a run from its checkpoints in one process: what is refused (other settings, weights over a run's
own checkpoints, a checkpoint past the run's length) with out_dir left as it was, and what is said."""

import os
import pickle
import re
from pathlib import Path

import pytest
import torch

from conftest import TINY, cli, copy_of, one_line
from multicard.base.atomic import save_atomic
from multicard.base.errors import UserError
from multicard.checkpoint import check_model_fits, load_file
from multicard.cli.main import main
from multicard.runtime.process_group import ProcessContext
from multicard.strategy.base import ModelSetup, Strategy
from multicard.strategy.precision import Precision


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("simulated failure while writing")


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "ck" / "last.pt"
    save_atomic({"model": {"w": torch.ones(2)}, "config": {}}, path)
    with pytest.raises(RuntimeError, match="simulated"):
        save_atomic({"model": Unpicklable(), "config": {}}, path)
    assert torch.equal(load_file(path)["model"]["w"], torch.ones(2))
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # no temp file left


def test_damaged_or_foreign_files_give_one_line_errors(tmp_path):
    good = tmp_path / "good.pt"
    save_atomic({"model": {}, "config": {}}, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:40])
    with pytest.raises(UserError, match="cannot be read"):
        load_file(truncated)
    other = tmp_path / "other.pt"
    torch.save({"weights": 1}, other)
    with pytest.raises(UserError, match="not a multicard checkpoint"):
        load_file(other)
    with pytest.raises(UserError, match="not found"):
        load_file(tmp_path / "missing.pt")


def test_state_of_another_model_is_refused():
    with pytest.raises(UserError, match="does not fit this model"):
        check_model_fits({"weight": torch.zeros(5, 5)}, torch.nn.Linear(3, 2), "x.pt")


def test_a_checkpoint_of_another_model_says_which_tensors_differ(tmp_path, capsys):
    assert main(["train", *TINY, "train.max_steps=2", f"out_dir={tmp_path}"]) == 0
    capsys.readouterr()
    ckpt = str(tmp_path / "checkpoints" / "last.pt")
    assert main(["eval", "--checkpoint", ckpt, "model.kwargs.width=16"]) == 2
    err = one_line(capsys.readouterr().err)
    assert re.search(r"shape\(s\) differ, e\.g\. 0\.0\.weight \[32, 3, 3, 3\] vs \[16, 3, 3, 3\]", err), err


def test_a_setting_added_since_the_checkpoint_differs_only_when_not_the_default():
    from multicard.base.config import Config, to_dict
    from multicard.checkpoint.compat import changed_settings

    saved, wanted = to_dict(Config()), to_dict(Config())
    del saved["data"]["kwargs"], saved["sched"]["name"]  # written before these settings existed
    assert changed_settings(saved, wanted) == []
    wanted["sched"]["name"] = "step"
    assert changed_settings(saved, wanted) == ["sched.name: cosine → step"]
    saved["data"]["gone"] = 3  # a setting this version no longer has, and no default to compare with
    assert "data.gone: 3 → None" in changed_settings(saved, wanted)


class Tagged(torch.nn.Linear):
    """A module with state of its own beside its tensors (torch's extra state: here, not a tensor)."""

    def get_extra_state(self) -> dict:
        return {"vocab": 3}

    def set_extra_state(self, state: dict) -> None:
        self.vocab = state["vocab"]


def test_a_whole_copy_of_the_model_state_copies_its_tensors_and_keeps_its_extra_state():
    model = Tagged(2, 2)
    ctx = ProcessContext(0, 0, 1, 1, torch.device("cpu"), distributed=False)
    whole = Strategy(ctx, Precision("fp32", "cpu"), ModelSetup()).whole_model_state(model)
    assert whole["_extra_state"] == {"vocab": 3}
    assert torch.equal(whole["weight"], model.weight) and whole["weight"].data_ptr() != model.weight.data_ptr()


class Payload:
    """Unpickling this creates a file: what a crafted checkpoint could do with weights_only=False."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_crafted_checkpoint_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {"w": Payload(marker)}, "config": {}}, evil)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(evil, weights_only=True)  # the file really is hostile
    attempts = [
        ["eval", "--checkpoint", str(evil)],
        ["train", *TINY, f"train.resume={evil}", f"out_dir={tmp_path / 'o'}"],
        ["train", *TINY, f"model.weights={evil}", f"out_dir={tmp_path / 'w'}"],
        ["export", "--checkpoint", str(evil), "--out", str(tmp_path / "exported.pt")],
    ]
    for argv in attempts:
        assert main(argv) == 2, argv
        assert "was not loaded" in one_line(capsys.readouterr().err)
    assert not marker.exists()


class Getcwd:
    """Unpickling it would call os.getcwd: the weights-only unpickler must refuse it."""

    def __reduce__(self):
        return (os.getcwd, ())


@pytest.mark.slow
def test_crafted_weights_are_refused_in_one_line_without_torchs_warning(tmp_path):
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps({"w": Getcwd()}, protocol=4))  # torch warns of protocols above 2
    done = cli("train", *TINY, f"model.weights={evil}", f"out_dir={tmp_path / 'run'}")
    assert done.returncode == 2
    assert "was not loaded" in one_line(done.stderr)  # the whole of stderr: torch's warning is not there


def test_fine_tuning_from_weights_in_a_new_out_dir(tmp_path, capsys):
    assert main(["train", *TINY, "train.max_steps=2", f"out_dir={tmp_path / 'a'}"]) == 0
    last = tmp_path / "a" / "checkpoints" / "last.pt"
    args = ["train", *TINY, "train.max_steps=2", "optim.lr=0.01", f"model.weights={last}", f"out_dir={tmp_path / 'b'}"]
    assert main(args) == 0
    assert re.search(rf"loaded (\d+) of \1 tensors from {re.escape(str(last))}", capsys.readouterr().out)


# ------------------------------------------------------------------ continuing a run


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The out_dir of a one-process run of 2 steps (step-000000002.pt)."""
    out = tmp_path_factory.mktemp("single")
    assert main(["train", *TINY, "train.max_steps=2", f"out_dir={out}"]) == 0
    return out


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_rerun_with_other_settings_is_refused_and_run_length_may_grow(tmp_path, capsys):
    args = ["train", *TINY, "train.max_steps=4", f"out_dir={tmp_path}"]
    assert main(args) == 0
    config = (tmp_path / "config.yaml").read_text()
    capsys.readouterr()
    assert main([*args, "optim.lr=0.001", "sched.name=constant"]) == 2
    err = one_line(capsys.readouterr().err)
    assert "optim.lr: 0.1 → 0.001" in err and "sched.name: cosine → constant" in err
    assert "train.resume=never" in err and "model.weights=" in err  # the choices
    assert (tmp_path / "config.yaml").read_text() == config  # a refused run writes nothing
    assert main([*args, "optim.name=adamw"]) == 2  # another optimizer's state: once a KeyError 'step', exit 1
    assert "optim.name: sgd → adamw" in one_line(capsys.readouterr().err)
    assert main(["train", *TINY, "train.max_steps=8", f"out_dir={tmp_path}"]) == 0  # more steps: no fuss
    assert "resumed from" in capsys.readouterr().out


def test_weights_into_an_out_dir_with_checkpoints_are_refused(single, tmp_path, capsys):
    out = copy_of(single, tmp_path)
    weights = single / "checkpoints" / "last.pt"
    before = contents(out)
    capsys.readouterr()
    assert main(["train", *TINY, "train.max_steps=4", f"model.weights={weights}", f"out_dir={out}"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"model.weights={weights} would be ignored: this run continues checkpoint" in err
    assert "use another out_dir or set train.resume=never" in err and "drop model.weights" in err
    assert contents(out) == before  # nothing written
    # The rule: a fine-tuning run, interrupted or extended, continues with its own weights.
    tuned = tmp_path / "tuned"
    assert main(["train", *TINY, "train.max_steps=2", f"model.weights={weights}", f"out_dir={tuned}"]) == 0
    assert main(["train", *TINY, "train.max_steps=4", f"model.weights={weights}", f"out_dir={tuned}"]) == 0
    assert f"resumed from {tuned / 'checkpoints' / 'step-000000002.pt'}" in capsys.readouterr().out


def test_a_longer_run_says_its_schedule_is_re_stretched(single, tmp_path, capsys):
    out = copy_of(single, tmp_path)
    capsys.readouterr()
    assert main(["train", *TINY, "train.max_steps=4", f"out_dir={out}"]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: the run length changed from 2 to 4 steps (train.max_steps=4): the cosine LR schedule is "
        "re-stretched over the new length from step 2"
    ]
    assert main(["train", *TINY, "train.max_steps=4", "sched.name=cosine", f"out_dir={out}"]) == 0  # same length
    assert "re-stretched" not in capsys.readouterr().out


def test_resume_from_a_checkpoints_folder_takes_its_newest(single, tmp_path, capsys):
    folder = single / "checkpoints"
    assert main(["train", *TINY, "train.max_steps=4", f"train.resume={folder}", f"out_dir={tmp_path / 'o'}"]) == 0
    assert f"resumed from {folder / 'step-000000002.pt'}:" in capsys.readouterr().out
    assert main(["eval", "--checkpoint", str(folder)]) == 2
    suggested = f"e.g. {folder / 'last'} or {folder / 'step-000000002.pt'}"  # `last`: the newest, in any format
    assert f"{folder} is a folder of checkpoints; give one of them, {suggested}" in one_line(capsys.readouterr().err)
    assert main(["export", "--checkpoint", str(folder), "--out", str(tmp_path / "model.pt")]) == 2
    assert suggested in one_line(capsys.readouterr().err)
    assert main(["export", "--checkpoint", str(folder / "last"), "--out", str(tmp_path / "model.pt")]) == 0
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    (unreadable / "step-000000002.pt").write_bytes(b"truncated")
    assert main(["train", *TINY, f"train.resume={unreadable}", f"out_dir={tmp_path / 'p'}"]) == 2
    assert f"train.resume={unreadable}: no checkpoint in that folder reads" in one_line(capsys.readouterr().err)


def test_a_refused_resume_leaves_out_dir_as_it_found_it(single, tmp_path, capsys):
    last = single / "checkpoints" / "last.pt"
    fresh, empty = tmp_path / "fresh", tmp_path / "empty"
    empty.mkdir()
    # Another model: named as the changed setting, not as tensors that do not fit.
    assert main(["train", *TINY, "model.name=resnet18_cifar", f"train.resume={last}", f"out_dir={fresh}"]) == 2
    err = one_line(capsys.readouterr().err)
    assert "was trained with other settings (model.name: smallcnn → resnet18_cifar)" in err and "tensor" not in err
    assert not fresh.exists()
    # A finished checkpoint past this run's length: refused, not "nothing to train".
    assert main(["train", *TINY, "train.max_steps=1", f"train.resume={last}", f"out_dir={empty}"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"checkpoint {last} is at step 2, already past train.max_steps=1 (1 steps); to continue it, raise" in err
    assert list(empty.iterdir()) == []  # no lock, no checkpoints/, no config.yaml or metrics.jsonl
