"""Numerics alike at any world size: repeated augmentation's copies against mixing
pairs and micro-batches; speednet's whitening fitted alike at any world size; train top-1 under
mixing."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import TINY, run_here
from multicard.base.config import MixConfig
from multicard.cli.main import main
from multicard.data.augmentation.mixing import StepMix, mixing
from multicard.data.loading.sampling import BatchSplit, ShardedBatchSampler, copies_in_a_micro_batch, repeats_note
from multicard.recipes import classifier
from multicard.recipes.classifier import train_top1
from multicard.strategy.models import PatchWhitening, patch_moments
from multicard.strategy.syncbn import GlobalBatchNorm2d


def photos(n: int, seed: int = 0) -> torch.Tensor:
    """Correlated neighbouring pixels and colours, as in photos: a covariance with spread eigenvalues."""
    generator = torch.Generator().manual_seed(seed)
    smooth = F.avg_pool2d(torch.randn(n, 1, 34, 34, generator=generator), 3, 1)
    return smooth.expand(n, 3, 32, 32) + 0.1 * torch.randn(n, 3, 32, 32, generator=generator)


# ------------------------------------------------------------------ the whitening, exactly


def test_patch_moments_are_the_same_bits_in_any_split_and_order():
    patches = F.unfold(photos(6).double(), 2).transpose(1, 2).reshape(-1, 12)
    whole = patch_moments(patches, 4.0, 16)
    order = torch.randperm(len(patches), generator=torch.Generator().manual_seed(1))
    shuffled = patches[order]
    parts = [patch_moments(part, 4.0, 16) for part in shuffled.tensor_split([7, 2000, 3001])]
    assert torch.equal(sum(parts[1:], parts[0]), whole)  # float64 sums of integers below 2^53: exact
    assert torch.equal(whole, whole.T)
    rounded = (patches * 2**14).round() / 2**14  # the grid of 16 bits below the unit 4
    assert torch.allclose(whole * 2.0**-28, rounded.T @ rounded, rtol=1e-13, atol=0)


class Ranks:
    """torch.distributed.all_reduce between threads, each a rank holding its share of the batch."""

    def __init__(self, world: int) -> None:
        self.barrier, self.slots, self.me = threading.Barrier(world), [torch.empty(0)] * world, threading.local()

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> None:
        self.slots[self.me.rank] = tensor.clone()
        self.barrier.wait()
        inputs = torch.stack(self.slots)
        self.barrier.wait()  # every rank has read before any writes again
        tensor.copy_(inputs.amax(0) if op == dist.ReduceOp.MAX else inputs.sum(0))

    def run(self, work: Callable[[torch.Tensor], Any], shares: tuple[torch.Tensor, ...]) -> list[Any]:
        """work(share) on each rank's thread (DDP's contiguous shares of the global batch); their results."""
        out: list[Any] = [None] * len(shares)

        def rank(r: int) -> None:
            self.me.rank = r
            try:
                out[r] = work(shares[r])
            except BaseException:
                self.barrier.abort()  # the other ranks stop waiting for this one
                raise

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(shares))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return out


def fit_whitening(images: torch.Tensor) -> torch.Tensor:
    whitening = PatchWhitening().double().train()  # as verify's float64 runs hold it
    whitening(images)
    return whitening.weight


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_ranks_fit_the_whitening_of_one_process_bitwise(monkeypatch, world):
    """Nearly equal eigenvalues turn their eigenvectors by rounding/gap: a float sum of the
    covariance in another order moved ddp×2's parameters 1e-9 away from one process's."""
    batch = photos(32, seed=2)
    single = fit_whitening(batch)
    ranks = Ranks(world)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", ranks.all_reduce)
    fitted = ranks.run(fit_whitening, batch.tensor_split(world))
    assert all(torch.equal(weight, single) for weight in fitted)


# ------------------------------------------------------------------ synced BatchNorm, centred


def normalise(norm: torch.nn.BatchNorm2d, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`norm` in training on `batch`: its output, the input's gradient and the running statistics
    (momentum 1: the batch's own mean and unbiased variance)."""
    x = batch.clone().requires_grad_()
    y = norm.double().train()(x)
    (y * y.detach().cos()).sum().backward()  # an uneven gradient: the statistics' own gradient counts
    return y.detach(), x.grad, norm.running_mean, norm.running_var


