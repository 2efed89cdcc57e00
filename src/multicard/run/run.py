"""`multicard.Run`: every guarantee of `multicard train` for a user's own loop, and the loop that
`multicard train` itself runs (its classifier recipe, multicard.recipes, is written on this class).

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

The run is planned once (its config, topology and batch split: assembly/plan.py) and its parts are
built from the plan by the assembly (assembly/parts.py): the checks and out_dir's lock, the process
group and device, strategy, graceful stop, stall watchdog, console, trackers and checkpointer.
Reference: docs/library.md.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from multicard.assembly.parts import Assembly
from multicard.assembly.plan import RunPlan, plan_run
from multicard.base.config import Config
from multicard.base.errors import UserError
from multicard.checkpoint import checkpoint_store
from multicard.data import Data
from multicard.data.loading.keyed import Transform
from multicard.engine.loop import Callback, Position
from multicard.run.ending import forget, on_error
from multicard.run.ending import install as install_error_hook
from multicard.run.evaluation import MetricFn, Scores, evaluate_in
from multicard.run.loading import Loader, data_layer_loader, dataset_loader
from multicard.run.preparation import setup_model
from multicard.run.settings import in_arguments, run_config
from multicard.run.state import UserState, checked_component
from multicard.run.training import Training
from multicard.run.weights import checkpoint_path, load_weights
from multicard.runtime.environment import ProcessEnv, detect_env
from multicard.runtime.exits import die_with_launcher
from multicard.runtime.seeding import seed_process


class Run:
    """One training run of a user's loop: see the module docstring and docs/library.md."""
    state: UserState  # the user's own resumable values (run.state["best"] = ...), saved in every checkpoint

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
            plan = plan_run(run_config(arguments, options), detect_env(), script=sys.argv[0] or "<stdin>")
            self._open(plan, best, best_mode)
        except UserError as exc:  # a config key's name → the argument that set it
            error = UserError(in_arguments(str(exc)))
            error.every_rank = True  # the same arguments on every rank: rank 0 says it
            raise error from None

    @classmethod
    def from_config(
        cls, cfg: Config, *, env: ProcessEnv | None = None, callbacks: Sequence[Callback] = (),
        best: str | None = None, epoch_names: Mapping[str, str] | None = None, records: bool = True,
        checkpoints: bool = True,
    ) -> Run:  # fmt: skip
        """A run of a whole multicard config (`multicard train`'s recipe: multicard.recipes), all of it
        saved in config.yaml and the checkpoints; under multicard's launcher the launcher made its
        checks. `callbacks` hear the loop's events after the run's own; `epoch_names` names a value's
        epoch mean in epoch records (loss → train_loss); without `records` (console, metrics,
        trackers) or `checkpoints` the run writes none (the tools that time a loop run so)."""
        env = env or detect_env()
        plan = plan_run(cfg, env, checked=env.launcher_pid is not None, records=records, checkpoints=checkpoints)
        run = cls.__new__(cls)
        run._open(plan, best, "max", callbacks, epoch_names)
        return run

    def _open(self, plan: RunPlan, best: str | None, best_mode: str, callbacks: Sequence[Callback] = (),
              epoch_names: Mapping[str, str] | None = None) -> None:  # fmt: skip
        self._closed = False
        self.parts, self.training = assemble(plan, lambda parts: Training(parts, best, best_mode, callbacks,
                                                                          epoch_names))  # fmt: skip
        self.state = self.training.state
        atexit.register(self.close)

    context = property(lambda self: self.parts.ctx, doc="rank, world size, device: the process (ProcessContext)")
    rank = property(lambda self: self.parts.ctx.rank, doc="this process's rank, 0..world_size-1")
    local_rank = property(lambda self: self.parts.ctx.local_rank)
    world_size = property(lambda self: self.parts.ctx.world_size)
    device = property(lambda self: self.parts.ctx.device, doc="where the model and batches are")
    is_main = property(lambda self: self.parts.ctx.is_main, doc="rank 0, which writes the run's files")
    out_dir = property(lambda self: self.parts.out_dir)
    batch_split = property(lambda self: self.parts.split, doc="global batch, micro-batch, grad_accum (BatchSplit)")
    # checkpoint.dir (a path, or a URL as text), else out_dir/checkpoints
    checkpoint_dir = property(
        lambda self: checkpoint_store(self.parts.out_dir / "checkpoints", self.parts.cfg.checkpoint.dir).location()
    )
    strategy = property(lambda self: self.parts.strategy.name, doc="single | dp | ddp | fsdp, as resolved")

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

    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer | Callable[[nn.Module], Any] | None) -> Any:
        """Place, convert, compile and wrap `model` with the run's strategy; return it, and the
        optimizers that step it (the same objects, except under ZeRO-1): `model` alone, `(model,
        optimizer)`, `(model, opt_a, opt_b)`. An optimizer may be a function that builds it from the
        prepared module. Once per model; a model without optimizer (a frozen teacher) is placed and
        cast, not wrapped by DDP. Build LR schedulers from what it returns."""
        return setup_model(self.training, self.parts.strategy, model, optimizers)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The module run.setup was given (placed, converted, compiled in place), without the
        strategy's and precision's wrappers: its state dict has no `module.` prefix."""
        return self.parts.strategy.unwrap(model)

    def loader(
        self, dataset: Any, transform: Transform | None = None, collate_fn: Callable | None = None, *,
        num_workers: int = 0, order: str = "shuffle",
    ) -> Loader:  # fmt: skip
        """This rank's micro-batches of `dataset` (map-style) for each epoch, on the device.
        `transform(sample, generator)` draws its randomness from `generator`, keyed by (seed, epoch,
        sample index). `order`: "shuffle" (by seed and epoch), "sequential" (the dataset's order) or
        "streams" (truncated BPTT: see Loader.carry). The first loader's length sets the steps per epoch.
        `dataset` may also be a multicard.data.Data: its training loader's batches, as it makes them."""
        if self.training.begun:
            raise UserError("run.loader(...) after run.epochs(...) started; create the loaders before the loop")
        if isinstance(dataset, Data):
            return data_layer_loader(dataset, (transform, collate_fn, num_workers, order), self.parts, self.training)
        return dataset_loader(dataset, transform, collate_fn, num_workers, order, self.parts, self.training)

    def register(self, name: str, component: Any) -> None:
        """A part of the checkpoints beside the model: `component.state_dict(whole=False)` laid out as
        the model's tensors are (this rank's shards under fsdp, written by every rank with the sharded
        format; whole tensors on rank 0 with whole=True) and `load_state_dict(state)`; restored by
        run.epochs. For plain values, use run.state."""
        if self.training.begun:
            raise UserError("run.register(...) after run.epochs(...) started; register components before the loop")
        self.training.loop.components[name] = checked_component(name, component, self.training.loop.components)

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
        load_weights(self.training.loop, self.parts.strategy, model, path)

    # ------------------------------------------------------------ evaluation and collectives

    def evaluate(
        self, model: nn.Module, dataset: Any, metric_fn: MetricFn, *, batch_size: int | None = None,
        transform: Transform | None = None, collate_fn: Callable | None = None, num_workers: int = 0,
    ) -> Scores:  # fmt: skip
        """`metric_fn(model, batch)` → a dict of sums (or per-sample tensors), summed over every
        sample of `dataset` exactly once whatever the world size; with "samples". `dataset` may be a
        multicard.data.Data: its validation loader's batches (this rank's share, on the device)."""
        options = (batch_size, transform, collate_fn, num_workers)
        return evaluate_in(self.parts, self.training.loop.clock, model, dataset, metric_fn, options)

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over every rank, in place (a no-op in one process)."""
        return self.parts.strategy.all_reduce_sum(tensor)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (any picklable object), in rank order; every rank calls it."""
        return self.parts.strategy.all_gather_object(value)

    def barrier(self) -> None:
        self.parts.ctx.barrier()

    def print(self, *values: Any) -> None:
        """Print on rank 0 only."""
        self.parts.reporter.print(" ".join(str(v) for v in values))

    def heartbeat_cost(self) -> dict[str, float] | None:
        """What the stall watchdog's heartbeats have cost this rank so far (None: they are off)."""
        watchdog = self.parts.watchdog
        return watchdog.cost.summary() if watchdog is not None else None

    # ------------------------------------------------------------ the end

    def close(self, error: BaseException | None = None) -> None:
        """Finish writing, release out_dir, leave the process group (also at exit, or `with Run(...)`;
        after an `error` leaving it, nothing that waits for other ranks runs but the callbacks' end)."""
        if not self._closed:
            self._closed = True
            atexit.unregister(self.close)
            close(self.parts, self.training, error)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)


