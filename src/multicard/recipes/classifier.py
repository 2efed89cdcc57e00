"""`multicard train`'s image classifier, written on multicard.Run's public methods as a user's script
would be: the config names the data, model, optimizer and schedule; the run does the rest.

    with ImageClassifier(cfg) as recipe:      # the Run, the data, the model, its optimizer and schedule
        recipe.train()                        # the epochs: resume, train, evaluate, save; stop on a signal

The classifier's own parts are this module's code, or components it hands to the Run: the loss
(an argument; cross-entropy with train.label_smoothing by default), mixup/CutMix targets drawn per
global batch from the run's position and micro-step (the data layer's `mixing`), the weights' EMA
(ema.py, a part of the checkpoints through run.register, sharded as the model is), the top-k
metric function with eval_flip's mirror images, and train top-1 scored against the mixed targets.
Progressive resizing is the data layer's (the training size is a function of the epoch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from multicard.base.config import Config
from multicard.checkpoint import load_weights
from multicard.data import Data, build_data, mixing
from multicard.engine.meters import EvalResult
from multicard.recipes.ema import WeightAverage
from multicard.run import Callback, Run, Scores
from multicard.runtime.environment import ProcessEnv
from multicard.runtime.seeding import seed_process
from multicard.strategy import Precision, build_model, build_scheduler, check_input_size, optimizer_recipe

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
EPOCH_NAMES = {"loss": "train_loss", "top1": "train_top1"}  # an epoch record's names of the step values


def cross_entropy(label_smoothing: float) -> LossFn:
    """The classifier's default loss (targets: class indices, or class weights under mixing)."""

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target, label_smoothing=label_smoothing)

    return loss


def logits_for_loss(out: torch.Tensor) -> torch.Tensor:
    # Reduced-precision logits are upcast so the loss and its statistics are computed in fp32.
    return out if out.dtype in (torch.float32, torch.float64) else out.float()


@torch.no_grad()
def train_top1(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Percent of the micro-batch predicted right; under mixup/CutMix (soft targets, samples ×
    classes) a prediction scores the mixed targets' weight on its class: λ for the sample's own,
    1 − λ for its partner's, 0 for another (the mixup paper's code)."""
    predicted = logits.argmax(dim=1)
    if targets.is_floating_point():
        hits = targets.gather(1, predicted.view(-1, 1)).to(torch.float64).sum()
    else:
        hits = (predicted == targets).sum().to(torch.float64)
    return hits * (100 / len(targets))


def train_values(loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the recipe logs of each micro-step (run.log): its loss (0 where the fp16 scaler skips a
    NaN/inf one) and its top-1."""
    loss = loss.detach()
    return {"loss": torch.where(torch.isfinite(loss), loss, 0.0), "top1": train_top1(logits, target)}


def classifier_model(cfg: Config, num_classes: int) -> nn.Module:
    """The untrained model, checked against the image size it will see; the same weights on every
    rank (DDP also broadcasts rank 0's)."""
    torch.manual_seed(cfg.seed)
    built = build_model(cfg.model.name, num_classes, dict(cfg.model.kwargs))
    check_input_size(built, cfg.model.name, cfg.data.image_size, num_classes)
    return built


