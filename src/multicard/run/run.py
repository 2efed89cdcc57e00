"""`multicard.Run`: every guarantee of `multicard train` for a user's own loop.

    run = multicard.Run(out_dir="runs/mine", global_batch_size=256, precision="bf16")
    model, optimizer = run.setup(model, optimizer)      # device, strategy wrap, AMP, compile (per model)
    train = run.loader(train_set, transform=augment)    # any map-style dataset
    for epoch in run.epochs(10):                        # resumes where the last run stopped
        for batch in train:                             # this rank's share of the global batch
            loss = my_loss(model, batch)
            run.backward(loss)                          # accumulation (no_sync), GradScaler
            run.step(optimizer, scheduler)              # clip, step, zero_grad; checkpoints
            run.log(loss=loss)                          # rank 0: console, metrics.jsonl, trackers
        scores = run.evaluate(model, val_set, metric_fn)   # every sample once, any world size

The run is assembled by the same Assembly as a command-line run (assembly.py): process group and
device, strategy, sampler, loop step, checkpointer, graceful stop, stall watchdog, console and
trackers. Reference: docs/library.md.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from multicard.base.errors import UserError
from multicard.checkpoint import checkpoint_store
from multicard.data.loading.keyed import Transform, check_map_style
from multicard.engine.loop import Position
from multicard.engine.phases import EVALUATION, IDLE
from multicard.run.ending import install as install_error_hook
from multicard.run.evaluation import MetricFn, Scores, evaluate_sums
from multicard.run.loading import Loader, eval_loader
from multicard.run.preparation import prepare_model
from multicard.run.runtime import Runtime
from multicard.run.settings import in_arguments, run_config
from multicard.run.training import Training
from multicard.run.weights import checkpoint_path, load_weights


class Run:
    """One training run of a user's loop: see the module docstring and docs/library.md."""

    def __init__(
        self, out_dir: str = "runs/default", *, global_batch_size: int, seed: int = 0, grad_accum: int = 1,
        strategy: str = "auto", precision: str = "fp32", devices: Any = "auto", compile: bool = False,
        clip_grad_norm: float = 0.0, checkpoint_every: int = 0, keep_last: int = 3, checkpoint_format: str = "auto",
        resume: str = "auto", log_every: int = 50, max_steps: int = 0, best: str | None = None,
        best_mode: str = "max", options: Mapping[str, Any] | Sequence[str] = (),
    ) -> None:  # fmt: skip
        arguments = {k: v for k, v in locals().items() if k not in ("self", "options", "best", "best_mode")}
        install_error_hook()  # from here on, an uncaught multicard error is one line and its exit code
        try:
            self.runtime = Runtime(run_config(arguments, options), script=sys.argv[0] or "<stdin>")
        except UserError as exc:  # a config key's name → the argument that set it
            error = UserError(in_arguments(str(exc)))
            error.every_rank = True  # the same arguments on every rank: rank 0 says it
            raise error from None
        self.training = Training(self.runtime, best, best_mode)
        self.state = self.training.state  # the user's own resumable values (run.state["best"] = ...)
        self._closed = False
        atexit.register(self.close)

    # ------------------------------------------------------------ who and where

    rank = property(lambda self: self.runtime.ctx.rank, doc="this process's rank, 0..world_size-1")
    local_rank = property(lambda self: self.runtime.ctx.local_rank)
    world_size = property(lambda self: self.runtime.ctx.world_size)
    device = property(lambda self: self.runtime.ctx.device, doc="where the model and batches are")
    is_main = property(lambda self: self.runtime.ctx.is_main, doc="rank 0, which writes the run's files")
    out_dir = property(lambda self: self.runtime.out_dir)
    # checkpoint.dir (a path, or a URL as text), else out_dir/checkpoints
    checkpoint_dir = property(
        lambda self: checkpoint_store(self.runtime.out_dir / "checkpoints", self.runtime.cfg.checkpoint.dir).location()
    )
    strategy = property(lambda self: self.runtime.strategy.name, doc="single | dp | ddp | fsdp, as resolved")

    @property
    def position(self) -> Position:
        """epoch, step_in_epoch and global_step (global batches stepped so far)."""
        return self.training.loop.position

    @property
    def micro_step(self) -> int | None:
        """Which micro-step (0 .. grad_accum-1) of the global batch step_in_epoch the batch just drawn
        is; None outside a loader's batch. With the position: a key for randomness of its own per batch."""
        return self.training.micro

    # ------------------------------------------------------------ setting up

    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer | None) -> Any:
        """Place, convert, compile and wrap `model` with the run's strategy; return it, and the
        optimizers that step it (the same objects, except under ZeRO-1): `model` alone, `(model,
        optimizer)`, `(model, opt_a, opt_b)`. Once per model; a model without optimizer (a frozen
        teacher) is placed and cast, not wrapped by DDP. Build LR schedulers from what it returns."""
        training = self.training
        if training.begun:
            raise UserError("run.setup(...) after run.epochs(...) started; set up every model before the loop")
        if any(t.bare is model or t.wrapped is model for t in training.loop.trained):
            raise UserError("run.setup was called twice with the same model; set each model up once")
        given = [o for o in optimizers if o is not None]
        wrapped, stepping = prepare_model(self.runtime.strategy, model, tuple(given), training.guard)
        training.loop.add(wrapped, stepping)
        returned = iter(stepping)
        out = [next(returned) if o is not None else None for o in optimizers]
        return (wrapped, *out) if optimizers else wrapped

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The module run.setup was given (placed, converted, compiled in place), without the
        strategy's and precision's wrappers: its state dict has no `module.` prefix."""
        return self.runtime.strategy.unwrap(model)

    def loader(
        self, dataset: Any, transform: Transform | None = None, collate_fn: Callable | None = None, *,
        num_workers: int = 0, order: str = "shuffle",
    ) -> Loader:  # fmt: skip
        """This rank's micro-batches of `dataset` (map-style) for each epoch, on the device.
        `transform(sample, generator)` draws its randomness from `generator`, keyed by (seed, epoch,
        sample index). `order`: "shuffle" (by seed and epoch), "sequential" (the dataset's order) or
        "streams" (truncated BPTT: see Loader.carry). The first loader's length sets the steps per epoch."""
        training = self.training
        if training.begun:
            raise UserError("run.loader(...) after run.epochs(...) started; create the loaders before the loop")
        check_map_style(dataset, "run.loader")
        loader = Loader(
            dataset, transform, collate_fn, self.runtime.loader_processes(num_workers), self.runtime.split,
            self.runtime.ctx, self.runtime.cfg.seed, training, self.runtime.strategy.precision.param_dtype, order,
        )  # fmt: skip
        self.runtime.check_same_on_every_rank(dataset, "run.loader")
        if order == "streams":
            training.loop.components[f"streams{len(training.loaders)}"] = loader.carried
        training.loaders.append(loader)
        return loader

    # ------------------------------------------------------------ training

    def epochs(self, n: int) -> Iterator[int]:
        """The epochs left of `n`: the first call resumes from out_dir's newest checkpoint (at any
        world size), and each epoch ends with a checkpoint; a stop ends with one too."""
        return self.training.epochs(n)

    def steps(self, n: int) -> Iterator[Any]:
        """The training loader's micro-batches until `n` optimizer steps are done in all (epoch after
        epoch of the data): a step-based loop. Resumes, checkpoints and stops as run.epochs does."""
        return self.training.steps_of(n)

    def every(self, n: int) -> bool:
        """True in the code after the run.step that completed step k·n (evaluate every n steps)."""
        return self.training.steps.every(n)

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients of this micro-batch's mean loss, as a share of the global batch's."""
        self.training.backpropagate(loss)

    def step(
        self, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None, *,
        clip_grad_norm: float | None = None,
    ) -> bool:  # fmt: skip
        """After the last micro-step of a global batch: clip (`clip_grad_norm`, else the Run's), step
        `optimizer`, zero its gradients, step its scheduler; the global batch counts as a step of the
        run (checkpoints, logs, an agreed stop once its code has ended). Earlier: nothing; False."""
        return self.training.step(optimizer, scheduler, clip_grad_norm)

    def log(self, **values: Any) -> None:
        """Numbers (or one-element tensors) for the step and epoch records; call it on every rank."""
        self.training.logbook.add(values)

    def save(self) -> Path:
        """A checkpoint of this step now (every rank calls it)."""
        return self.training.save()

    def load_weights(self, model: nn.Module, checkpoint: str = "best") -> None:
        """The weights a checkpoint holds of the run's model, loaded into `model` (as run.setup
        returned it): "best" (the epoch `best` points at), "last", or a checkpoint's path or URL."""
        path = checkpoint_path(self.checkpoint_dir, checkpoint)
        load_weights(self.training.loop, self.runtime.strategy, model, path)

    # ------------------------------------------------------------ evaluation and collectives

    def evaluate(
        self, model: nn.Module, dataset: Any, metric_fn: MetricFn, *, batch_size: int | None = None,
        transform: Transform | None = None, collate_fn: Callable | None = None, num_workers: int = 0,
    ) -> Scores:  # fmt: skip
        """`metric_fn(model, batch)` → a dict of sums (or per-sample tensors), summed over every
        sample of `dataset` exactly once whatever the world size; with "samples"."""
        rt = self.runtime
        check_map_style(dataset, "run.evaluate")
        size = batch_size or rt.split.micro_batch
        loader, counts = eval_loader(dataset, size, transform, collate_fn, rt.loader_processes(num_workers), rt.ctx,
                                     rt.cfg.seed)  # fmt: skip
        bare = rt.strategy.unwrap(model)  # DDP's forward would wait for the other ranks' forwards
        rt.strategy.agree_buffers(bare)  # rank 0's BatchNorm statistics, as checkpoints hold them
        batches = zip(loader, counts, strict=True)
        clock = self.training.loop.clock
        clock.set_phase(EVALUATION)
        try:
            return evaluate_sums(bare, batches, metric_fn, rt.strategy, clock.tick)
        finally:
            clock.set_phase(IDLE)
            loader_workers_end(loader)

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over every rank, in place (a no-op in one process)."""
        return self.runtime.strategy.all_reduce_sum(tensor)

    def barrier(self) -> None:
        self.runtime.ctx.barrier()

    def print(self, *values: Any) -> None:
        """Print on rank 0 only."""
        self.runtime.reporter.print(" ".join(str(v) for v in values))

    # ------------------------------------------------------------ the end

    def close(self) -> None:
        """Finish writing, release out_dir, leave the process group (also at exit, or `with Run(...)`)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        with ExitStack() as stack:
            stack.callback(self.runtime.close)
            # At exit after an exception the script did not catch (its traceback printed), the other
            # ranks may be gone or elsewhere: nothing that waits for them (a due checkpoint) runs.
            self.training.close(settle=getattr(sys, "last_value", None) is None)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def loader_workers_end(loader: Any) -> None:
    from multicard.data.loading.workers import shutdown_workers

    shutdown_workers(loader)
