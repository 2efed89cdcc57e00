"""The one training step: what multicard.Run's backward and step do (run/stepping.py), for a
user's own loop and for `multicard train`'s classifier recipe, which is written on multicard.Run.

A step is `grad_accum` micro-steps whose gradients are reduced on the last one only (the
strategy's no_sync on the others), the loss scaled for accumulation and for fp16, then clipping,
the optimizer and LR-scheduler step, the run's position and the graceful stop every rank agrees
on. This module is the one place a backward pass and an optimizer step are written.

A run may train several models with several optimizers (a GAN's generator and discriminator, a
frozen teacher beside its student): each optimizer steps the parameters of one model, with its own
scheduler, and one fp16 GradScaler serves them all (torch's recipe for several optimizers: each
optimizer's step is skipped on its own inf/NaN, the scale is updated once per global batch).

The loop is stateful: `state_dict()` / `load_state_dict()` carry the models, optimizers,
schedulers, scaler, position and every rank's random streams, plus each component registered in
`components` (the weights' EMA, a user's own state): the one list of what a checkpoint holds.
The run's model (the first with an optimizer) and its first optimizer are saved under "model"
and "optimizer", as a run of one model saves them; any other under "models" and "optimizers",
keyed by their order of setup. Callbacks are told of the loop's events and receive the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn as nn

from multicard.base.errors import Stopped, UserError
from multicard.engine.phases import BACKWARD, COMMUNICATION, IDLE, OPTIMIZER, REDUCING, PhaseClock, StepTimes
from multicard.runtime.seeding import own_streams, rng_state, set_rng_state
from multicard.runtime.stopping import GracefulStop

if TYPE_CHECKING:  # annotations only: the strategies import torch's sharding stack
    from multicard.engine.meters import EvalResult
    from multicard.strategy.base import Strategy

def load_keeping_kernels(
    strategy: Strategy, model: nn.Module, optimizer: Any, model_state: Any, optim_state: Any
) -> None:
    """Load model and optimizer state (`optimizer` [] with `optim_state` {}: the model's alone). How
    this run computes the update (fused kernels or not) is its own choice, not the checkpoint's: a
    fused kernel saved by one strategy may not exist for another's tensors."""
    from multicard.strategy.optim import OPTIMIZER_KERNEL_KEYS  # with torch's sharding stack: on first use

    groups = optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer) else []
    kernels = [{k: g[k] for k in OPTIMIZER_KERNEL_KEYS if k in g} for g in groups]
    strategy.load_state_dicts(model, optimizer, model_state, optim_state)
    for group, keep in zip(groups, kernels, strict=True):
        group.update(keep)


# ---------------------------------------------------------------- the loop's state and settings


@dataclass
class Position:
    """Where a run stands; saved in every checkpoint so a resumed run continues exactly."""

    epoch: int = 0  # the epoch in progress (or the next one, at an epoch boundary)
    step_in_epoch: int = 0  # optimizer steps of `epoch` already done
    global_step: int = 0

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Position:
        """The position saved in `state` (which may hold more: the meter's epoch sums; an older
        checkpoint's best score, which the run's Monitor now keeps)."""
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})


@dataclass(frozen=True)
class Schedule:
    """The loop's settings, decided once when the run's loop begins (assembly/plan.py: the run's length)."""

    steps_per_epoch: int
    total_steps: int  # optimizer steps of the whole run (train.epochs, cut by train.max_steps)
    grad_accum: int = 1
    log_every: int = 50
    clip_grad_norm: float = 0.0
    epochs: int = 0  # run.epochs(n): its epochs end the run too (one left early by `break` is shorter); 0: none

    def last_step(self, position: Position) -> int:
        """Where the epoch in progress ends: its steps, or fewer if the run's steps end first."""
        left = self.total_steps - position.global_step
        return max(position.step_in_epoch, min(self.steps_per_epoch, position.step_in_epoch + left))


