"""Can this run continue from that checkpoint? Checks that fail in one line saying what to change."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.nn as nn

from multicard.base.config import Config, TrainConfig, to_dict
from multicard.base.errors import UserError

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
    "data.eval_batch_size", "data.val_size", "data.decode", "data.read_retries",
    "data.remote_cache_gb",
)  # fmt: skip


@dataclass(frozen=True)
class RunFacts:
    """What a checkpoint records about its run, and what a resumed run must match."""

    config: dict[str, Any]
    classes: list[str]
    steps_per_epoch: int
    world_size: int
    data_fingerprint: str | None = None  # of the training sample list (data.sample_list_fingerprint); None: not cheap
    script: str | None = None  # a user's script that trained with multicard.Run (None: multicard train)


def _train_of(config: dict[str, Any]) -> TrainConfig:
    return TrainConfig(**{k: v for k, v in config["train"].items() if k in TrainConfig.__dataclass_fields__})


def _length_setting(train: TrainConfig, steps_per_epoch: int) -> str:
    """The setting that ends the run: train.max_steps if it cuts the epochs short, else train.epochs."""
    if train.max_steps and train.max_steps < train.epochs * steps_per_epoch:
        return f"train.max_steps={train.max_steps}"
    return f"train.epochs={train.epochs}"


def schedule_stretch(meta: dict[str, Any], config: dict[str, Any]) -> str | None:
    """The warning for a resume whose run length changed under a schedule that depends on it
    (cosine: the rest of the decay is spread over the new length), or None."""
    spe = meta["resume"]["steps_per_epoch"]
    old, new = _train_of(meta["config"]).run_length(spe), _train_of(config).run_length(spe)
    # A user's loop (multicard.Run) has no sched section: its schedule is the script's own.
    if old == new or config.get("sched", {}).get("name") != "cosine":
        return None
    return (
        f"warning: the run length changed from {old} to {new} steps ({_length_setting(_train_of(config), spe)}): "
        f"the cosine LR schedule is re-stretched over the new length from step {meta['step']}"
    )


def check_format(meta: dict[str, Any], path: Path | str) -> None:
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
    """'key: old → new' for every setting that differs and changes what is trained. A key only one
    side knows (a setting added or removed since the checkpoint was written) differs only when its
    value there is not the default: a checkpoint of an older version resumes in a newer one."""
    old, new = flatten(saved), flatten(wanted)
    defaults = flatten(to_dict(Config()))
    for tree in (old, new):
        for k in (old.keys() ^ new.keys()) & defaults.keys():
            tree.setdefault(k, defaults[k])
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    return [f"{k}: {old.get(k)} → {new.get(k)}" for k in keys if not k.startswith(FREE_TO_CHANGE)]


def check_settings(meta: dict[str, Any], path: Path | str, config: dict[str, Any]) -> None:
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
    check_weights(meta, path, config)
    check_not_past_the_end(meta, path, config)
    changed = changed_settings(meta["config"], config)
    if changed:
        shown = "; ".join(changed[:4]) + (f"; and {len(changed) - 4} more" if len(changed) > 4 else "")
        raise UserError(
            f"checkpoint {path} was trained with other settings ({shown}); to continue it, rerun with its "
            f"values (run length may change: train.epochs, train.max_steps); to start afresh, set "
            f"train.resume=never or another out_dir; to fine-tune from its weights, use another out_dir "
            f"with model.weights={path}"
        )


def check_weights(meta: dict[str, Any], path: Path | str, config: dict[str, Any]) -> None:
    """model.weights starts a run; continuing a checkpoint that did not start from the same
    weights would ignore them without a word."""
    old, new = meta["config"].get("model", {}).get("weights"), config.get("model", {}).get("weights")
    if new and new != old:
        keep = "drop model.weights" if not old else f"set model.weights={old}"
        raise UserError(
            f"model.weights={new} would be ignored: this run continues checkpoint {path}, which did not start "
            f"from those weights; to fine-tune from them, use another out_dir or set train.resume=never; "
            f"to continue the checkpoint, {keep}"
        )


def check_not_past_the_end(meta: dict[str, Any], path: Path | str, config: dict[str, Any]) -> None:
    """A checkpoint past the end of this run's length has nothing to continue."""
    train, spe = _train_of(config), meta["resume"]["steps_per_epoch"]
    if meta["step"] > train.run_length(spe):
        raise UserError(
            f"checkpoint {path} is at step {meta['step']}, already past {_length_setting(train, spe)} "
            f"({train.run_length(spe)} steps); to continue it, raise train.max_steps (or train.epochs); "
            f"to start afresh, set train.resume=never or another out_dir"
        )


def check_resumable(meta: dict[str, Any], path: Path, run: RunFacts, model: nn.Module) -> None:
    """The checkpoint's run continues exactly in this one: same model, recipe, global batch and data.
    The settings first: another model.name is named as such, not as tensors that do not fit."""
    check_settings(meta, path, run.config)
    check_model_fits(meta["model"], model, path)
    check_classes(meta, run.classes, path, "resume on the same data or set train.resume=never")
    if meta["resume"]["steps_per_epoch"] != run.steps_per_epoch:
        raise UserError(
            f"checkpoint {path} had {meta['resume']['steps_per_epoch']} steps per epoch, this dataset gives "
            f"{run.steps_per_epoch}; resume on the same training data or set train.resume=never"
        )
    check_same_samples(meta, path, run)


def check_same_samples(meta: dict[str, Any], path: Path, run: RunFacts) -> None:
    """Other training samples (others, in another order, or with other labels) make another run,
    though names and counts agree. A checkpoint without a fingerprint (an older one) or a source
    without one (a dataset function's) is not compared."""
    saved = meta["resume"].get("data_fingerprint")
    if saved is not None and run.data_fingerprint is not None and saved != run.data_fingerprint:
        raise UserError(
            f"checkpoint {path} was trained on other training samples than this data gives (other samples, "
            f"another order or other labels, under the same class names); to continue it, resume on the data "
            f"it was trained on (moved or repacked is fine); to start afresh, set train.resume=never or another "
            f"out_dir; to fine-tune from its weights, use another out_dir with model.weights={path}"
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