def topk_metrics(inputs: Callable[[torch.Tensor], torch.Tensor], flip: bool) -> Callable[[nn.Module, Any], dict]:
    """run.evaluate's metric function: the loss, top-1 and top-5 hits of a batch, summed; with `flip`
    (eval_flip) the logits are the mean of each image's and its mirror's."""

    def metrics(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        x = inputs(x)
        logits = logits_for_loss(model(x))
        if flip:
            logits = (logits + logits_for_loss(model(x.flip(-1)))) / 2
        hits = logits.topk(min(5, logits.shape[1]), dim=1).indices == y.view(-1, 1)
        loss = F.cross_entropy(logits, y, reduction="sum")
        return {"loss": loss, "top1": hits[:, 0].sum(), "top5": hits.any(dim=1).sum()}

    return metrics


def result_of(scores: Scores) -> EvalResult:
    n = scores.samples
    if n == 0:
        return EvalResult(loss=float("nan"), top1=0.0, top5=0.0, samples=0)
    return EvalResult(loss=scores["loss"] / n, top1=100 * scores["top1"] / n, top5=100 * scores["top5"] / n, samples=n)


class ImageClassifier:
    """The image classifier of a config, trained on a multicard.Run (see the module docstring).

    `loss(logits, target)` → the micro-batch's mean loss. `callbacks` hear the loop's events (the
    tools that time or check training); without `evaluate` no epoch is validated, without `records`
    or `checkpoints` the run writes none (Run.from_config); `data`: the data to train on (default:
    the config's, built by multicard.data). Its parts, once built: run, data, model (as the strategy
    runs it), bare (the module), optimizer, scheduler, mix, ema.
    """

    def __init__(
        self, cfg: Config, *, loss: LossFn | None = None, env: ProcessEnv | None = None,
        callbacks: Sequence[Callback] = (), evaluate: bool = True, records: bool = True, checkpoints: bool = True,
        data: Data | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.evaluates, self.own_data = cfg, evaluate, data is None
        self.loss = loss or cross_entropy(cfg.train.label_smoothing)
        self.run = Run.from_config(cfg, env=env, callbacks=callbacks, best="val_top1" if evaluate else None,
                                   epoch_names=EPOCH_NAMES, records=records, checkpoints=checkpoints)  # fmt: skip
        try:
            self.data = data if data is not None else build_data(cfg.data, cfg.seed, self.run.batch_split,
                                                                 self.run.context)  # fmt: skip
            self._build()
        except BaseException as exc:
            self._close(exc)
            raise

    def _build(self) -> None:
        cfg, run = self.cfg, self.run
        self.batches = run.loader(self.data)
        spe = self.batches.steps_per_epoch
        self.floats = Precision(cfg.precision, run.device.type).param_dtype
        bare = classifier_model(cfg, self.data.num_classes).to(dtype=self.floats)  # weights load at this precision
        self.note = load_weights(bare, cfg.model.weights) if cfg.model.weights else None
        self.model, self.optimizer = run.setup(bare, self.make_optimizer)
        self.bare = run.unwrap(self.model)
        seed_process(cfg.seed + run.rank)  # per-rank streams for anything stochastic in the model
        self.scheduler = build_scheduler(self.optimizer, cfg.sched, cfg.train.run_length(spe), spe)
        self.mix = mixing(cfg.mix, run.batch_split, run.rank, cfg.seed, self.data.num_classes)
        self.ema = None
        if cfg.ema.decay:
            self.ema = WeightAverage(self.bare, cfg.ema.decay, cfg.ema.every, round(cfg.ema.start_epoch * spe))
            run.register("ema", self.ema)
        self.metrics = topk_metrics(self.inputs, cfg.eval_flip)

    def make_optimizer(self, bare: nn.Module) -> torch.optim.Optimizer:
        """The config's optimizer (optim.*), for the module as the strategy placed it: whether a fused
        kernel exists depends on its device and on fsdp's sharded tensors."""
        return optimizer_recipe(bare, self.cfg.optim, self.cfg.train.global_batch_size).build()

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """A batch's images as the model takes them: the run's dtype, channels_last if the model is."""
        if x.dtype != self.floats and x.is_floating_point():
            x = x.to(self.floats)
        return x.contiguous(memory_format=torch.channels_last) if self.cfg.model.channels_last else x

    # ------------------------------------------------------------ training

    def train(self) -> EvalResult | None:
        """The run's epochs (resumed where its last checkpoint stopped); the last validation, or None."""
        run, result = self.run, None
        for _ in run.epochs(self.cfg.train.epochs):
            if self.note is not None and run.position.global_step == 0:  # a fresh run's (a resumed one has its own)
                run.print(self.note)
            self.note = None
            for x, y in self.batches:
                self.step(x, y)
            if self.evaluates:
                result = self.validate()
        if result is not None:
            run.print(f"final validation accuracy: top-1 {result.top1:.2f}%, top-5 {result.top5:.2f}% "
                      f"({result.samples} images)")  # fmt: skip
        return result

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One micro-batch: mixing, forward, loss, backward; at a global batch's last, the optimizer's
        step and the EMA's update."""
        run, target = self.run, y
        if self.mix is not None:
            micro = run.micro_step
            assert micro is not None  # a batch of run.loader's
            x, target = self.mix(x, y, run.position.epoch, run.position.step_in_epoch, micro)
        logits = logits_for_loss(self.model(self.inputs(x)))
        loss = self.loss(logits, target)
        run.backward(loss)
        run.log(**train_values(loss, logits, target))
        if run.step(self.optimizer, self.scheduler) and self.ema is not None:
            self.ema.update(run.position.global_step)

    def evaluate(self) -> EvalResult:
        """The model's loss, top-1 and top-5 on the validation data, exactly (every rank calls it)."""
        return result_of(self.run.evaluate(self.model, self.data, self.metrics))

    def validate(self) -> EvalResult:
        """The epoch's validation (and of the weights' EMA, swapped in), logged to the epoch record."""
        run, own = self.run, self.evaluate()
        run.log(val_loss=own.loss, val_top1=own.top1, val_top5=own.top5, val_samples=own.samples)
        if self.ema is not None:
            with self.ema.swapped_in():
                averaged = self.evaluate()
            run.log(ema_val_loss=averaged.loss, ema_val_top1=averaged.top1, ema_val_top5=averaged.top5)
        return own

    # ------------------------------------------------------------ the end

    def _close(self, error: BaseException | None) -> None:
        try:
            if self.own_data and hasattr(self, "data"):
                self.data.close()
        finally:
            self.run.close(error)

    def __enter__(self) -> ImageClassifier:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self._close(exc)