class Stateful(Protocol):
    """A part of a checkpoint beside the model and optimizer (`whole`: gathered whole on rank 0)."""

    def state_dict(self, whole: bool = False) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class GradientWatch:
    """Marks the end of backward's compute: once the step's last gradient has been accumulated,
    what remains of backward is waiting for gradient communication. It also sees a synced
    backward that reached some of the model's parameters but not all: DDP would then wait
    forever for the others' gradients (or apply them unreduced), unless told to look for unused
    parameters.

    The parameters' hooks hold this object, which holds no model: no reference cycle keeps the
    model (and DDP's reducer with its process group) alive past the run.
    """

    def __init__(self, clock: PhaseClock, model: nn.Module, unused_ok: bool = True) -> None:
        self.clock = clock
        params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.count = len(params)
        self.unused_ok = unused_ok
        self.pending = -1  # gradients still to come in this backward; 0 → communication
        self.arrived: set[int] = set()  # which parameters got one (only while looking for unused ones)
        self.names = [name for name, _ in params]
        for i, (_, p) in enumerate(params):
            p.register_post_accumulate_grad_hook(self._hook(i))

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def arrived(_: torch.Tensor) -> None:
            self.pending -= 1
            if not self.unused_ok:
                self.arrived.add(index)
            if self.pending == 0:
                self.clock.enter(COMMUNICATION)

        return arrived

    def expect(self, synced: bool) -> None:
        """Before a backward: watch it if its gradients are reduced (the last micro-step)."""
        self.pending = self.count if synced else -1
        self.arrived.clear()

    def check_used(self) -> None:
        """After a synced backward: refuse one that reached some of the model's parameters, not all."""
        if self.unused_ok or self.pending <= 0 or self.pending == self.count:
            return
        missing = [name for i, name in enumerate(self.names) if i not in self.arrived]
        error = UserError(
            f"{len(missing)} parameter(s) got no gradient in this backward under ddp (e.g. {missing[0]}), so DDP "
            f"would wait for them forever; set options={{'ddp.find_unused_parameters': True}} (config "
            f"ddp.find_unused_parameters=true), or freeze them (requires_grad=False) before run.setup"
        )
        error.every_rank = True  # the same model on every rank: rank 0 says it
        raise error


@dataclass(eq=False)
class Trained:
    """A model of the run, as the strategy wrapped it (forward) and bare (parameters, checkpoints)."""

    wrapped: nn.Module
    bare: nn.Module
    watch: GradientWatch | None = None


@dataclass(eq=False)
class Stepper:
    """An optimizer of the run, the model whose parameters it steps, and its LR scheduler.
    `params`: what clipping measures — the model's parameters, or (one of several optimizers of
    one model) those of them it holds, in the model's order."""

    optimizer: torch.optim.Optimizer
    model: Trained
    scheduler: Any = None
    params: list[torch.Tensor] = field(default_factory=list)
    saved: Any = None  # a resumed run's scheduler state, until a scheduler is given (then loaded into it)

    def scheduler_state(self) -> Any:
        return self.scheduler.state_dict() if self.scheduler is not None else self.saved

    def load_scheduler(self, state: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state)
        else:
            self.saved = state


# ---------------------------------------------------------------- callbacks


@dataclass(frozen=True)
class StepEnd:
    """What callbacks learn after every optimizer step."""

    epoch: int
    global_step: int
    step_in_epoch: int
    last_in_epoch: bool  # the epoch's (or the run's) last step: an epoch end follows
    times: StepTimes
    stop_signal: int  # nonzero: every rank stops after this step


class Callback:
    """Hooks into a run's loop; every rank calls them at the same points. Override what you need."""

    def on_fit_start(self, loop: Loop) -> None: ...

    def on_gradients(self, loop: Loop) -> None:
        """The step's gradients are reduced and about to be applied (before clipping and the optimizer)."""

    def on_step_end(self, loop: Loop, step: StepEnd) -> None: ...

    def on_log(self, loop: Loop, record: dict[str, Any]) -> None:
        """A step record with statistics reduced over ranks, every log_every steps."""

    def on_epoch_end(self, loop: Loop, record: dict[str, Any], val: EvalResult | None, best: bool) -> None: ...

    def on_stop(self, loop: Loop, stop: Stopped) -> None:
        """Every rank agreed to stop after this step; `stop` is raised after the callbacks."""

    def on_fit_end(self, loop: Loop) -> None: ...


