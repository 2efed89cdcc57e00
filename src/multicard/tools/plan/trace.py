"""One training step of the configured run, traced on fake tensors.

The step is multicard's own: `multicard train`'s recipe (multicard.recipes.ImageClassifier, on
multicard.Run) on one CPU device, its model placed by the single-device strategy (dtype,
channels_last, autocast), its optimizer, schedule and EMA as a training run has them, fed by
data that hands out fake batches, for one step (a callback ends it there). Nothing is allocated
and no GPU is needed; every op is recorded (ops.OpRecorder). fp16 is traced as bf16: the same
element size, without the loss scaler, which reads values back (inf checks) that fake tensors
cannot answer (its memory is a few scalars); mixing (mixup/CutMix: a few elementwise ops) is left out.

Besides the op series, the trace keeps what the strategy rules need: parameter, buffer,
gradient and optimizer-state bytes (per parameter too: ZeRO-1 splits by parameter), the
FSDP units (their bytes and the ops during which each unit's forward and backward run), and
the optimizer's temporaries when it runs unfused on shards (FSDP has a fused kernel for AdamW only).
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from multicard.base.config import Config, with_overrides
from multicard.base.errors import UserError
from multicard.data import generated_data
from multicard.recipes import ImageClassifier
from multicard.run import Callback, Loop, StepEnd
from multicard.strategy import choose_units, fused_on_shards, optimizer_recipe
from multicard.tools.plan.fake import FakeWorld
from multicard.tools.plan.ops import OpRecorder, OpSeries

NEVER = 10**9  # samples and log interval of the traced run: it neither logs nor ends an epoch


class OneStep(Callback):
    """Ends the traced run after its first step (before the next batch is drawn); the loop, for
    the phase each op is recorded in."""

    def __init__(self) -> None:
        self.loop: Loop | None = None

    @property
    def phase(self) -> str:
        return self.loop.phase if self.loop is not None else "idle"

    def on_fit_start(self, loop: Loop) -> None:
        self.loop = loop

    def on_step_end(self, loop: Loop, step: StepEnd) -> None:
        raise StepTraced


class StepTraced(Exception):
    """The traced step is done."""


def trace_settings(cfg: Config, batch: int, out_dir: str) -> Config:
    """The config as traced: one CPU process, micro-batch `batch`, nothing written, nothing that
    needs a GPU or reads values back."""
    return with_overrides(cfg, [
        "strategy=single", "devices=cpu", "compile=false", "sync_bn=false", "data.decode=cpu",
        f"precision={'bf16' if cfg.precision == 'fp16' else cfg.precision}", "ddp.shard_optimizer=false",
        "ddp.comm_hook=none", f"train.global_batch_size={batch}", "train.grad_accum=1", "train.max_steps=0",
        "train.resume=never", f"log_every={NEVER}", "mix.mixup_alpha=0", "mix.cutmix_alpha=0", "model.weights=null",
        "checkpoint.dir=null", "checkpoint.format=auto", "debug.stall_s=0", "log.tensorboard=false",
        "log.mlflow=false", "log.wandb=false", f"out_dir={out_dir}",
    ])  # fmt: skip


@dataclass
class Unit:
    """An FSDP unit (or the root, last): the ops during which its parameters must be whole."""

    name: str
    param_bytes: int
    fwd: tuple[int, int] = (-1, -1)  # first and last op index of its forward
    bwd: tuple[int, int] = (-1, -1)  # op index when its backward starts, and when its last gradient arrives


@dataclass
class ParamInfo:
    name: str
    numel: int
    nbytes: int
    group: int  # optimizer parameter group
    state_bytes: int = 0  # optimizer state after the first step


@dataclass
class StepTrace:
    batch: int
    ops: OpSeries
    param_bytes: int
    buffer_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    input_bytes: int  # one micro-batch as the loader hands it over (images + labels)
    largest_activation: int
    has_conv: bool
    params: list[ParamInfo]
    units: list[Unit]
    # "foreach" / "loop": temporaries of the optimizer step on shards when it runs unfused there (0 when fused)
    optimizer_temps: dict[str, int] = field(default_factory=dict)


class UnitWatch:
    """Module and gradient hooks that note the op index at which each FSDP unit's forward and
    backward start and end."""

    def __init__(self, recorder: OpRecorder, bare: nn.Module, units: list[nn.Module], names: dict[int, str]) -> None:
        self.recorder = recorder
        self.units: list[Unit] = []
        self._pending: dict[int, int] = {}  # unit index -> gradients still to come
        self.owner: dict[int, int] = {}  # id(param) -> unit index
        for module in [*units, bare]:  # innermost first, the root last: a parameter belongs to its innermost unit
            index = len(self.units)
            own = [p for p in module.parameters() if id(p) not in self.owner]
            for p in own:
                self.owner[id(p)] = index
            self.units.append(Unit(names[id(module)] or "(root)", sum(p.numel() * p.element_size() for p in own)))
            module.register_forward_pre_hook(functools.partial(self._forward_start, index))
            module.register_forward_hook(functools.partial(self._forward_end, index))
            self._pending[index] = len(own)

    def _forward_start(self, index: int, module: nn.Module, args: Any) -> None:
        unit = self.units[index]
        unit.fwd = (self.recorder.ops, unit.fwd[1])

    def _forward_end(self, index: int, module: nn.Module, args: Any, out: Any) -> None:
        unit = self.units[index]
        unit.fwd = (unit.fwd[0], self.recorder.ops - 1)
        tensors = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.requires_grad:
                t.register_hook(functools.partial(self._backward_start, index))

    def _backward_start(self, index: int, grad: torch.Tensor) -> None:
        unit = self.units[index]
        if unit.bwd[0] < 0:
            unit.bwd = (self.recorder.ops, unit.bwd[1])

    def grad_arrived(self, param: torch.Tensor) -> None:
        """A parameter's gradient is accumulated: it counts as gradient memory from now, and the last
        of its unit's ends the unit's backward."""
        assert param.grad is not None
        self.recorder.mark_grad(param.grad)
        index = self.owner.get(id(param))
        if index is None:
            return
        self._pending[index] -= 1
        if self._pending[index] == 0:
            unit = self.units[index]
            start = unit.bwd[0] if unit.bwd[0] >= 0 else self.recorder.ops
            unit.bwd = (start, self.recorder.ops)


def _state_bytes(state: dict) -> int:
    return sum(v.untyped_storage().nbytes() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def trace_step(cfg: Config, batch: int, num_classes: int) -> StepTrace:
    """Trace one optimizer step of `cfg` at micro-batch `batch` on one device (no accumulation)."""
    world, done = FakeWorld(), OneStep()
    with tempfile.TemporaryDirectory(prefix="multicard-trace-") as tmp:
        settings = trace_settings(cfg, batch, tmp)
        with world.building():
            shape = (batch, 3, cfg.data.image_size, cfg.data.image_size)  # float images, as loaders hand them over
            fake = generated_data(lambda: (torch.empty(shape), torch.zeros(batch, dtype=torch.long)), batch, NEVER,
                                  num_classes)  # fmt: skip
            recipe = ImageClassifier(settings, callbacks=[done], evaluate=False, records=False, checkpoints=False,
                                     data=fake)  # fmt: skip
            units = choose_units(recipe.bare, cfg.fsdp, cfg.model.name)
            optimizer = optimizer_recipe(recipe.bare, settings.optim, batch)  # for the unfused step's temporaries
        with recipe:
            return _traced(cfg, recipe, optimizer, units, world, done)


def _traced(cfg: Config, recipe: Any, optim: Any, units: list[nn.Module], world: FakeWorld, done: OneStep) -> StepTrace:
    bare, optimizer = recipe.bare, recipe.optimizer
    names = {id(m): n for n, m in bare.named_modules()}
    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    params = [ParamInfo(n, p.numel(), p.numel() * p.element_size(), group_of.get(id(p), 0))
              for n, p in bare.named_parameters()]  # fmt: skip
    recorder = OpRecorder(lambda: done.phase)
    watch = UnitWatch(recorder, bare, units, names)
    for p in (p for p in bare.parameters() if p.requires_grad):
        p.register_post_accumulate_grad_hook(watch.grad_arrived)
    with world.stepping():
        for t in [*bare.parameters(), *bare.buffers()]:
            recorder.track(t, persistent=True)
        _run_one_step(recipe, recorder, cfg.model.name)
        for p, info in zip(bare.parameters(), params, strict=True):
            state = optimizer.state.get(p)
            info.state_bytes = _state_bytes(state) if state else 0
        temps = {"loop": _unfused_temps(optim, bare, foreach=False), "foreach": _unfused_temps(optim, bare, True)}
        if cfg.optim.fused and fused_on_shards(cfg.optim.name):
            temps = {"loop": 0, "foreach": 0}  # fsdp runs the fused kernel on its shards too: no temporaries
    batch = recipe.run.batch_split.micro_batch
    return StepTrace(
        batch=batch,
        ops=recorder.series(),
        param_bytes=sum(i.nbytes for i in params),
        buffer_bytes=sum(b.untyped_storage().nbytes() for b in bare.buffers()),
        grad_bytes=sum(i.nbytes for i, p in zip(params, bare.parameters(), strict=True) if p.requires_grad),
        optimizer_bytes=sum(i.state_bytes for i in params),
        input_bytes=batch * 3 * cfg.data.image_size**2 * 4 + batch * 8,
        largest_activation=recorder.largest_new,
        has_conv=any(isinstance(m, nn.modules.conv._ConvNd) for m in bare.modules()),
        params=params,
        units=watch.units,
        optimizer_temps=temps,
    )


def _run_one_step(recipe: Any, recorder: OpRecorder, model_name: str) -> None:
    """The traced step, with every op recorded; a model whose step cannot run on fake tensors is one line."""
    try:
        with recorder, recorder.saving():
            recipe.train()
    except StepTraced:
        return
    except Exception as exc:  # noqa: BLE001 -- any failure of the user's model on fake tensors
        raise UserError(
            f"model.name={model_name}: multicard plan cannot trace its training step on fake tensors "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None


def _unfused_temps(recipe: Any, bare: nn.Module, foreach: bool) -> int:
    """Peak bytes the optimizer allocates beyond its state in one unfused step (foreach: the
    multi-tensor kernels torch uses on CUDA; loop: one tensor at a time, as on CPU).

    Per parameter group, one stand-in parameter: of the group's total size for foreach (its
    temporaries are per-tensor copies, so they add up to the group's size), of its largest
    parameter's size for the loop (which holds one parameter's temporaries at a time).
    """
    size = (lambda ps: sum(p.numel() for p in ps)) if foreach else (lambda ps: max(p.numel() for p in ps))
    kernels = ("fused", "foreach", "params")  # the built optimizer wrote its choices into the recipe's groups
    groups = []
    for g in recipe.groups:
        params = [p for p in g["params"] if p.requires_grad]
        if params:
            stand_in = torch.empty(size(params), dtype=params[0].dtype).requires_grad_()
            stand_in.grad = torch.empty_like(stand_in)
            groups.append({**{k: v for k, v in g.items() if k not in kernels}, "params": [stand_in]})
    if not groups:
        return 0
    kwargs = {k: v for k, v in recipe.kwargs.items() if k != "fused"}
    optimizer = recipe.cls(groups, **kwargs, foreach=foreach)
    optimizer.step()  # the state exists from now on
    recorder = OpRecorder(lambda: "optimizer")
    for g in groups:
        recorder.track(g["params"][0])
        recorder.track(g["params"][0].grad)
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                recorder.track(v)
    base = recorder.live
    with recorder:
        optimizer.step()
    peak = int(recorder.series().live.max()) if recorder.ops else base
    return max(0, peak - base)