def test_global_batchnorm_over_2_ranks_equals_one_process_when_the_mean_dwarfs_the_std(monkeypatch):
    """E[x²] − E[x]² over the ranks cancelled 8 of float64's 16 digits here: variance 1e-8 off."""
    batch = 1e4 + torch.randn(8, 3, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y, grad, mean, var = normalise(torch.nn.BatchNorm2d(3, momentum=1.0), batch)
    ranks = Ranks(2)
    monkeypatch.setattr(dist, "all_reduce", ranks.all_reduce)
    per_rank = ranks.run(lambda share: normalise(GlobalBatchNorm2d(3, momentum=1.0), share), batch.tensor_split(2))
    for *_, rank_mean, rank_var in per_rank:  # the one-pass variance was 1.5e-8 off
        assert torch.allclose(rank_var, var, rtol=1e-14, atol=0)
        assert torch.allclose(rank_mean, mean, rtol=1e-15, atol=0)
    # x − mean carries the rounding of x (ulp 2e-12 at 10⁴) in either implementation
    assert torch.allclose(torch.cat([r[0] for r in per_rank]), y, rtol=0, atol=1e-11)
    assert torch.allclose(torch.cat([r[1] for r in per_rank]), grad, rtol=0, atol=1e-11)


# ------------------------------------------------------------------ train top-1 under mixing


def test_train_top1_under_mixing_scores_the_mixed_targets():
    logits = torch.tensor([[0.0, 9.0, 0.0], [9.0, 0.0, 0.0], [0.0, 0.0, 9.0]])  # predicts 1, 0, 2
    targets = torch.tensor([[0.3, 0.7, 0.0], [0.3, 0.7, 0.0], [0.0, 0.6, 0.4]])  # λ own + (1 − λ) partner
    mixed = train_top1(logits, targets)  # percent of the micro-batch of 3
    unmixed = train_top1(logits, torch.tensor([1, 1, 2]))  # class indices, as before
    correct, count = (mixed + unmixed).item() * 3 / 100, 2 * len(logits)
    assert correct == pytest.approx(0.7 + 0.3 + 0.4 + 2) and count == 6


# ------------------------------------------------------------------ copies, pairs, micro-batches


def _mixed_targets(split: BatchSplit, repeats: int, mode: str, num_samples: int) -> list[torch.Tensor]:
    """Every rank's mixed targets of one epoch's micro-steps, each sample its own class; λ near ½
    (Beta(1000, 1000)), so both members of a pair always keep a visible share."""
    cfg = MixConfig(mixup_alpha=1000.0, mode=mode)
    out = []
    for rank in range(split.world_size):
        mix = mixing(cfg, split, rank, seed=0, num_classes=num_samples)
        assert isinstance(mix, StepMix)
        sampler = ShardedBatchSampler(num_samples, split, rank, seed=0, repeats=repeats)
        for i, indices in enumerate(sampler):
            step, micro = divmod(i, split.grad_accum)
            sample = indices % num_samples
            _, targets = mix(torch.zeros(len(indices), 1, 2, 2, dtype=torch.float64), sample, 0, step, micro)
            out.append(targets)
    return out


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
def test_copies_never_form_a_mixing_pair_at_any_world_size(mode):
    """Copies stand B/k positions apart and a pair is positions 2i, 2i+1: with at least two
    distinct samples per global batch (B/k ≥ 2; odd too), a pair is two different samples."""
    for batch, repeats in [(32, 16), (32, 8), (24, 8), (36, 12)]:
        for world, accum in [(1, 1), (2, 1), (2, 2), (4, 1)]:
            if (batch // (world * accum)) % 2:
                continue  # an odd micro-batch is refused with mixing on (MixConfig.check_pairs)
            for targets in _mixed_targets(BatchSplit(batch, accum, world), repeats, mode, num_samples=2 * batch):
                assert ((targets > 0).sum(1) == 2).all(), (batch, repeats, world, accum)


def test_a_global_batch_of_one_samples_copies_is_refused_with_mixing(tmp_path, capsys):
    args = ["train", *TINY, "data.repeats=32", f"out_dir={tmp_path / 'run'}"]
    assert main([*args, "mix.mixup_alpha=0.2"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "multicard: error: data.repeats=32 fills each global batch of 32 with copies of one sample, which mixup "
        "and CutMix would mix with itself; lower data.repeats to at most 16 or raise train.global_batch_size to 64"
    )
    assert not (tmp_path / "run").exists()


def test_copies_share_a_micro_batch_exactly_when_it_holds_more_than_b_over_k():
    # B=32 on 2 processes, micro-batches of 16 (4 samples × 4 copies, 2 × 8)
    assert copies_in_a_micro_batch(BatchSplit(32, 1, 2), 8) == 4
    assert copies_in_a_micro_batch(BatchSplit(32, 1, 2), 16) == 8
    assert copies_in_a_micro_batch(BatchSplit(32, 1, 8), 8) == 1  # k processes: every copy on its own rank
    assert copies_in_a_micro_batch(BatchSplit(32, 2, 2), 4) == 1  # micro-batch 8 = B/k, over accumulation
    assert copies_in_a_micro_batch(BatchSplit(24, 1, 4), 6) == 2  # 6 > B/k = 4: ⌈6/4⌉
    assert repeats_note(BatchSplit(32, 1, 8), 8) is None and repeats_note(BatchSplit(32, 1, 2), 1) is None
    assert repeats_note(BatchSplit(32, 1, 2), 8) == (
        "note: data.repeats=8 puts up to 4 copies of a sample in one process's micro-batch of 16; copies share "
        "none when it holds at most train.global_batch_size/data.repeats = 4 (without accumulation: 8 or more "
        "processes)"
    )


def test_a_mixed_repeated_run_notes_its_copies_and_scores_the_mixed_targets(tmp_path, monkeypatch):
    seen = []
    values = classifier.train_values  # what the recipe logs of each micro-step (its targets: mixed ones here)
    monkeypatch.setattr(classifier, "train_values", lambda loss, out, t: (seen.append(t), values(loss, out, t))[1])
    out = run_here("train", *TINY, "data.repeats=2", "mix.mixup_alpha=0.2", "train.max_steps=2",
                   "data.train_size=64", "data.val_size=16", f"out_dir={tmp_path}")  # fmt: skip
    assert "note: data.repeats=2 puts up to 2 copies of a sample in one process's micro-batch of 32" in out
    assert len(seen) == 2 and all(t.shape == (32, 10) and t.is_floating_point() for t in seen)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    hits = [r for r in records if r.get("kind") == "epoch"][-1]["train_top1"] * 64 / 100  # exact: 64 = 2^6
    assert hits != round(hits)  # credit λ or 1 − λ: not a whole number of samples