def assemble(plan: RunPlan, training: Callable[[Assembly], Training]) -> tuple[Assembly, Training]:
    """A run's parts from its plan: its checks and out_dir's lock first (before the process group),
    then the process group, device, strategy and stop signals, then its training side; every rank's
    random streams seeded (a model built after this starts from the same weights on every rank)."""
    parts = Assembly(plan)
    on_error(parts.abandon)  # an error that ends the process releases out_dir and closes files first
    die_with_launcher(plan.env)
    try:
        parts.claim()
        parts.reporter  # noqa: B018 -- the process group, device and strategy
        parts.stop  # noqa: B018 -- stop signals are handled from here on
        made = training(parts)
    except BaseException as exc:
        forget(parts.abandon)
        parts.close(exc)
        raise
    seed_process(plan.cfg.seed)
    return parts, made


def close(parts: Assembly, training: Training, error: BaseException | None) -> None:
    """Run.close: training's end (after an `error`, only what the loop's callbacks do at its end), then
    the parts' (parts.Assembly.close)."""
    # At exit after an exception the script did not catch (its traceback printed), the other
    # ranks may be gone or elsewhere: nothing that waits for them (a due checkpoint) runs.
    settle = error is None and getattr(sys, "last_value", None) is None
    try:
        if error is not None:
            training.finish(error)
        training.close(settle=settle)
    finally:
        forget(parts.abandon)
        parts.close(error)
