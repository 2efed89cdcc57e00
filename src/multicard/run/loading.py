"""`run.loader(dataset)`: this rank's micro-batches of a user's dataset, on the device; or of the
data layer's training loader (`run.loader(data)`, a multicard.data.Data: `multicard train`'s recipe).

The sampler is the data layer's (data/loading/sampling.py: ShardedBatchSampler): an epoch's order is a
function of (seed, epoch) — shuffled, in the dataset's order, or in contiguous streams — each
optimizer step takes the same global batch at any world size, a micro-step a contiguous slice
of it and each rank its part of that slice; a resumed epoch starts at the step it stopped at.
Iterating the loader also tells the run which micro-step each batch belongs to, so a micro-step
whose gradients are not reduced runs its forward and backward inside the strategy's no_sync
(DDP decides at the forward). A loader gives an epoch's batches once: iterating it again in the
same epoch is refused (it would repeat them), and leaving it early (`break`) ends the epoch.

In streams (truncated backpropagation through time), `carry(state, dim=...)` keeps each stream's
state (an RNN's hidden state) in the run's checkpoints, gathered over the ranks in stream order,
so a run resumed in the middle of an epoch, at any world size, continues every stream from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import default_collate

from multicard.assembly.plan import DataFacts
from multicard.base.errors import UserError
from multicard.data import Data
from multicard.data.loading.keyed import KeyedSamples, Transform, check_map_style, move_to
from multicard.data.loading.sampling import (
    ORDERS,
    BatchSplit,
    ShardedBatchSampler,
    eval_batch_count,
    eval_batches,
    sample_order,
)
from multicard.data.loading.workers import EpochKeys, EvalKeys, data_loader
from multicard.engine.phases import DATA, FORWARD
from multicard.runtime.process_group import ProcessContext


class MicroSteps(Protocol):
    """What a loader tells its run while it is iterated."""

    begun: bool  # the run's epochs have begun

    def begin_micro(self, micro: int) -> None: ...

    def end_micro(self) -> None: ...

    def enter(self, phase: str) -> None: ...

    def settle(self) -> None:
        """The user's code for the previous step has run (its checkpoint, an agreed stop)."""


class DatasetBatches:
    """A user's dataset as an epoch's batches: the sampler's keys, read (in loader processes) and
    collated, then moved to the device (floating tensors in the run's dtype)."""

    def __init__(
        self, dataset: Any, transform: Transform | None, collate_fn: Callable | None, num_workers: int,
        split: BatchSplit, ctx: ProcessContext, seed: int, floats: torch.dtype, order: str,
    ) -> None:  # fmt: skip
        if order not in ORDERS:
            raise UserError(f"run.loader(order={order!r}) is not one of {', '.join(ORDERS)}")
        self.device, self.floats = ctx.device, floats
        self.sampler = ShardedBatchSampler(len(dataset), split, ctx.rank, seed, order=sample_order(order, split))
        samples = KeyedSamples(dataset, transform, seed)
        collate = collate_fn or default_collate
        self.loader = data_loader(samples, EpochKeys(self.sampler), num_workers, ctx.device, seed, ctx.rank, collate)

    @property
    def num_samples(self) -> int:
        return self.sampler.num_samples

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_step)

    def __iter__(self) -> Iterator[Any]:
        return (move_to(batch, self.device, self.floats) for batch in self.loader)

    def close(self) -> None:
        from multicard.data.loading.workers import shutdown_workers

        shutdown_workers(self.loader)


