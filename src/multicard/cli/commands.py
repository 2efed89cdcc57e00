"""What one process does for `multicard train` and `multicard eval` (cli.py parses and launches)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from multicard.base.atomic import save_atomic
from multicard.base.config import Config, config_from_dict
from multicard.base.errors import UserError
from multicard.checkpoint import check_model_fits, read_checkpoint
from multicard.checkpoint.compat import check_classes
from multicard.data import repeats_note
from multicard.engine.trainer import EvalResult, evaluate
from multicard.run.assembly import Assembly
from multicard.run.preflight import preflight
from multicard.run.session import start_line
from multicard.runtime.environment import ProcessEnv
from multicard.strategy.topology import Topology, resolve


def train(cfg: Config, env: ProcessEnv) -> EvalResult | None:
    """Train in this process (one rank of a DDP job, or the whole single/dp job)."""
    if env.launcher_pid is not None:  # multicard's launcher made the checks and holds out_dir
        return _train_in(cfg, env)
    with preflight(cfg, hold_lock=env.is_main):
        return _train_in(cfg, env)


def _train_in(cfg: Config, env: ProcessEnv) -> EvalResult | None:
    with Assembly(cfg, env) as run:
        trainer, split, checkpointer = run.trainer, run.batch_split, run.checkpointer
        resume_from = checkpointer.choose(cfg.train.resume)
        state = checkpointer.restore(resume_from, trainer.loop) if resume_from is not None else None
        resumed = (resume_from, state["step"]) if resume_from is not None and state is not None else None
        what = f"model={cfg.model.name} data={cfg.data.name} loader={run.data.loader}"
        line = start_line(run.strategy, cfg.precision, split, what)
        notes = [n for n in (repeats_note(split, cfg.data.repeats),) if n]  # this world size's layout
        run.announce(line, trainer.loop, resumed, notes)
        if trainer.finished:
            val = state["val"] if state is not None else None
            return EvalResult(**val) if val else None
        result = trainer.fit([checkpointer, *run.logs(resumed[1] if resumed is not None else None)])
        if result is not None:
            run.reporter.print(
                f"final validation accuracy: top-1 {result.top1:.2f}%, top-5 {result.top5:.2f}% "
                f"({result.samples} images)"
            )
        return result


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
    with Assembly(eval_config(state, overrides), env, training=False) as run:
        check_classes(state, run.data.classes, path, "evaluate on data with the same class folders")
        model = run.bare_model()
        check_model_fits(state["model"], model, path)
        # Into the run's dtype first (float64 weights loaded into a float32 model would be rounded).
        # Eager even when the config says compile: one pass over the data would not repay compiling.
        model = model.to(run.ctx.device, dtype=run.strategy.precision.param_dtype)
        model.load_state_dict(weights)
        result = evaluate(model, run.data.val, run.strategy, flip=run.cfg.eval_flip)
        if run.ctx.is_main:
            if as_json:
                print(json.dumps(result.as_dict()))
            else:
                print(
                    f"top-1 {result.top1:.2f}%  top-5 {result.top5:.2f}%  loss {result.loss:.4f}  "
                    f"({result.samples} images, {run.ctx.world_size} process(es))"
                )
        return result


def export(path: str, out: str, ema: bool = False) -> Path:
    """Write a checkpoint's model (any format; its weights' EMA with `ema`) as a plain state dict:
    whole tensors, no prefixes, loadable with `model.load_state_dict(torch.load(out))`."""
    state = read_checkpoint(path)
    weights = weights_of(state, path, ema)
    target = Path(out).expanduser()
    if target.is_dir():
        raise UserError(f"--out {out} is a directory; give a file name, e.g. {out}/model.pt")
    model = {k: v.contiguous() for k, v in weights.items()}
    save_atomic(model, target)
    size = sum(v.numel() * v.element_size() for v in model.values())
    script = state.get("script")
    trained_by = f"script {script}" if script else f"model.name={state['config']['model']['name']}"
    print(
        f"wrote {target}: {len(model)} tensors, {size / 2**20:.1f} MiB, {trained_by} "
        f"at step {state['step']}" + (" (the weights' EMA)" if ema else "")
    )
    return target
