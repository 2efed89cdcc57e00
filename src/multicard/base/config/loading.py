"""Loading: dataclass defaults < YAML file < dotted KEY=VALUE overrides.

OmegaConf does the merging and type checking; this module turns its errors into one-line
`UserError`s and has the config check the value ranges it cannot express (`Config.check`). The
result is read-only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from multicard.base.config.top import PATH_KEYS, Config
from multicard.base.errors import UserError
from multicard.base.locations import canonical


def _one_line(exc: OmegaConfBaseException) -> str:
    if isinstance(exc, ConfigKeyError) and getattr(exc, "key", None) is not None:
        key = exc.full_key or exc.key
        return f"unknown key '{key}'; check its spelling against multicard's config (README, Configuration)"
    msg = str(exc).splitlines()[0].strip()
    key = getattr(exc, "full_key", None)
    if key and key not in msg:
        msg = f"{key}: {msg}"
    return msg


def load_config(
    path: str | None = None, overrides: list[str] | None = None, defaults: dict[str, Any] | None = None
) -> Config:
    """Build the frozen config from defaults, an optional YAML file and overrides.

    `defaults` (dotted keys) replace the built-in defaults and lose to the file and overrides:
    bench and verify use them for their own workload.
    """
    node = OmegaConf.structured(Config)
    if defaults:
        node = _merge(node, OmegaConf.from_dotlist([f"{k}={v}" for k, v in defaults.items()]))
    if path is not None:
        file = Path(path).expanduser()
        if file.is_dir():
            raise UserError(f"--config {path} is a directory; pass a YAML file, e.g. {path}/demo.yaml")
        if not file.is_file():
            raise UserError(f"config file not found: {path} (pass an existing YAML file to --config)")
        try:
            loaded = OmegaConf.load(file)
        except Exception as exc:  # YAML syntax errors and the like
            raise UserError(f"bad config file {path}: {_yaml_problem(exc)}") from None
        if not isinstance(loaded, DictConfig):
            raise UserError(f"config file {path} must hold a mapping of keys to values")
        node = _merge(node, loaded)
    return _finish(node, overrides)


def _yaml_problem(exc: Exception) -> str:
    """'line L, column C: what is wrong' for YAML syntax errors, else the first line."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return str(exc).splitlines()[0]


def config_from_dict(data: dict, overrides: list[str] | None = None) -> Config:
    """Rebuild a config saved in a checkpoint (or by to_dict), then apply overrides."""
    return _finish(_merge(OmegaConf.structured(Config), OmegaConf.create(data)), overrides)


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """A copy of `cfg` with dotted KEY=VALUE overrides applied and validated."""
    return config_from_dict(to_dict(cfg), overrides)


def _merge(base: DictConfig, other: DictConfig) -> DictConfig:
    try:
        return cast(DictConfig, OmegaConf.merge(base, other))  # two mappings merge into a mapping
    except OmegaConfBaseException as exc:
        raise UserError(f"bad config: {_one_line(exc)}") from None


def _finish(node: DictConfig, overrides: list[str] | None) -> Config:
    for item in overrides or []:
        if "=" not in item:
            raise UserError(f"override '{item}' is not KEY=VALUE (for example train.epochs=5)")
        try:
            dotlist = OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as exc:
            raise UserError(f"bad override '{item}': {_one_line(exc)}") from None
        node = _merge(node, dotlist)
    try:
        cfg = cast(Config, OmegaConf.to_object(node))  # the node is OmegaConf.structured(Config), merged
    except OmegaConfBaseException as exc:
        raise UserError(f"bad config: {_one_line(exc)}") from None
    cfg = _canonical_paths(cfg)
    cfg.check()
    return cfg


def _canonical_paths(cfg: Config) -> Config:
    """Every path and URL of the config in its canonical form (base/locations.py: `~` expanded, a URL's
    scheme in lower case, file:///abs as /abs), or one line for a malformed one: parsed here, once."""
    changes: dict[str, dict[str, str]] = {}
    for key in PATH_KEYS:
        value = cfg.path(key)
        if value:
            section, _, name = key.rpartition(".")
            changes.setdefault(section, {})[name] = canonical(value, key)
    top: dict[str, Any] = changes.pop("", {})  # keyword arguments of several fields' types
    sections: dict[str, Any] = {
        section: dataclasses.replace(getattr(cfg, section), **values) for section, values in changes.items()
    }
    return dataclasses.replace(cfg, **top, **sections)


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))
