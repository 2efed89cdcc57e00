"""The loop's statistics (multicard.engine.meters) on one CPU process: what the records and checkpoints hold."""

from __future__ import annotations

import math

import pytest
import torch

from multicard.engine.meters import EvalResult, Sums, TrainMeter
from multicard.engine.phases import IDLE, PhaseClock
from multicard.runtime.process_group import ProcessContext
from multicard.strategy.base import ModelSetup, Strategy
from multicard.strategy.precision import Precision


@pytest.fixture
def meter() -> TrainMeter:
    ctx = ProcessContext(0, 0, 1, 1, torch.device("cpu"), distributed=False)
    strategy = Strategy(ctx, Precision("fp32", "cpu"), ModelSetup())
    return TrainMeter(strategy, PhaseClock(ctx.device))


def micro_step(meter: TrainMeter, loss: float, hits: int, samples: int = 4) -> None:
    logits = torch.zeros(samples, 3)
    logits[:, 1] = 1.0  # every prediction is class 1
    targets = torch.tensor([1] * hits + [0] * (samples - hits))
    meter.add(torch.tensor(loss), logits, targets)


def test_the_step_record_sums_micro_steps_and_counts_a_nonfinite_loss(meter):
    micro_step(meter, 2.0, hits=1)
    micro_step(meter, 1.0, hits=3)
    micro_step(meter, math.nan, hits=4)  # counted as samples and hits, its loss left out
    assert meter.since_log == Sums() and meter.window.abs().sum() > 0  # nothing reduced before asked
    assert meter.reduce() == 1
    record = meter.step_record(epoch=0, step=3, lr=0.1)
    assert list(record)[:6] == ["epoch", "step", "loss", "top1", "lr", "img_per_s"]
    assert record["loss"] == pytest.approx((2.0 * 4 + 1.0 * 4) / 12)
    assert record["top1"] == pytest.approx(100 * 8 / 12)
    assert record["fp16_skipped"] == 1 and "ranks" not in record
    assert meter.since_log == Sums() and meter.epoch == Sums(12.0, 8.0, 12.0)  # the epoch keeps its sums
    assert meter.clock.phase == IDLE


def test_the_epoch_sums_go_into_checkpoints_and_back(meter):
    micro_step(meter, 0.5, hits=2)
    meter.reduce()
    assert meter.state_dict() == {"epoch_totals": [2.0, 2.0, 4.0]}  # the checkpoint's position holds them
    meter.new_epoch()
    assert meter.state_dict() == {"epoch_totals": [0.0, 0.0, 0.0]}
    meter.load_state_dict({"epoch": 3, "epoch_totals": [2.0, 2.0, 4.0]})
    meter.start_epoch()  # a resumed epoch: its img/s counts only the samples trained since
    meter.end_training()
    record = meter.epoch_record(epoch=3, step=7, lr=0.1, val=EvalResult(loss=1.5, top1=50.0, top5=90.0, samples=8))
    assert record["train_loss"] == 0.5 and record["train_top1"] == 50.0 and record["img_per_s"] == 0.0
    assert list(record)[-4:] == ["val_loss", "val_top1", "val_top5", "val_samples"]
    assert len(record["peak_mem_mb"]) == 1
