"""Which samples each rank reads: global batches that do not depend on the world size.

An epoch is a permutation drawn from (seed, epoch). Optimizer step s takes the global batch
perm[s*B:(s+1)*B]; micro-step m of it takes a contiguous 1/grad_accum slice, and rank r takes
its contiguous 1/world_size part of that slice. So the same samples form each optimizer step
whatever the world size, and every sample is read once per epoch (a trailing partial global
batch is dropped, with a fresh permutation each epoch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from multicard.base.config import micro_batch
from multicard.base.errors import UserError


@dataclass(frozen=True)
class BatchSplit:
    """Global batch → per-process micro-batch; derived once, here."""

    global_batch: int
    grad_accum: int
    world_size: int

    def __post_init__(self) -> None:
        micro_batch(self.global_batch, self.grad_accum, self.world_size)  # refuses a batch that does not split

    @property
    def micro_batch(self) -> int:
        """Samples one process handles in one micro-step."""
        return micro_batch(self.global_batch, self.grad_accum, self.world_size)

    def steps_per_epoch(self, num_samples: int) -> int:
        return num_samples // self.global_batch


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=g)


def sequential_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """Every epoch in the dataset's own order (a loader that does not shuffle)."""
    return torch.arange(num_samples)


def streams_order(split: BatchSplit) -> Callable[[int, int, int], torch.Tensor]:
    """Contiguous streams, as the classic `batchify` of truncated backpropagation through time makes
    them: the dataset (consecutive segments of a sequence) is cut into S = global_batch/grad_accum
    streams of L = num_samples // S consecutive samples, stream j being samples j·L .. j·L+L-1.
    Micro-step m of optimizer step s takes segment s·grad_accum + m of every stream, and each rank
    its contiguous share of the streams — the same streams at every step and micro-step, so a rank
    carries each stream's state (an RNN's hidden state) from one batch to the next. The global
    batches are the same at any world size; what a rank holds is 1/world_size of the streams."""
    streams, accum = split.global_batch // split.grad_accum, split.grad_accum

    def order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
        length = num_samples // streams
        steps = length // accum
        s = torch.arange(steps).view(-1, 1, 1)
        m = torch.arange(accum).view(1, -1, 1)
        j = torch.arange(streams).view(1, 1, -1)
        return (j * length + s * accum + m).reshape(-1)

    return order


ORDERS = ("shuffle", "sequential", "streams")  # what a user's loader may ask for (run.loader's `order`)


def sample_order(name: str, split: BatchSplit) -> Callable[[int, int, int], torch.Tensor]:
    """The epoch order a loader's `order` names: shuffled by (seed, epoch), in order, or in streams."""
    return {"shuffle": epoch_permutation, "sequential": sequential_order}.get(name) or streams_order(split)


def repeated_order(perm: torch.Tensor, global_batch: int, repeats: int) -> torch.Tensor:
    """Repeated augmentation: each global batch holds global_batch/repeats samples of `perm`, in
    order, `repeats` times; copy j of sample i is named j·N + i (its augmentation differs) and
    stands global_batch/repeats positions after copy j-1. So copies never form a mixing pair
    (positions 2k, 2k+1) unless the batch is copies of one sample (MixConfig.check_repeats refuses
    that with mixing on), and never share a micro-batch of at most global_batch/repeats samples
    (copies_in_a_micro_batch). The epoch keeps its number of steps (it sees 1/repeats of the
    samples), as torchvision's and DeiT's repeated-augmentation samplers keep it."""
    num_samples, distinct = len(perm), global_batch // repeats
    steps = num_samples // global_batch
    chosen = perm[: steps * distinct].view(steps, 1, distinct)
    copies = torch.arange(repeats).view(1, repeats, 1) * num_samples
    return (chosen + copies).reshape(-1)


class ShardedBatchSampler:
    """Yields this rank's index tensor for each micro-step of an epoch."""

    def __init__(
        self, num_samples: int, split: BatchSplit, rank: int, seed: int, repeats: int = 1,
        order: Callable[[int, int, int], torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        self.num_samples = num_samples
        self.split = split
        self.rank = rank
        self.seed = seed
        self.repeats = repeats
        self.order = order or epoch_permutation  # (num_samples, seed, epoch) → the epoch's order (data.order)
        self.epoch = 0
        self.start_step = 0  # optimizer steps of this epoch already done (for resuming)
        if split.steps_per_epoch(num_samples) == 0:
            raise UserError(
                f"the training set has {num_samples} samples, fewer than one global batch of "
                f"{split.global_batch}; lower train.global_batch_size"
            )

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch = epoch
        self.start_step = start_step

    def __len__(self) -> int:
        steps = self.split.steps_per_epoch(self.num_samples) - self.start_step
        return steps * self.split.grad_accum

    def __iter__(self) -> Iterator[torch.Tensor]:
        perm = self.order(self.num_samples, self.seed, self.epoch)
        split = self.split
        if self.repeats > 1:
            perm = repeated_order(perm, split.global_batch, self.repeats)
        slice_size = split.global_batch // split.grad_accum
        for step in range(self.start_step, split.steps_per_epoch(self.num_samples)):
            for micro in range(split.grad_accum):
                start = step * split.global_batch + micro * slice_size + self.rank * split.micro_batch
                yield perm[start : start + split.micro_batch]


def copies_in_a_micro_batch(split: BatchSplit, repeats: int) -> int:
    """The most copies of one sample in one process's micro-batch (repeated augmentation): 1 when
    each micro-batch is at most global_batch/repeats, as with world size ≥ repeats and no
    accumulation (then every copy of a sample is on another rank). Read off the samplers' own layout."""
    if repeats == 1:
        return 1
    step = split.global_batch
    most = 1
    for rank in range(split.world_size):
        for batch in ShardedBatchSampler(step, split, rank, 0, repeats, order=sequential_order):
            most = max(most, int(torch.bincount(batch % step).max()))
    return most


def repeats_note(split: BatchSplit, repeats: int) -> str | None:
    """A line for the run's start when copies of a sample share a micro-batch (else None)."""
    copies = copies_in_a_micro_batch(split, repeats)
    if copies == 1:
        return None
    return (
        f"note: data.repeats={repeats} puts up to {copies} copies of a sample in one process's micro-batch of "
        f"{split.micro_batch}; copies share none when it holds at most train.global_batch_size/data.repeats = "
        f"{split.global_batch // repeats} (without accumulation: {repeats} or more processes)"
    )


def eval_shard(num_samples: int, rank: int, world_size: int) -> range:
    """This rank's contiguous share of the evaluation set: no padding, no duplicates."""
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def eval_batch_count(num_samples: int, world_size: int, batch_size: int) -> int:
    """Batches of the largest rank's share of the evaluation set."""
    largest = -(-num_samples // world_size)  # ceil
    return -(-largest // batch_size)


def eval_batches(num_samples: int, rank: int, world_size: int, batch_size: int) -> list[range]:
    """This rank's share of the evaluation set in batches of at most `batch_size`, as many on every
    rank (the largest share's count): under fsdp every forward gathers parameters with all ranks,
    so a rank with one batch more would wait for the others forever. Batches are contiguous and
    as equal as they can be; only a rank whose share is smaller than that count (a dataset with
    fewer samples than ranks) gets fewer."""
    shard = eval_shard(num_samples, rank, world_size)
    count = eval_batch_count(num_samples, world_size, batch_size)
    base, extra = divmod(len(shard), max(1, count))
    batches, start = [], shard.start
    for i in range(count):
        size = base + (1 if i < extra else 0)
        if size:
            batches.append(range(start, start + size))
        start += size
    return batches
