"""What one process does for `multicard train` and `multicard eval` (cli.py parses and launches)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from multicard.base.atomic import save_atomic
from multicard.base.config import Config, config_from_dict, to_dict
from multicard.base.errors import UserError
from multicard.checkpoint import Checkpointer, check_model_fits, read_checkpoint
from multicard.checkpoint.compat import check_classes
from multicard.data import build_data, repeats_note
from multicard.engine.trainer import EvalResult, evaluate
from multicard.observe.telemetry import Reporter
from multicard.run.preflight import check_run, prepare_out_dir
from multicard.run.session import announce_start, open_session, run_logs, seeded_model, start_line, start_process
from multicard.runtime.environment import ProcessEnv
from multicard.runtime.process_group import teardown
from multicard.runtime.run_lock import RunLock
from multicard.strategy.topology import Topology, resolve


def train(cfg: Config, env: ProcessEnv) -> EvalResult | None:
    """Train in this process (one rank of a DDP job, or the whole single/dp job)."""
    if env.launcher_pid is None:  # else multicard's launcher has made them
        check_run(cfg)
    fresh = not Path(cfg.out_dir).exists()
    out_dir = prepare_out_dir(cfg.out_dir)
    with RunLock(out_dir, made_out_dir=fresh) as lock:
        if env.launcher_pid is None and env.is_main:  # else multicard's launcher holds it
            lock.acquire(print)
        try:
            return _train_in(out_dir, cfg, env)
        except UserError:
            lock.refused()  # leaves out_dir as it found it (what a run wrote before failing stays)
            raise


def _train_in(out_dir: Path, cfg: Config, env: ProcessEnv) -> EvalResult | None:
    with open_session(cfg, env) as s:
        trainer, split = s.trainer, s.batch_split
        reporter = Reporter(s.ctx.is_main)
        checkpointer = Checkpointer(out_dir / "checkpoints", s.strategy, cfg.checkpoint, s.run, reporter.print)
        try:
            resume_from = checkpointer.choose(cfg.train.resume)
            state = checkpointer.restore(resume_from, trainer.loop) if resume_from is not None else None
            resumed = (resume_from, state["step"]) if resume_from is not None and state is not None else None
            what = f"model={cfg.model.name} data={cfg.data.name} loader={s.data.loader}"
            line = start_line(s.strategy, cfg.precision, split, what)
            notes = [n for n in (repeats_note(split, cfg.data.repeats),) if n]  # this world size's layout
            announce_start(reporter, out_dir, to_dict(cfg), line, trainer.loop, resumed, s.notes, notes)
            if trainer.finished:
                val = state["val"] if state is not None else None
                return EvalResult(**val) if val else None
            resumed_at = resumed[1] if resumed is not None else None
            logs = run_logs(cfg, out_dir, reporter, s.ctx.is_main, resumed_at, s.data.loader)
            result = trainer.fit([checkpointer, *logs])
            if result is not None:
                reporter.print(
                    f"final validation accuracy: top-1 {result.top1:.2f}%, top-5 {result.top5:.2f}% "
                    f"({result.samples} images)"
                )
            return result
        finally:
            reporter.close()


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
    topology = resolve(cfg, env.world_size, env.local_world_size, env.launched, training=False)
    ctx, strategy = start_process(cfg, env, topology)
    try:
        data = build_data(cfg.data, cfg.seed, None, ctx)
        try:
            check_classes(state, data.classes, path, "evaluate on data with the same class folders")
            model = seeded_model(cfg.model, cfg.seed, data.num_classes, cfg.data.image_size)
            check_model_fits(state["model"], model, path)
            # Into the run's dtype first (float64 weights loaded into a float32 model would be rounded).
            # Eager even when the config says compile: one pass over the data would not repay compiling.
            model = model.to(ctx.device, dtype=strategy.precision.param_dtype)
            model.load_state_dict(weights)
            result = evaluate(model, data.val, strategy, flip=cfg.eval_flip)
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
    finally:
        teardown()


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