class Hooks:
    """A run's callbacks as one: `hooks.on_log(loop, record)` calls each callback's on_log, in order."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)

    def __getattr__(self, hook: str) -> Callable[..., None]:
        def call(*args: Any) -> None:
            for cb in self.callbacks:
                getattr(cb, hook)(*args)

        return call


# ---------------------------------------------------------------- the loop


class Loop:
    """The models, optimizers, schedulers and scaler of one run, its position, and the one step."""

    def __init__(self, strategy: Strategy, stop: GracefulStop | None = None) -> None:
        self.strategy = strategy
        self._schedule: Schedule | None = None  # set once, when the run's loop begins (`begin`)
        self.stop = stop
        self.scaler = strategy.precision.grad_scaler()
        self.position = Position()
        self.clock = PhaseClock(strategy.ctx.device)
        self.hooks = Hooks([])
        self.trained: list[Trained] = []  # every model, in the order it was set up
        self.steppers: list[Stepper] = []  # every optimizer, in the order it was set up
        self.components: dict[str, Stateful] = {}  # saved under their names (the EMA, a user's state)
        self.position_state: list[Stateful] = []  # saved inside the position (the meter's epoch sums)
        self.ending: BaseException | None = None  # what ended training, for on_fit_end (None: it completed)

    @property
    def schedule(self) -> Schedule:
        assert self._schedule is not None, "the loop has not begun"
        return self._schedule

    def begin(self, schedule: Schedule) -> None:
        """The run's settings, once: from here on the loop steps."""
        assert self._schedule is None, "a loop begins once"
        self._schedule = schedule

    def add(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> Trained:
        """Another model of the run (as the strategy prepared it) and the optimizers that step it."""
        bare = self.strategy.unwrap(model)
        watch = None
        if self.strategy.reduces_gradients and any(p.requires_grad for p in bare.parameters()):
            options = getattr(self.strategy, "options", None)
            watch = GradientWatch(self.clock, bare, unused_ok=getattr(options, "find_unused_parameters", True))
        trained = Trained(model, bare, watch)
        self.trained.append(trained)
        for optimizer in optimizers:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            mine: list[torch.Tensor] = [p for p in model.parameters() if id(p) in held]
            self.steppers.append(Stepper(optimizer, trained, params=mine if len(optimizers) > 1 else []))
        return trained

    @property
    def main(self) -> Stepper | None:
        """The run's first optimizer: its model is the run's model (checkpoints' "model")."""
        return self.steppers[0] if self.steppers else None

    def _primary(self) -> Trained | None:
        main = self.main
        return main.model if main is not None else (self.trained[0] if self.trained else None)

    model = property(lambda self: p.wrapped if (p := self._primary()) else None, doc="what forward runs through")
    bare = property(lambda self: p.bare if (p := self._primary()) else None, doc="parameters, checkpoints")
    optimizer = property(lambda self: self.main.optimizer if self.main else None)

    @property
    def scheduler(self) -> Any:
        """The first optimizer's LR scheduler (anything with step() and a state dict), or None."""
        return self.main.scheduler if self.main else None

    @property
    def finished(self) -> bool:
        epochs = self.schedule.epochs
        return self.position.global_step >= self.schedule.total_steps or bool(epochs and self.position.epoch >= epochs)

    @property
    def phase(self) -> str:
        """What this rank is doing now (read by the stall watchdog from another thread)."""
        return self.clock.phase

    def set_phase(self, phase: str) -> None:
        """Work between steps (evaluation, checkpoints) says so here."""
        self.clock.set_phase(phase)

    # ------------------------------------------------------------ the step

    @contextmanager
    def micro_step(self, micro: int) -> Iterator[None]:
        """Micro-step `micro` of the step: its gradients are reduced only if it is the last one (the
        forward too runs inside the strategy's no_sync: DDP decides there)."""
        sync = micro == self.schedule.grad_accum - 1
        with nullcontext() if sync else self._no_sync():
            for trained in self.trained:
                if trained.watch is not None:
                    trained.watch.expect(sync)
            yield

    def _no_sync(self) -> Any:
        if len(self.trained) == 1:
            return self.strategy.no_sync(self.trained[0].wrapped)
        stack = ExitStack()
        for trained in self.trained:
            if trained.watch is not None or not self.strategy.reduces_gradients:
                stack.enter_context(self.strategy.no_sync(trained.wrapped))
        return stack

    def backpropagate(self, loss: torch.Tensor) -> None:
        """The gradients of one micro-step's mean loss, as a share of the global batch's (the one
        backward pass of multicard: train, a user's loop, and every tool that times a step)."""
        self.clock.enter(BACKWARD)
        self.scaler.scale(loss / self.schedule.grad_accum).backward()
        for trained in self.trained:
            if trained.watch is not None:
                trained.watch.check_used()

    def optimizer_step(self, stepper: Stepper | None = None, clip: float | None = None, update: bool = True) -> None:
        """Apply an optimizer's gradients (reduced by now): clip, step (skipped by the fp16 scaler on
        NaN/inf), zero them, advance its LR schedule; then (`update`) the scaler's scale. With
        several optimizers the scale is updated once, after the last of them (update_scale)."""
        stepper = stepper or self.main
        assert stepper is not None
        clip = self.schedule.clip_grad_norm if clip is None else clip
        self.clock.enter(OPTIMIZER)
        self.hooks.on_gradients(self)
        if clip:
            self.scaler.unscale_(stepper.optimizer)
            torch.nn.utils.clip_grad_norm_(stepper.params or stepper.model.wrapped.parameters(), clip)
        self.scaler.step(stepper.optimizer)
        if update:
            self.scaler.update()
        stepper.optimizer.zero_grad(set_to_none=True)
        if stepper.scheduler is not None:
            stepper.scheduler.step()

    def update_scale(self) -> None:
        """After every optimizer of a global batch has stepped: the fp16 scale for the next."""
        self.scaler.update()

    def count_step(self) -> None:
        self.position.global_step += 1
        self.position.step_in_epoch += 1

    def end_step(self) -> tuple[StepTimes, int]:
        """The step's phase times, and the signal every rank agreed to stop on after it (0: none)."""
        times = self.clock.end_step()
        if self.stop is None:
            return times, 0
        self.clock.set_phase(REDUCING)
        signum = self.stop.poll()
        self.clock.set_phase(IDLE)
        return times, signum

    # ------------------------------------------------------------ state

    def state_dict(self, whole: bool = False) -> dict[str, Any]:
        """Everything a checkpoint holds. A collective: every rank calls it at the same step. Model
        and optimizer state are keyed by parameter name, as the strategy holds them (sharded under
        fsdp), or with `whole`, gathered whole on rank 0."""
        main = self.main
        assert main is not None
        position = asdict(self.position)
        for part in self.position_state:
            position.update(part.state_dict(whole))
        for trained in self.trained:
            self.strategy.agree_buffers(trained.bare)
        model_state, optim_state = self.strategy.state_dicts(main.model.bare, main.optimizer, whole)
        state = {
            "model": model_state,
            "optimizer": optim_state,
            "scaler": self.scaler.state_dict(),
            "position": position,
            "rng": self.strategy.all_gather_object(rng_state()),
            **({"scheduler": main.scheduler_state()} if main.scheduler_state() is not None else {}),
            **others_state(self, whole),
        }
        return state | {name: part.state_dict(whole) for name, part in self.components.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (any strategy and world size that keep this global batch). A part
        this run has no component for (yet) is left; a component the state lacks starts afresh."""
        main = self.main
        assert main is not None
        check_same_parts(self, state)
        load_keeping_kernels(self.strategy, main.model.bare, main.optimizer, state["model"], state["optimizer"])
        if "scheduler" in state:
            main.load_scheduler(state["scheduler"])
        load_others(self, state)
        self.scaler.load_state_dict(state["scaler"])
        self.position = Position.from_state(state["position"])
        for part in self.position_state:
            part.load_state_dict(state["position"])
        set_rng_state(own_streams(state["rng"], self.strategy.ctx.rank, self.strategy.ctx.world_size))
        for name, part in self.components.items():
            if name in state:
                part.load_state_dict(state[name])


# ---------------------------------------------------------------- the other models and optimizers


def _others(loop: Loop) -> tuple[list[tuple[str, Trained]], list[tuple[str, Stepper]]]:
    """The models and optimizers beside the run's model and its first optimizer, keyed by setup order."""
    main = loop.main
    models = [(str(i), t) for i, t in enumerate(loop.trained) if main is None or t is not main.model]
    steppers = [(str(i), s) for i, s in enumerate(loop.steppers) if s is not main]
    return models, steppers


def others_state(loop: Loop, whole: bool) -> dict[str, Any]:
    """"models", "optimizers" and "schedulers" of a run with more than one model or optimizer."""
    models, steppers = _others(loop)
    if not models and not steppers:
        return {}
    strategy = loop.strategy
    model_states = {key: strategy.state_dicts(t.bare, [], whole)[0] for key, t in models}
    optim_states = {key: strategy.state_dicts(s.model.bare, s.optimizer, whole)[1] for key, s in steppers}
    schedulers = {key: s.scheduler_state() for key, s in steppers if s.scheduler_state() is not None}
    return {"models": model_states, "optimizers": optim_states, "schedulers": schedulers}


def check_same_parts(loop: Loop, state: dict[str, Any]) -> None:
    """A checkpoint continues a run of as many models and optimizers, set up in the same order."""
    models, steppers = len(loop.trained), len(loop.steppers)
    saved = 1 + len(state.get("models", {})), 1 + len(state.get("optimizers", {}))
    if (models, steppers) != saved:
        raise UserError(
            f"the checkpoint holds {saved[0]} model(s) and {saved[1]} optimizer(s), this run set up {models} and "
            f"{steppers}; set them up as the run that wrote it did (same order), or start afresh (resume='never')"
        )


def load_others(loop: Loop, state: dict[str, Any]) -> None:
    models, steppers = _others(loop)
    optims = dict(steppers)
    for key, trained in models:
        loop.strategy.load_state_dicts(trained.bare, [], state["models"][key], {})
    for key, stepper in optims.items():
        load_keeping_kernels(loop.strategy, stepper.model.bare, stepper.optimizer, state["models"].get(
            str(loop.trained.index(stepper.model)), state["model"]), state["optimizers"][key])
        if key in state.get("schedulers", {}):
            stepper.load_scheduler(state["schedulers"][key])
