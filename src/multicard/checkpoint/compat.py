"""Can this run continue from that checkpoint? Checks that fail in one line saying what to change."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.nn as nn

from multicard.errors import UserError

FORMAT_VERSION = 2  # bump when the checkpoint layout changes

# Config keys a resumed run may change: where and how fast it runs, how long, what it logs and
# saves, and which equivalent path feeds it the same data. Any other difference changes what
# is trained (model, data, optimizer, schedule, precision, seed...) and is refused.
FREE_TO_CHANGE = (
    "out_dir", "train.resume", "train.epochs", "train.max_steps", "train.grad_accum",
    "strategy", "devices", "threads", "dist_timeout_s", "sync_bn", "compile", "compile_mode", "cudnn_benchmark",
    "log_every", "checkpoint.", "net.", "ddp.bucket_cap_mb", "ddp.static_graph", "ddp.gradient_as_bucket_view",
    "ddp.shard_optimizer",
    "ddp.find_unused_parameters", "ddp.broadcast_buffers", "fsdp.", "debug.", "log.", "model.weights",
    "data.root", "data.val_root", "data.loader", "data.num_workers", "data.cache_dir", "data.download",
    "data.eval_batch_size", "data.val_size", "data.decode",
)  # fmt: skip


@dataclass(frozen=True)
class RunFacts:
    """What a checkpoint records about its run, and what a resumed run must match."""

    config: dict[str, Any]
    classes: list[str]
    steps_per_epoch: int
    world_size: int


def check_format(meta: dict[str, Any], path: Path) -> None:
    if meta.get("format") != FORMAT_VERSION or "resume" not in meta:
        raise UserError(
            f"checkpoint {path} was written by another multicard version (format {meta.get('format', 1)}, "
            f"this one reads {FORMAT_VERSION}); use that version or set train.resume=never"
        )


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not (name == "model.kwargs" or name.endswith(".kwargs")):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def changed_settings(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """'key: old → new' for every setting that differs and changes what is trained."""
    old, new = flatten(saved), flatten(wanted)
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    return [f"{k}: {old.get(k)} → {new.get(k)}" for k in keys if not k.startswith(FREE_TO_CHANGE)]


def check_settings(meta: dict[str, Any], path: Path, config: dict[str, Any]) -> None:
    """The config checks of a resume, which need neither the data nor the model (a launcher
    makes them once, before starting workers)."""
    check_format(meta, path)
    saved = meta["config"]["train"]["global_batch_size"]
    wanted = config["train"]["global_batch_size"]
    if saved != wanted:
        raise UserError(
            f"checkpoint {path} was trained with train.global_batch_size={saved}; resume with that value "
            f"(any world size works) or set train.resume=never"
        )
    changed = changed_settings(meta["config"], config)
    if changed:
        shown = "; ".join(changed[:4]) + (f"; and {len(changed) - 4} more" if len(changed) > 4 else "")
        raise UserError(
            f"checkpoint {path} was trained with other settings ({shown}); to continue it, rerun with its "
            f"values (run length may change: train.epochs, train.max_steps); to start afresh, set "
            f"train.resume=never or another out_dir; to fine-tune from its weights, use another out_dir "
            f"with model.weights={path}"
        )


def check_resumable(meta: dict[str, Any], path: Path, run: RunFacts, model: nn.Module) -> None:
    """The checkpoint's run continues exactly in this one: same model, recipe, global batch and data."""
    check_format(meta, path)
    check_model_fits(meta["model"], model, path)
    check_settings(meta, path, run.config)
    check_classes(meta, run.classes, path, "resume on the same data or set train.resume=never")
    if meta["resume"]["steps_per_epoch"] != run.steps_per_epoch:
        raise UserError(
            f"checkpoint {path} had {meta['resume']['steps_per_epoch']} steps per epoch, this dataset gives "
            f"{run.steps_per_epoch}; resume on the same training data or set train.resume=never"
        )


def check_classes(meta: dict[str, Any], classes: list[str], path: Path | str, fix: str) -> None:
    """The data's class names (label order) are those the checkpoint was trained on."""
    saved = meta.get("classes")
    if saved is not None and saved != classes:
        raise UserError(
            f"checkpoint {path} was trained on {len(saved)} classes that differ from this data's "
            f"{len(classes)} ({describe_difference(saved, classes)}); {fix}"
        )


def describe_difference(a: list[str], b: list[str]) -> str:
    only_a, only_b = [c for c in a if c not in b], [c for c in b if c not in a]
    parts = []
    if only_a:
        parts.append(f"only in the checkpoint: {', '.join(only_a[:3])}")
    if only_b:
        parts.append(f"only in the data: {', '.join(only_b[:3])}")
    return "; ".join(parts) or "same names in another order"


def check_model_fits(state: dict[str, Any], model: nn.Module, path: Path | str) -> None:
    """Every tensor of the model has a tensor of the same name and shape in `state`, and back."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {list(state[k].shape)} vs {list(own[k].shape)}"
        for k in own
        if k in state and hasattr(state[k], "shape") and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    problems = []
    if shapes:
        problems.append(f"{len(shapes)} shape(s) differ, e.g. {shapes[0]} (checkpoint vs model)")
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing, e.g. {missing[0]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected, e.g. {unexpected[0]}")
    if problems:
        raise UserError(
            f"checkpoint {path} does not fit this model: {'; '.join(problems)}; use the model.name, "
            f"model.kwargs and data it was trained with"
        )
