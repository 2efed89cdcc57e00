"""What a run is made of can be changed in one place: the loss is one argument of the Trainer,
and a checkpoint holds every component registered on the loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conftest import TINY
from multicard.base.config import load_config
from multicard.checkpoint import Checkpointer
from multicard.engine.trainer import Trainer
from multicard.run.assembly import Assembly
from multicard.runtime.environment import ProcessEnv


class Tally:
    """A component of the user's: any object with state_dict / load_state_dict."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self, whole: bool = False) -> dict[str, torch.Tensor]:
        return {"seen": torch.tensor(self.seen)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.seen = int(state["seen"])


def test_a_component_registered_on_the_loop_is_saved_and_resumed(tmp_path):
    cfg = load_config(None, [*TINY, "train.max_steps=2", f"out_dir={tmp_path}"])
    with Assembly(cfg, ProcessEnv("none")) as s:
        tally = s.trainer.loop.components["tally"] = Tally()
        s.trainer.fit(until=2, validate=False)
        tally.seen = 37
        Checkpointer(tmp_path, s.strategy, cfg.checkpoint, s.facts).save(s.trainer.loop)
    with Assembly(cfg, ProcessEnv("none")) as s:
        fresh = s.trainer.loop.components["tally"] = Tally()
        checkpointer = Checkpointer(tmp_path, s.strategy, cfg.checkpoint, s.facts)
        checkpointer.restore(checkpointer.choose("auto"), s.trainer.loop)
        assert fresh.seen == 37 and s.trainer.position.global_step == 2


def test_the_loss_is_one_argument_of_the_trainer(tmp_path):
    cfg = load_config(None, [*TINY, "train.max_steps=2", f"out_dir={tmp_path}"])
    calls = []

    def hinge(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append((logits.shape, target.shape))
        return F.multi_margin_loss(logits, target)

    with Assembly(cfg, ProcessEnv("none")) as s:
        t = s.trainer
        trainer = Trainer(s.strategy, t.model, t.optimizer, t.scheduler, t.train_loader, None, t.schedule, loss=hinge)
        trainer.fit(until=2, validate=False)
    batch = cfg.train.global_batch_size
    assert calls == [(torch.Size([batch, 10]), torch.Size([batch]))] * 2
