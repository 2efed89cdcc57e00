"""The run's one meter (run/logbook.py), as `multicard train`'s recipe feeds it, on one CPU process:
what the records and checkpoints hold."""

from __future__ import annotations

import math

import pytest
import torch

from multicard.engine.loop import Loop
from multicard.engine.phases import IDLE
from multicard.recipes.classifier import EPOCH_NAMES, train_values
from multicard.run.logbook import Logbook
from multicard.runtime.process_group import ProcessContext
from multicard.strategy.base import ModelSetup, Strategy
from multicard.strategy.precision import Precision


@pytest.fixture
def book() -> Logbook:
    ctx = ProcessContext(0, 0, 1, 1, torch.device("cpu"), distributed=False)
    strategy = Strategy(ctx, Precision("fp16", "cpu"), ModelSetup())  # fp16: the scaler skips NaN/inf steps
    return Logbook(Loop(strategy), 4, dict(EPOCH_NAMES), of_config=True)


def micro_step(book: Logbook, loss: float, hits: int, samples: int = 4) -> None:
    logits = torch.zeros(samples, 3)
    logits[:, 1] = 1.0  # every prediction is class 1
    targets = torch.tensor([1] * hits + [0] * (samples - hits))
    book.watch_loss(torch.tensor(loss))  # what run.backward is given
    book.add(train_values(torch.tensor(loss), logits, targets))  # what the recipe logs


def test_the_step_record_sums_micro_steps_and_counts_a_nonfinite_loss(book):
    micro_step(book, 2.0, hits=1)
    micro_step(book, 1.0, hits=3)
    micro_step(book, math.nan, hits=4)  # counted as samples and hits, its loss left out
    assert book.since_record == {} and sum(len(w) for w in book.window.values()) > 0  # nothing reduced before asked
    record = book.step_record(lr=0.1)
    assert list(record)[:6] == ["epoch", "step", "loss", "top1", "lr", "img_per_s"]
    assert record["loss"] == pytest.approx((2.0 * 4 + 1.0 * 4) / 12)
    assert record["top1"] == pytest.approx(100 * 8 / 12)
    assert record["fp16_skipped"] == 1 and "ranks" not in record
    assert book.since_record == {} and book.skipped == 0  # the epoch keeps its sums
    assert book.epoch["loss"][:2] == [3.0, 3.0] and book.epoch["top1"][:2] == pytest.approx([200.0, 3.0])
    assert book.loop.clock.phase == IDLE


def test_the_epoch_sums_go_into_checkpoints_and_back(book):
    micro_step(book, 0.5, hits=2)
    book.reduce()
    saved = book.state_dict()  # the checkpoint's position holds them
    assert saved == {"logged": {"loss": [0.5, 1.0, -math.inf, math.inf], "top1": [50.0, 1.0, -math.inf, math.inf]}}
    book.start_epoch(fresh=True)
    assert book.state_dict() == {"logged": {}}
    book.load_state_dict({"epoch": 3, **saved})
    book.start_epoch(fresh=False)  # a resumed epoch: its img/s counts only the steps trained since
    book.add({"val_loss": 1.5, "val_top1": 50.0, "val_top5": 90.0, "val_samples": 8})  # the recipe's validation
    record = book.epoch_record(lr=0.1)
    assert record["train_loss"] == 0.5 and record["train_top1"] == 50.0 and record["img_per_s"] == 0.0
    assert list(record)[2:8] == ["train_loss", "train_top1", "val_loss", "val_top1", "val_top5", "val_samples"]
    assert (record["val_loss"], record["val_top1"], record["val_samples"]) == (1.5, 50.0, 8)
    assert len(record["peak_mem_mb"]) == 1


def test_a_number_every_rank_logs_alike_is_recorded_exactly(book):
    """A reduced score (the same on every rank, once an epoch) is its value in the records, not a mean
    of copies that a sum over 3 ranks would round."""
    value = 0.7  # summed 3 times, then / 3, is not this
    assert (value + value + value) / 3 != value
    for _ in range(3):
        book.add({"val_top1": value})
    assert book.epoch_record(lr=0.1)["val_top1"] == value
