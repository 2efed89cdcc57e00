import pytest
import torch

from multicard.base.atomic import save_atomic
from multicard.base.errors import UserError
from multicard.checkpoint import check_model_fits, load_file
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
