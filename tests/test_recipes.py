"""Training recipes: per-sample policies (TrivialAugment, RandAugment, AutoAugment, colour jitter,
random erasing) drawn per (seed, epoch, sample), the same whichever batch, rank or loader holds a
sample; progressive resizing by epoch; their options refused with one line when out of range."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import (
    TINY,
    assert_bitwise_equal,
    cli,
    final_params,
    load_checkpoint,
    max_rel_diff,
    run_here,
    slowed,
    stopped_after_first_checkpoint,
)
from multicard.base.config import DataConfig, MixConfig, load_config
from multicard.base.errors import UserError
from multicard.checkpoint import read_checkpoint
from multicard.data.augmentation.device_transform import DeviceTransform
from multicard.data.augmentation.mixing import BatchMix
from multicard.data.augmentation.policies import sample_policy
from multicard.data.augmentation.progressive import ProgressiveSize, progressive_size
from multicard.data.loading.sampling import repeated_order
from multicard.recipes import WeightAverage
from multicard.strategy.optim import lr_factor
from multicard.tools.verify.checks import check_coverage

ALL_POLICIES = ["trivialaugment", "randaugment", "autoaugment"]


@pytest.fixture(scope="module")
def images() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (24, 3, 16, 16), dtype=torch.uint8, generator=g), torch.arange(100, 124)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_a_sample_gets_the_same_ops_in_any_batch_and_new_ones_each_epoch(images, policy):
    x, indices = images
    ops = sample_policy(DataConfig(policy=policy, color_jitter=0.4, random_erasing=0.5), seed=3)
    whole = ops.pixels(x, indices, epoch=0)
    parts = torch.cat([ops.pixels(x[i : i + 5], indices[i : i + 5], epoch=0) for i in range(0, 24, 5)])
    assert torch.equal(whole, parts)
    assert (whole != x).any(dim=(1, 2, 3)).float().mean() > 0.5  # the policy changed most images
    assert not torch.equal(ops.pixels(x, indices, epoch=1), whole)
    erased = ops.erase(whole.float(), indices, epoch=0)
    assert torch.equal(erased[7:11], ops.erase(whole[7:11].float(), indices[7:11], epoch=0))
    assert 0 < (erased != whole.float()).any(dim=(1, 2, 3)).sum() < 24


def test_the_policies_leave_the_loops_random_stream_alone(images):
    x, indices = images
    ops = sample_policy(DataConfig(policy="randaugment", random_erasing=0.5), seed=3)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    ops.erase(ops.pixels(x, indices, 0).float(), indices, 0)
    assert torch.equal(torch.rand(3), expected)


def test_no_policy_or_augment_off_builds_nothing():
    assert sample_policy(DataConfig(), seed=0) is None
    assert sample_policy(DataConfig(policy="trivialaugment", augment=False), seed=0) is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.policy=augmix", "data.policy=augmix is not one of none, trivialaugment, randaugment, autoaugment"),
        ("data.policy_magnitude=31", "data.policy_magnitude=31 must be in [0, 30]"),
        ("data.policy_ops=0", "data.policy_ops=0 must be in [1, 14]"),
        ("data.random_erasing=1.5", "data.random_erasing=1.5 must be in [0, 1]"),
        ("data.color_jitter=-0.1", "data.color_jitter=-0.1 must be in [0, 1)"),
        ("data.progressive_min_size=40", "data.progressive_min_size=40 must be in [8, 32]"),
        (
            "data.progressive_min_size=16 data.progressive_start_epoch=3 data.progressive_end_epoch=2",
            "must satisfy 0 <= start <= end",
        ),
        ("mix.mode=global", "mix.mode=global is not one of batch, pair, elem"),
        ("mix.prob=2", "mix.prob=2.0 must be in [0, 1]"),
        ("mix.mixup_alpha=-1", "mix.mixup_alpha=-1.0 must be >= 0"),
        ("ema.decay=1", "ema.decay=1.0 must be in [0, 1)"),
        ("ema.every=0", "ema.every=0 must be > 0"),
        ("sched.warmup_start=1", "sched.warmup_start=1.0 must be in [0, 1)"),
        ("sched.name=poly", "sched.name=poly is not one of cosine, linear, step, constant"),
        (
            "data.repeats=3",
            "data.repeats=3 copies of each sample share a global batch: make "
            "train.global_batch_size=256 a multiple of it",
        ),
        (
            "data.eval_size=224",
            "data.eval_size=224 applies to images larger than 64 px (small images are evaluated "
            "at data.image_size=32); set data.eval_size=0",
        ),
        (
            "data.progressive_min_size=16 compile=true compile_mode=reduce-overhead",
            "set data.progressive_recompile=true to re-record them at each size",
        ),
    ],
)
def test_recipe_options_out_of_range_are_one_line(override, message):
    with pytest.raises(UserError, match=re.escape(message)):
        load_config(None, override.split())


def test_progressive_sizes_follow_the_epoch_in_steps_of_the_multiple():
    ramp = ProgressiveSize(min_size=160, max_size=192, start_epoch=17, end_epoch=20, multiple=32)
    assert [ramp(e) for e in (0, 17, 18, 19, 20, 23)] == [160, 160, 160, 192, 192, 192]
    assert ProgressiveSize(16, 32, 0, 4, 4).sizes(6) == [16, 20, 24, 28, 32]
    assert progressive_size(DataConfig()) is None


def test_the_device_transform_resizes_training_batches_to_the_epochs_size(images):
    x, indices = images
    finish = DeviceTransform([0.5] * 3, [0.25] * 3, torch.device("cpu"), None, 0, sizes=ProgressiveSize(8, 16, 0, 2, 4))
    assert [finish(x, indices, indices, epoch)[0].shape[-1] for epoch in range(4)] == [8, 12, 16, 16]


@pytest.mark.slow
def test_policies_train_alike_from_the_device_and_the_workers_loader(tmp_path):
    """TrivialAugment, colour jitter, random erasing and progressive resizing on: both loaders give
    bitwise-equal parameters (the ops run on the device after either loader), unlike a run without them."""
    run = [*TINY, "data.train_size=256", "data.val_size=64", "train.epochs=2", "data.policy=trivialaugment",
           "data.color_jitter=0.3", "data.random_erasing=0.25", "data.progressive_min_size=8",
           "data.progressive_end_epoch=1", "data.progressive_multiple=4"]  # fmt: skip
    params = {}
    for name, extra in (("device", []), ("workers", []), ("plain", ["data.policy=none", "data.random_erasing=0"])):
        loader = "workers" if name == "workers" else "device"
        run_here("train", *run, *extra, f"data.loader={loader}", f"out_dir={tmp_path / name}")
        params[name] = final_params(tmp_path / name)
    assert_bitwise_equal(params["workers"], params["device"])
    assert any(not torch.equal(params["plain"][k], params["device"][k]) for k in params["device"])


def test_a_per_epoch_schedule_is_torchvisions_linear_warmup_then_cosine():
    """sched.per_epoch with warmup_start: the lr of torchvision's reference scripts (LinearLR from
    0.01 over 5 epochs, then CosineAnnealingLR, both stepped once an epoch), at every step."""
    epochs, per_epoch, lr = 12, 3, 0.5
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=lr)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=5)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs - 5)
    reference = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[5])
    expected = []
    for _ in range(epochs):
        expected += [opt.param_groups[0]["lr"]] * per_epoch
        opt.step()
        reference.step()
    sched = load_config(None, ["sched.warmup_epochs=5", "sched.warmup_start=0.01", "sched.per_epoch=true"]).sched
    total = epochs * per_epoch
    ours = [lr * lr_factor(step, total, 5 * per_epoch, per_epoch, sched) for step in range(total)]
    assert ours == pytest.approx(expected, abs=1e-15)


def test_a_linear_schedule_falls_to_its_floor():
    sched = load_config(None, ["sched.name=linear", "sched.warmup_epochs=2", "sched.final_lr_ratio=0.1"]).sched
    factors = [lr_factor(step, 100, 20, 10, sched) for step in range(100)]
    assert factors[19] == 1.0 and factors[20] == 1.0 and factors[60] == pytest.approx(0.55)
    assert factors[99] == pytest.approx(0.1 + 0.9 / 80)


# ------------------------------------------------------------------ mixup and cutmix


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
def test_mixing_a_global_batch_in_parts_gives_the_same_images_and_targets(mode):
    """What 4 ranks (or micro-steps) of 4 samples each make of their parts equals the whole batch
    of 16 mixed at once: the pairs (2k, 2k+1) and all draws belong to the global batch."""
    g = torch.Generator().manual_seed(1)
    x, labels = torch.randn(16, 3, 8, 8, dtype=torch.float64, generator=g), torch.arange(16) % 5
    mix = BatchMix(MixConfig(mixup_alpha=0.8, cutmix_alpha=1.0, mode=mode))
    whole, targets = mix(x, labels, 5, (0, 2, 7), 16, 0)
    parts = [mix(x[i : i + 4], labels[i : i + 4], 5, (0, 2, 7), 16, i) for i in range(0, 16, 4)]
    assert torch.equal(whole, torch.cat([p[0] for p in parts]))
    assert torch.equal(targets, torch.cat([p[1] for p in parts]))
    assert torch.allclose(targets.sum(1), torch.ones(16, dtype=torch.float64))
    assert not torch.equal(whole, x) and not torch.equal(mix(x, labels, 5, (0, 2, 8), 16, 0)[0], whole)


def test_a_mixed_pair_holds_both_images_in_the_share_of_its_target():
    x = torch.stack([torch.zeros(3, 10, 10), torch.ones(3, 10, 10)]).double()
    labels = torch.tensor([0, 1])
    for cfg in (MixConfig(mixup_alpha=1.0), MixConfig(cutmix_alpha=1.0)):
        mixed, targets = BatchMix(cfg)(x, labels, 2, (0, 0, 3), 2, 0)
        # image 0 is zeros, image 1 ones: the mean of a mixed image is the share of image 1 in it
        assert mixed.mean(dim=(1, 2, 3)).tolist() == pytest.approx(targets[:, 1].tolist())


# ------------------------------------------------------------------ EMA of the weights


def test_weight_average_is_torchs_ema_and_swaps_in_and_out():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    reference = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9), use_buffers=True
    )
    average = WeightAverage(model, decay=0.9, every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 7):
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        average.update(step)
        if step % 2 == 0:
            reference.update_parameters(model)
    own = {k: v.clone() for k, v in model.state_dict().items()}
    with average.swapped_in():
        for name, value in reference.module.state_dict().items():
            if value.is_floating_point():
                assert torch.allclose(model.state_dict()[name], value, atol=1e-7), name
    assert all(torch.equal(model.state_dict()[k], v) for k, v in own.items())


# ------------------------------------------------------------------ repeated augmentation


def test_repeated_copies_share_a_global_batch_at_distinct_positions_and_ranks():
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    order = repeated_order(perm, global_batch=8, repeats=4)
    assert len(order) == 40  # the epoch keeps its 5 steps
    for step in range(5):
        batch = order[step * 8 : (step + 1) * 8]
        assert batch.tolist() == [j * 40 + int(i) for j in range(4) for i in perm[step * 2 : step * 2 + 2]]
        ranks = [batch[r * 2 : (r + 1) * 2] % 40 for r in range(4)]  # 4 ranks: each holds one copy of both
        assert all(sorted(r.tolist()) == sorted(ranks[0].tolist()) for r in ranks)
    epochs = [[order.tolist()]]
    assert check_coverage(epochs, 40, 8, repeats=4).status == "pass"
    assert check_coverage([[(order % 40).tolist()]], 40, 8, repeats=4).status == "fail"


# ------------------------------------------------------------------ all of them on: exact at any world size

# Everything on, in float64 without BatchNorm (whose per-rank statistics differ by design), 2 epochs
# of 8 steps under a constant LR, a checkpoint every 2 steps.
RECIPE = [*TINY, "data.train_size=256", "data.val_size=64", "train.epochs=2", "precision=fp64",
          "model.kwargs={norm: none}", "sched.name=constant", "checkpoint.every_steps=2", "data.loader=workers",
          "data.policy=trivialaugment", "data.random_erasing=0.25", "data.repeats=2", "mix.mixup_alpha=0.8",
          "mix.cutmix_alpha=1.0", "ema.decay=0.9", "eval_flip=true", "data.progressive_min_size=8",
          "data.progressive_end_epoch=1", "data.progressive_multiple=4"]  # fmt: skip
DDP2 = ("--nproc-per-node", "2")


def recipe_run(out: Path, *launch: str) -> Path:
    """out, after `multicard train` there, run by this process (conftest.run_here)."""
    run_here("train", *launch, *RECIPE, f"out_dir={out}")
    return out


def model_and_average(out: Path) -> dict[str, torch.Tensor]:
    state = load_checkpoint(out / "checkpoints" / "last.pt")
    return {**state["model"], **{f"ema.{k}": v for k, v in state["ema"].items()}}


@pytest.fixture(scope="module")
def ddp2_recipe(tmp_path_factory) -> Path:
    return recipe_run(tmp_path_factory.mktemp("ddp2"), *DDP2)


@pytest.mark.slow
@pytest.mark.distributed
def test_every_recipe_part_on_ddp2_trains_like_one_process(ddp2_recipe, tmp_path):
    single = recipe_run(tmp_path)
    assert max_rel_diff(model_and_average(ddp2_recipe), model_and_average(single)) < 1e-10
    epochs = [json.loads(line) for line in (single / "metrics.jsonl").read_text().splitlines() if '"epoch"' in line]
    assert {"ema_val_top1", "ema_val_loss"} <= epochs[-1].keys()


@pytest.mark.slow
@pytest.mark.distributed
def test_every_recipe_part_resumes_mid_epoch_bitwise(ddp2_recipe, tmp_path):
    stopped = stopped_after_first_checkpoint(tmp_path, *DDP2, *RECIPE, env=slowed(300))
    assert stopped % 8 and stopped < 16  # inside an epoch
    recipe_run(tmp_path, *DDP2)
    assert_bitwise_equal(model_and_average(tmp_path), model_and_average(ddp2_recipe))


@pytest.mark.slow
@pytest.mark.distributed
def test_eval_and_export_of_the_average_give_what_the_run_validated(ddp2_recipe, tmp_path):
    last = str(ddp2_recipe / "checkpoints" / "last.pt")
    epochs = [json.loads(line) for line in (ddp2_recipe / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in epochs if r["kind"] == "epoch"][-1]
    measured = json.loads(run_here("eval", "--checkpoint", last, "--ema", "--json").strip().splitlines()[-1])
    assert measured["top1"] == final["ema_val_top1"] and measured["loss"] == pytest.approx(
        final["ema_val_loss"], rel=1e-12
    )
    run_here("export", "--checkpoint", last, "--ema", "--out", str(tmp_path / "ema.pt"))
    exported = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert_bitwise_equal(exported, {**load_checkpoint(Path(last))["model"], **load_checkpoint(Path(last))["ema"]})


@pytest.mark.slow
def test_ema_flags_on_a_checkpoint_without_one_are_one_line(tmp_path):
    run_here("train", *TINY, "data.train_size=64", "data.val_size=32", f"out_dir={tmp_path}")
    last = str(tmp_path / "checkpoints" / "last.pt")
    for command in (
        ["eval", "--checkpoint", last, "--ema"],
        ["export", "--checkpoint", last, "--ema", "--out", str(tmp_path / "x.pt")],
    ):
        result = cli(*command)
        assert result.returncode == 2
        assert (
            result.stderr.strip()
            == f"multicard: error: checkpoint {last} holds no EMA of the weights (its run had ema.decay=0); drop --ema"
        )


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_keeps_the_average_in_its_sharded_checkpoint(ddp2_recipe, tmp_path):
    """fsdp×2 averages its shards: the EMA read back from the sharded checkpoint equals ddp's."""
    recipe_run(tmp_path, *DDP2, "strategy=fsdp")
    sharded = read_checkpoint(tmp_path / "checkpoints" / "last")
    reference = load_checkpoint(ddp2_recipe / "checkpoints" / "last.pt")
    assert max_rel_diff(sharded["ema"], reference["ema"]) < 1e-10
    assert max_rel_diff(sharded["model"], reference["model"]) < 1e-10


def test_mixing_an_odd_micro_batch_is_refused_before_the_workers_start(tmp_path):
    result = cli("train", "--nproc-per-node", "2", *TINY, "train.global_batch_size=6", "mix.cutmix_alpha=1",
                 f"out_dir={tmp_path / 'run'}")  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "multicard: error: mixup and CutMix pair neighbouring samples, so each process's micro-batch must be even, "
        "but train.global_batch_size=6 over 2 process(es) × train.grad_accum=1 gives 3; make it even"
    )
    assert not (tmp_path / "run").exists()