class Loader:
    """This rank's micro-batches of the run's current epoch, from `run.loader(...)`: `batches` are a
    user's dataset's (DatasetBatches) or the data layer's training loader; iterate it inside `for
    epoch in run.epochs(N)`, once an epoch."""

    def __init__(
        self, batches: Any, split: BatchSplit, ctx: ProcessContext, steps: MicroSteps, order: str, owned: bool = True
    ) -> None:
        self.batches, self.split, self.ctx, self.steps, self.order = batches, split, ctx, steps, order
        self.owned = owned  # the run closes it (a dataset's loader processes), else its maker does (a Data)
        self.last_step = self.steps_per_epoch  # where this epoch's steps end (a run's max_steps may cut one)
        self.epoch = self.start_step = 0
        self.carried = Carried(ctx, split)
        self._drawn: bool | None = None  # this epoch: None not iterated yet, False iterating, True drawn from

    @property
    def num_samples(self) -> int:
        return self.batches.num_samples

    @property
    def steps_per_epoch(self) -> int:
        return self.split.steps_per_epoch(self.batches.num_samples)

    @property
    def micro_batch(self) -> int:
        """Samples of each batch on this rank (in streams: the streams this rank holds)."""
        return self.split.micro_batch

    def set_epoch(self, epoch: int, start_step: int, last_step: int) -> None:
        self.batches.set_epoch(epoch, start_step)
        self.epoch, self.start_step, self.last_step = epoch, start_step, last_step
        self._drawn = None
        self.carried.start(resumed=start_step > 0)

    def end_epoch(self) -> None:
        self.carried.end()

    def __len__(self) -> int:
        """Micro-batches left in this epoch on this rank."""
        return max(0, self.last_step - self.start_step) * self.split.grad_accum

    def __iter__(self) -> Iterator[Any]:
        if not self.steps.begun:
            raise UserError("a run.loader was iterated outside `for epoch in run.epochs(N)` (or run.steps(N)); "
                            "iterate it inside, once an epoch")  # fmt: skip
        if self._drawn is not None:
            raise UserError(
                f"a run.loader was iterated twice in epoch {self.epoch}; iterate it once an epoch (it "
                f"would give the same batches again; `break` ends the epoch early, more epochs give more passes)"
            )
        self._drawn = False
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        accum, left = self.split.grad_accum, len(self)
        if left == 0:
            return
        batches = iter(self.batches)
        try:
            for n in range(left):
                self.steps.end_micro()
                self.steps.settle()
                self.steps.enter(DATA)
                batch = next(batches)
                self.steps.begin_micro(n % accum)
                self.steps.enter(FORWARD)
                self._drawn = True
                yield batch
            self.steps.end_micro()
            self.steps.settle()  # the epoch's last step, before the code after the loop (evaluation) runs
        finally:
            self.steps.end_micro()

    def carry(self, state: Any, *, dim: int) -> Any:
        """In streams (order="streams"): the state each of this rank's streams carries to its next
        batch — a tensor, or a tuple or list of them, with one row per stream along `dim` (an
        RNN's hidden state: dim=1). Call it before the epoch's first batch with the initial state,
        and after each forward with the new one; it returns `state`, except in an epoch resumed
        in the middle, where the first call returns the state the checkpoint kept (at any world
        size: it is saved in stream order). The states given are kept for the next checkpoint."""
        if self.order != "streams":
            raise UserError("loader.carry(...) keeps the state of streams: create the loader with order='streams'")
        return self.carried.carry(state, dim, drawn=bool(self._drawn))

    def close(self) -> None:
        if self.owned:
            self.batches.close()


class Carried:
    """The state a rank's streams carry from batch to batch, as a checkpoint part: saved gathered over
    the ranks (rows in stream order), restored as this rank's rows; void at an epoch's end."""

    def __init__(self, ctx: ProcessContext, split: BatchSplit) -> None:
        self.ctx, self.rows, self.accum = ctx, split.micro_batch, split.grad_accum
        self.state: Any = None
        self.dim = 0
        self.saved: Any = None  # whole (every stream's) state from a checkpoint, until the first carry
        self._resumed = False

    def start(self, resumed: bool) -> None:
        self._resumed = resumed
        if not resumed:
            self.saved = None

    def end(self) -> None:
        self.state = self.saved = None

    def carry(self, state: Any, dim: int, drawn: bool) -> Any:
        tensors = state if isinstance(state, (tuple, list)) else (state,)
        if not tensors or any(not isinstance(t, torch.Tensor) or t.dim() <= dim or t.shape[dim] != self.rows
                              for t in tensors):  # fmt: skip
            raise UserError(f"loader.carry(state, dim={dim}) takes a tensor (or a tuple of them) with {self.rows} "
                            f"rows along dim {dim}, one per stream this rank holds")  # fmt: skip
        if self.saved is not None:
            if drawn:
                raise UserError("loader.carry(...): call it with the initial state before the epoch's first batch "
                                "(a resumed epoch continues from the state its checkpoint kept)")  # fmt: skip
            state = _rows(self.saved, self.ctx.rank * self.rows, self.rows, tensors[0].device)
            self.saved = None
        self.state, self.dim = state, dim
        return state

    def state_dict(self, whole: bool = False) -> dict[str, Any]:
        if self.state is None:
            return {"grad_accum": self.accum}
        tensors = self.state if isinstance(self.state, (tuple, list)) else (self.state,)
        mine = [t.detach().cpu().movedim(self.dim, 0) for t in tensors]  # rows first, for every rank alike
        every = self.ctx.all_gather_object(mine)
        whole_rows = [torch.cat([r[i] for r in every]).movedim(0, self.dim) for i in range(len(mine))]
        return {"tuple": isinstance(self.state, (tuple, list)), "dim": self.dim, "tensors": whole_rows,
                "grad_accum": self.accum}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("grad_accum", self.accum)
        if saved != self.accum:
            raise UserError(f"order='streams' lays its streams out by grad_accum (global_batch_size / grad_accum "
                            f"streams): resume with grad_accum={saved}, as the checkpoint was trained")  # fmt: skip
        self.saved = state if "tensors" in state else None


