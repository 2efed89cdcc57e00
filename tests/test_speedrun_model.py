"""speednet, the model of configs/cifar10_speedrun.yaml: shapes, size, determinism, and its
patch-whitening first layer (fitted on the first training batch, the same under ddp×2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import ROOT, final_params, run_here
from multicard.strategy.models import PatchWhitening, build_model

WIDTHS = [32, 128, 128]


def make(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("speednet", 10, {"widths": WIDTHS})


def images(n: int = 16, seed: int = 1) -> torch.Tensor:
    # Correlated neighbouring pixels and colours, as in photos, so whitening has something to undo.
    generator = torch.Generator().manual_seed(seed)
    smooth = torch.nn.functional.avg_pool2d(torch.randn(n, 1, 34, 34, generator=generator), 3, 1)
    return smooth.expand(n, 3, 32, 32) + 0.1 * torch.randn(n, 3, 32, 32, generator=generator)


def test_shapes_and_parameter_count():
    model = make()
    assert model(images(4)).shape == (4, 10)
    # whitening bias 24 + convs 9·(24·32 + 32·32 + 32·128 + 128·128 + 128·128 + 128·128) + BN shifts
    # 2·(32 + 128 + 128) + head 128·10
    expected = 24 + 9 * (24 * 32 + 32 * 32 + 32 * 128 + 3 * 128 * 128) + 2 * (32 + 128 + 128) + 128 * 10
    assert sum(p.numel() for p in model.parameters()) == expected == 497_240


def test_same_seed_same_model_and_same_training_forward():
    a, b = make(), make()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    x = images()
    assert torch.equal(a.train()(x), b.train()(x))
    assert not torch.equal(make(seed=1).state_dict()["2.weight"], a.state_dict()["2.weight"])


def test_whitening_is_fitted_on_the_first_training_batch_only():
    model = make()
    whitening = model[0]
    assert isinstance(whitening, PatchWhitening)
    model.eval()(images())  # an evaluation before training (check_input_size does one) fits nothing
    assert not whitening.fitted
    x = images()
    model.train()(x)
    assert whitening.fitted
    # The positive half of the filters decorrelates that batch's 2×2 patches and scales each
    # direction to variance λ/(λ + eps): close to 1, less for the faintest (the eps guards them).
    out = torch.nn.functional.conv2d(x.double(), whitening.weight[:12].double())
    flat = out.permute(0, 2, 3, 1).reshape(-1, 12)
    covariance = flat.T @ flat / len(flat)
    variances = covariance.diagonal()
    assert (covariance - variances.diag()).abs().max() < 1e-5
    assert variances.min() > 0.9 and variances.max() < 1
    fitted = whitening.weight.clone()
    model(images(seed=2))
    assert torch.equal(whitening.weight, fitted)  # later batches leave it alone


def test_fitted_whitening_travels_in_the_state_dict():
    model = make()
    model.train()(images())
    fresh = make(seed=3)
    fresh.load_state_dict(model.state_dict())
    assert fresh[0].fitted
    model.eval(), fresh.eval()
    assert torch.equal(model(images(seed=4)), fresh(images(seed=4)))


def _fit_on_half(rank: int, path: str, batch: torch.Tensor, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        whitening = PatchWhitening().train()
        whitening(batch[rank::2])
        torch.save(whitening.weight, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_ddp_ranks_whiten_alike_and_as_one_process(tmp_path):
    batch = images(8)
    mp.spawn(_fit_on_half, args=(str(tmp_path / "store"), batch, str(tmp_path / "w")), nprocs=2)
    ranks = [torch.load(tmp_path / f"w.{rank}") for rank in range(2)]
    single = PatchWhitening().train()
    single(batch)
    assert torch.equal(ranks[0], ranks[1])
    torch.testing.assert_close(ranks[0], single.weight, rtol=1e-5, atol=1e-5)


@pytest.mark.distributed
def test_recipe_trains_and_ddp_fits_the_whitening_of_one_process(tmp_path):
    """configs/cifar10_speedrun.yaml as shipped (on small synthetic data, narrow widths): under
    ddp×2 the whitening fitted inside DDP's first forward equals the one-process fit."""
    common = [
        "--config", str(ROOT / "configs" / "cifar10_speedrun.yaml"), "data.name=synthetic",
        "data.train_size=256", "data.val_size=64", "train.epochs=1", "train.global_batch_size=64",
        "model.kwargs.widths=[8,16,16]", "train.resume=never",
    ]  # fmt: skip
    runs = {"one": [], "two": ["--nproc-per-node", "2"]}
    run_here("train", *common, f"out_dir={tmp_path / 'one'}")
    run_here("train", *runs["two"], *common, f"out_dir={tmp_path / 'two'}")
    one, two = (final_params(tmp_path / name) for name in runs)
    assert one["0.fitted"] and two["0.fitted"]
    torch.testing.assert_close(two["0.weight"], one["0.weight"], rtol=1e-5, atol=1e-5)
