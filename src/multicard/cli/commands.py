"""What one process does for `multicard train`, `eval` and `export` (cli/main.py parses and launches):
the recipes (multicard.recipes) on the public API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from multicard.base.atomic import save_atomic
from multicard.base.config import Config
from multicard.base.errors import UserError
from multicard.checkpoint import read_checkpoint
from multicard.recipes import EvalResult, ImageClassifier, check_eval, evaluate_checkpoint, weights_of
from multicard.runtime.environment import ProcessEnv

__all__ = ["check_eval", "evaluate_checkpoint", "export", "train"]


def train(cfg: Config, env: ProcessEnv) -> EvalResult | None:
    """Train in this process (one rank of a DDP job, or the whole single/dp job): the config's
    classifier on multicard.Run, which makes the run's checks unless multicard's launcher did."""
    with ImageClassifier(cfg, env=env) as recipe:
        return recipe.train()


def export(path: str, out: str, ema: bool = False) -> Path:
    """Write a checkpoint's model (any format; its weights' EMA with `ema`) as a plain state dict:
    whole tensors, no prefixes, loadable with `model.load_state_dict(torch.load(out))`."""
    state = read_checkpoint(path)
    weights = weights_of(state, path, ema)
    target = Path(out).expanduser()
    if target.is_dir():
        raise UserError(f"--out {out} is a directory; give a file name, e.g. {out}/model.pt")
    model: dict[str, Any] = {k: v.contiguous() for k, v in weights.items()}
    save_atomic(model, target)
    size = sum(v.numel() * v.element_size() for v in model.values())
    script = state.get("script")
    trained_by = f"script {script}" if script else f"model.name={state['config']['model']['name']}"
    print(
        f"wrote {target}: {len(model)} tensors, {size / 2**20:.1f} MiB, {trained_by} "
        f"at step {state['step']}" + (" (the weights' EMA)" if ema else "")
    )
    return target
