import pytest
import torch

from multicard.base.errors import UserError
from multicard.data.augmentation.augment import crop_flip
from multicard.data.loading.sampling import BatchSplit, ShardedBatchSampler, eval_shard


def _epoch(num_samples, global_batch, accum, world, epoch, seed=0):
    """Per optimizer step, the sorted union of what all ranks read (simulated ranks)."""
    plan = BatchSplit(global_batch, accum, world)
    samplers = [ShardedBatchSampler(num_samples, plan, r, seed) for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    assert all(len(chunks) == len(per_rank[0]) for chunks in per_rank)
    steps = []
    for step in range(plan.steps_per_epoch(num_samples)):
        chunks = [c for rank in per_rank for c in rank[step * accum : (step + 1) * accum]]
        steps.append(torch.cat(chunks))
    return steps


@pytest.mark.parametrize("world, accum", [(1, 1), (2, 1), (3, 1), (2, 2), (4, 3)])
def test_each_sample_once_per_epoch_across_ranks(world, accum):
    n, batch = 960, 12 * world * accum
    seen = torch.cat(_epoch(n, batch, accum, world, epoch=0))
    assert seen.numel() == (n // batch) * batch
    assert seen.unique().numel() == seen.numel()  # no duplicates
    if n % batch == 0:
        assert torch.equal(seen.sort().values, torch.arange(n))


def test_global_batches_do_not_depend_on_world_size_or_accumulation():
    reference = [s.sort().values for s in _epoch(600, 24, 1, 1, epoch=3)]
    for world, accum in [(2, 1), (3, 1), (2, 2), (4, 3), (1, 4)]:
        steps = [s.sort().values for s in _epoch(600, 24, accum, world, epoch=3)]
        assert all(torch.equal(a, b) for a, b in zip(reference, steps, strict=True))


def test_order_changes_between_epochs_and_repeats_with_the_seed():
    e0 = torch.cat(_epoch(500, 20, 1, 2, epoch=0))
    e1 = torch.cat(_epoch(500, 20, 1, 2, epoch=1))
    assert not torch.equal(e0, e1)
    assert torch.equal(e0, torch.cat(_epoch(500, 20, 1, 2, epoch=0)))
    assert not torch.equal(e0, torch.cat(_epoch(500, 20, 1, 2, epoch=0, seed=1)))


def test_resume_position_skips_the_steps_done():
    plan = BatchSplit(20, 1, 2)
    full = ShardedBatchSampler(500, plan, 1, seed=0)
    full.set_epoch(2)
    later = ShardedBatchSampler(500, plan, 1, seed=0)
    later.set_epoch(2, start_step=10)
    assert len(later) == len(full) - 10
    assert all(torch.equal(a, b) for a, b in zip(list(full)[10:], later, strict=True))


def test_batch_plan_derives_micro_batch_and_names_the_fix():
    assert BatchSplit(256, 2, 4).micro_batch == 32
    with pytest.raises(UserError, match="multiple of 6"):
        BatchSplit(64, 2, 3)


def test_too_small_dataset_is_refused():
    with pytest.raises(UserError, match="fewer than one global batch"):
        ShardedBatchSampler(10, BatchSplit(32, 1, 1), 0, 0)


@pytest.mark.parametrize("n, world", [(1001, 1), (1001, 2), (1001, 3), (5, 8), (0, 2)])
def test_eval_shards_cover_every_sample_exactly_once(n, world):
    shards = [eval_shard(n, r, world) for r in range(world)]
    covered = [i for s in shards for i in s]
    assert covered == list(range(n))
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1


def test_augmentation_depends_only_on_seed_epoch_and_index():
    images = torch.randint(0, 256, (40, 3, 8, 8), dtype=torch.uint8)
    idx = torch.arange(40)
    whole = crop_flip(images, idx, seed=1, epoch=2, padding=2, flip=True)
    # Same samples read in another grouping and order give the same pixels.
    order = torch.randperm(40)
    parts = torch.cat([crop_flip(images[c], idx[c], 1, 2, 2, True) for c in order.split(7)])
    assert torch.equal(parts, whole[torch.cat(list(order.split(7)))])
    assert not torch.equal(whole, crop_flip(images, idx, seed=1, epoch=3, padding=2, flip=True))
    assert not torch.equal(whole, images)  # it does augment


def test_crop_keeps_pixels_and_flip_mirrors():
    images = torch.arange(2 * 1 * 4 * 4, dtype=torch.uint8).view(2, 1, 4, 4)
    flipped_only = crop_flip(images, torch.arange(2), seed=0, epoch=0, padding=0, flip=True)
    for a, b in zip(flipped_only, images, strict=True):
        assert torch.equal(a, b) or torch.equal(a, b.flip(2))
