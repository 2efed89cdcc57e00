"""A Run's keyword arguments as multicard's typed config: one set of settings, validated once.

Each argument of `multicard.Run` is a config key (ARGUMENTS); `options` sets any other key the
library uses (`ddp.*`, `fsdp.*`, `checkpoint.*`, `debug.*`, `log.*`, `net.*`, `threads`,
`dist_timeout_s`, `sync_bn`, `compile_mode`, ...). Errors name the argument as the user wrote it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from multicard.assembly.plan import NOT_A_RUN_SETTING
from multicard.base.config import Config, load_config
from multicard.base.errors import UserError

# Run(argument=...) → the config key it sets.
ARGUMENTS = {
    "out_dir": "out_dir",
    "seed": "seed",
    "global_batch_size": "train.global_batch_size",
    "grad_accum": "train.grad_accum",
    "max_steps": "train.max_steps",
    "strategy": "strategy",
    "precision": "precision",
    "devices": "devices",
    "compile": "compile",
    "clip_grad_norm": "clip_grad_norm",
    "checkpoint_every": "checkpoint.every_steps",
    "keep_last": "checkpoint.keep_last",
    "checkpoint_format": "checkpoint.format",
    "resume": "train.resume",
    "log_every": "log_every",
}
def _option_items(options: Mapping[str, Any] | Iterable[str]) -> list[str]:
    if isinstance(options, Mapping):
        return [f"{key}={_yaml_value(value)}" for key, value in options.items()]
    items = list(options)
    if any(not isinstance(item, str) for item in items):
        raise UserError("Run(options=...) takes a dict {'ddp.bucket_cap_mb': 50} or a list ['ddp.bucket_cap_mb=50']")
    return items


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_yaml_value(v) for v in value) + "]"
    return str(value)


def run_config(arguments: dict[str, Any], options: Mapping[str, Any] | Iterable[str] = ()) -> Config:
    """The config of a Run from its arguments (given ones only) and options; errors name arguments."""
    overrides = [f"{ARGUMENTS[name]}={_yaml_value(value)}" for name, value in arguments.items()]
    extra = _option_items(options)
    for item in extra:
        key = item.partition("=")[0].strip()
        if key in ARGUMENTS.values():
            raise UserError(f"Run(options=...) sets {key}: give it as Run's own argument {_argument_of(key)}=...")
        if key == "train.epochs":
            raise UserError("Run(options=...) sets train.epochs: give the epochs to run.epochs(N)")
        if key.startswith(NOT_A_RUN_SETTING):
            raise UserError(
                f"Run(options=...) sets {key}, a setting of multicard train's own data, model and recipe; your loop "
                f"sets those itself"
            )
    try:
        return load_config(None, overrides + extra)
    except UserError as exc:
        raise UserError(in_arguments(str(exc))) from None


def _argument_of(key: str) -> str:
    return next(name for name, k in ARGUMENTS.items() if k == key)


def in_arguments(message: str) -> str:
    """A config error as a Run user reads it: `train.global_batch_size=33 ...` → `global_batch_size=33 ...`."""
    for name, key in sorted(ARGUMENTS.items(), key=lambda item: -len(item[1])):
        if key != name:
            message = message.replace(f"{key}=", f"{name}=").replace(f"'{key}'", f"'{name}'")
    return message.replace("(README, Configuration)", "(docs/library.md)")
