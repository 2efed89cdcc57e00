"""What a run is made of can be changed in one place: the loss is one argument of `multicard train`'s
recipe, and a checkpoint holds every component registered with the run (run.register)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY
from multicard.base.config import load_config
from multicard.base.errors import UserError
from multicard.recipes import ImageClassifier


class Tally:
    """A component of the user's: any object with state_dict / load_state_dict."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self, whole: bool = False) -> dict[str, torch.Tensor]:
        return {"seen": torch.tensor(self.seen)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.seen = int(state["seen"])


def test_a_component_registered_with_the_run_is_saved_and_resumed(tmp_path):
    cfg = load_config(None, [*TINY, "train.max_steps=2", f"out_dir={tmp_path}"])
    with ImageClassifier(cfg, evaluate=False) as recipe:
        tally = Tally()
        recipe.run.register("tally", tally)
        tally.seen = 37
        recipe.train()  # its last checkpoint, at step 2, holds the tally
    with ImageClassifier(cfg, evaluate=False) as recipe:  # the same run again: it resumes, complete
        fresh = Tally()
        recipe.run.register("tally", fresh)
        with pytest.raises(UserError, match="a checkpoint part of that name exists"):
            recipe.run.register("tally", Tally())
        recipe.train()
        assert fresh.seen == 37 and recipe.run.position.global_step == 2


def test_the_loss_is_one_argument_of_the_recipe(tmp_path):
    cfg = load_config(None, [*TINY, "train.max_steps=2", f"out_dir={tmp_path}"])
    calls = []

    def hinge(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append((logits.shape, target.shape))
        return F.multi_margin_loss(logits, target)

    with ImageClassifier(cfg, loss=hinge, evaluate=False) as recipe:
        recipe.train()
    batch = cfg.train.global_batch_size
    assert calls == [(torch.Size([batch, 10]), torch.Size([batch]))] * 2
