"""`multicard eval`: a classifier checkpoint's exact top-1/top-5/loss on the configured validation
data, at any world size, with the recipe's own metric function and the run's one evaluator
(run/evaluation.py); and the weights `multicard eval` and `export` read from a checkpoint.

An evaluation is no training run: no out_dir of its own, no lock, no records; its process and
strategy are assembled from a plan for evaluation (multicard.assembly).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from multicard.assembly.parts import Assembly
from multicard.assembly.plan import plan_run
from multicard.base.config import Config, config_from_dict
from multicard.base.errors import UserError
from multicard.checkpoint import check_classes, check_model_fits, read_checkpoint
from multicard.data import build_data
from multicard.engine.meters import EvalResult
from multicard.recipes.classifier import classifier_model, result_of, topk_metrics
from multicard.run.evaluation import evaluate_sums
from multicard.runtime.environment import ProcessEnv
from multicard.strategy import Topology, resolve


def eval_config(state: dict[str, Any], overrides: list[str]) -> Config:
    """The checkpoint's config with the overrides; evaluation runs as the launcher says (one
    process, or ddp under a launcher), whatever strategy trained the checkpoint."""
    if state.get("script"):
        raise UserError(
            f"this checkpoint was written by a script's own loop ({state['script']}, multicard.Run), whose model "
            f"and data multicard eval cannot build; evaluate it there with run.evaluate, or export its weights "
            f"with multicard export"
        )
    return dataclasses.replace(config_from_dict(state["config"], overrides), strategy="auto")


def check_eval(path: str, overrides: list[str], world_size: int, per_node: int) -> Topology:
    """What `eval` checks before a launcher starts workers: the checkpoint reads, the config holds."""
    cfg = eval_config(read_checkpoint(path), overrides)
    return resolve(cfg, world_size, per_node, launched=True, training=False)


def weights_of(state: dict[str, Any], path: str, ema: bool) -> dict[str, Any]:
    """The model's weights of a checkpoint, or with `ema` those of its EMA (ema.decay)."""
    if not ema:
        return state["model"]
    if "ema" not in state:
        raise UserError(f"checkpoint {path} holds no EMA of the weights (its run had ema.decay=0); drop --ema")
    return {**state["model"], **state["ema"]}  # the EMA covers floating-point tensors; counters are the model's


def evaluate_checkpoint(
    path: str, overrides: list[str], env: ProcessEnv, as_json: bool, ema: bool = False
) -> EvalResult:
    """Exact evaluation of a checkpoint (its weights' EMA with `ema`) on the configured validation
    data, any world size."""
    state = read_checkpoint(path)
    weights = weights_of(state, path, ema)
    cfg = eval_config(state, overrides)
    with Assembly(plan_run(cfg, env, training=False, records=False, checkpoints=False)) as parts:
        ctx, strategy = parts.ctx, parts.strategy
        data = build_data(cfg.data, cfg.seed, None, ctx)
        try:
            check_classes(state, data.classes, path, "evaluate on data with the same class folders")
            model = classifier_model(cfg, data.num_classes)
            check_model_fits(state["model"], model, path)
            # Into the run's dtype first (float64 weights loaded into a float32 model would be rounded).
            # Eager even when the config says compile: one pass over the data would not repay compiling.
            floats = strategy.precision.param_dtype
            model = model.to(ctx.device, dtype=floats)
            model.load_state_dict(weights)
            channels_last = cfg.model.channels_last
            metrics = topk_metrics(lambda x: x.contiguous(memory_format=torch.channels_last) if channels_last else x,
                                   cfg.eval_flip)  # fmt: skip
            batches = ((batch, len(batch[1])) for batch in data.val)
            result = result_of(evaluate_sums(model, batches, metrics, strategy, lambda: None))
        finally:
            data.close()
        if ctx.is_main:
            if as_json:
                print(json.dumps(result.as_dict()))
            else:
                print(
                    f"top-1 {result.top1:.2f}%  top-5 {result.top5:.2f}%  loss {result.loss:.4f}  "
                    f"({result.samples} images, {ctx.world_size} process(es))"
                )
        return result