def _rows(saved: dict[str, Any], start: int, rows: int, device: torch.device) -> Any:
    dim = saved["dim"]
    tensors = [t.narrow(dim, start, rows).to(device) for t in saved["tensors"]]
    return tuple(tensors) if saved["tuple"] else tensors[0]


def eval_loader(
    dataset: Any, batch_size: int, transform: Transform | None, collate_fn: Callable | None, num_workers: int,
    ctx: ProcessContext, seed: int,
) -> tuple[Any, list[int]]:  # fmt: skip
    """This rank's share of `dataset` in batches, each sample once over all ranks (a DataLoader;
    batches stay on the CPU until moved), and how many samples of each batch count. Every rank
    gets as many batches — under fsdp each forward gathers the parameters with all ranks — so a
    rank whose share is short (fewer samples than ranks) adds batches of one sample that count 0."""
    batches = eval_batches(len(dataset), ctx.rank, ctx.world_size, batch_size)
    padding = eval_batch_count(len(dataset), ctx.world_size, batch_size) - len(batches) if len(dataset) else 0
    counts = [len(b) for b in batches] + [0] * padding
    keys = EvalKeys(batches + [range(0, 1)] * padding)
    samples = KeyedSamples(dataset, transform, seed)
    loader = data_loader(samples, keys, num_workers, ctx.device, seed, ctx.rank, collate_fn or default_collate)
    return loader, counts


def data_layer_loader(data: Any, options: tuple[Any, ...], parts: Any, training: Any) -> Loader:
    """run.loader(data): the data layer's training loader (a multicard.data.Data's, which brings its
    own sampler and transforms); its classes and sample list go into the run's checkpoints."""
    if options != (None, None, 0, "shuffle") or data.train is None:
        raise UserError("run.loader(data): a multicard.data.Data with training data brings its own sampler, "
                        "transforms and loader processes; give it alone")  # fmt: skip
    if training.loaders:
        raise UserError("run.loader(data): give the data layer's loader first (it sets an epoch's steps)")
    loader = Loader(data.train, parts.split, parts.ctx, training, "shuffle", owned=False)
    training.data, training.loader_kind = DataFacts(tuple(data.classes), data.fingerprint), data.loader
    training.loaders.append(loader)
    return loader


def evaluation_batches(
    dataset: Any, parts: Any, batch_size: int | None, transform: Transform | None, collate_fn: Callable | None,
    num_workers: int,
) -> tuple[Any, Iterator[tuple[Any, int]]]:  # fmt: skip
    """run.evaluate's (batch, samples counted) pairs of this rank's share of `dataset`, and the
    DataLoader to end after them (None: a multicard.data.Data's validation loader, on the device)."""
    if isinstance(dataset, Data):
        return None, ((batch, len(batch[1])) for batch in dataset.val)
    check_map_style(dataset, "run.evaluate")
    size = batch_size or parts.split.micro_batch
    loader, counts = eval_loader(dataset, size, transform, collate_fn, parts.loader_processes(num_workers),
                                 parts.ctx, parts.cfg.seed)  # fmt: skip
    return loader, iter(zip(loader, counts, strict=True))


def dataset_loader(
    dataset: Any, transform: Transform | None, collate_fn: Callable | None, num_workers: int, order: str,
    parts: Any, training: Any,
) -> Loader:  # fmt: skip
    """run.loader(dataset): a user's map-style dataset, sampled and read as the loader's docstring says."""
    check_map_style(dataset, "run.loader")
    floats = parts.strategy.precision.param_dtype
    batches = DatasetBatches(dataset, transform, collate_fn, parts.loader_processes(num_workers), parts.split,
                             parts.ctx, parts.cfg.seed, floats, order)  # fmt: skip
    loader = Loader(batches, parts.split, parts.ctx, training, order)
    parts.check_same_on_every_rank(dataset, "run.loader")
    if order == "streams":
        training.loop.components[f"streams{len(training.loaders)}"] = loader.carried
    training.loaders.append(loader)
    return loader
