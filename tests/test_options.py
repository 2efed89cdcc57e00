"""The rules of an option are declared beside the option.

Each config section is a dataclass whose `check` holds its own rules, and whose other `check_*`
methods take the run's facts (strategy, GPUs, process count) as arguments; `Config.check` and
`Config.check_run` call the sections. In-process, no torch run.
"""

from __future__ import annotations

import dataclasses

import pytest

from multicard.base.config import Config, DDPConfig, FSDPConfig, MixConfig, TrainConfig
from multicard.base.errors import UserError

RULELESS = {"model", "net"}  # model.name is checked where the model is built; net's interface where it is used


def test_every_section_declares_its_own_check():
    for f in dataclasses.fields(Config):
        section = type(getattr(Config(), f.name))
        if not dataclasses.is_dataclass(section) or f.name in RULELESS:
            continue
        assert "check" in vars(section), f"{f.name}: {section.__name__} has no check() of its own"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (DDPConfig(comm_hook="lz4"), "ddp.comm_hook=lz4 is not one of"),
        (FSDPConfig(replicate="racks"), "fsdp.replicate=racks is not one of"),
        (MixConfig(prob=2.0), "mix.prob=2.0 must be in [0, 1]"),
        (TrainConfig(label_smoothing=1.0), "train.label_smoothing=1.0 must be in [0, 1)"),
    ],
)
def test_a_section_alone_refuses_its_bad_values(section, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        section.check()


def test_the_rules_with_the_strategy_are_the_configs_own_with_the_facts_as_arguments():
    """What topology.resolve asks, asked of the config with the strategy, GPUs and processes given."""
    with pytest.raises(UserError, match="ddp.comm_hook=fp16 compresses DDP's all-reduce"):
        Config(ddp=DDPConfig(comm_hook="fp16")).check_run("fsdp", [], 2, 2, training=True)
    with pytest.raises(UserError, match="fsdp.reshard_after_forward is an FSDP option"):
        Config(fsdp=FSDPConfig(reshard_after_forward=False)).check_run("ddp", [], 2, 2, training=True)
    with pytest.raises(UserError, match="each process's micro-batch must be even"):
        Config(mix=MixConfig(mixup_alpha=0.2), train=TrainConfig(global_batch_size=6)).check_run("ddp", [], 2, 2, True)
    with pytest.raises(UserError, match="is not divisible by 4 process"):
        Config(train=TrainConfig(global_batch_size=6)).check_run("ddp", [], 4, 4, training=True)
    Config(train=TrainConfig(global_batch_size=6)).check_run("ddp", [], 4, 4, training=False)  # eval: no batch
