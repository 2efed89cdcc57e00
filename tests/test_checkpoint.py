import pytest
import torch

from multicard import checkpoint
from multicard.errors import UserError


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("simulated failure while writing")


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "ck" / "last.pt"
    checkpoint.save_atomic({"model": {"w": torch.ones(2)}, "config": {}}, path)
    with pytest.raises(RuntimeError, match="simulated"):
        checkpoint.save_atomic({"model": Unpicklable(), "config": {}}, path)
    assert torch.equal(checkpoint.load(path)["model"]["w"], torch.ones(2))
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # no temp file left


def test_damaged_or_foreign_files_give_one_line_errors(tmp_path):
    good = tmp_path / "good.pt"
    checkpoint.save_atomic({"model": {}, "config": {}}, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:40])
    with pytest.raises(UserError, match="cannot be read"):
        checkpoint.load(truncated)
    other = tmp_path / "other.pt"
    torch.save({"weights": 1}, other)
    with pytest.raises(UserError, match="not a multicard checkpoint"):
        checkpoint.load(other)
    with pytest.raises(UserError, match="not found"):
        checkpoint.load(tmp_path / "missing.pt")


def test_state_of_another_model_is_refused():
    with pytest.raises(UserError, match="does not fit this model"):
        checkpoint.load_model_state(torch.nn.Linear(3, 2), {"weight": torch.zeros(5, 5)}, "x.pt")
