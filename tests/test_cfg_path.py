"""The path of the config from `multicard train` to the first optimizer step.

A tiny single-process training runs in this process under a tracer that records every module of
src/multicard in which a function is called with the run's Config object, or one of its sections,
as an argument (identity, not equality), until the loop's first optimizer step. Deep modules take
plain values or small purpose-made objects instead, so the config crosses few modules (the list:
docs/architecture.md, "The path of cfg").
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path

import multicard
from conftest import TINY, run_here
from multicard.base.config import Config

PACKAGE = str(Path(multicard.__file__).parent)
MAX_MODULES = 23


def module_of(filename: str) -> str:
    return str(Path(filename).relative_to(PACKAGE).with_suffix("")).replace("/", ".").removesuffix(".__init__")


def unit_of(module: str) -> str:
    """The config package counts once, as base/config.py did before it was split for size: its
    modules declare the options and their rules (methods of the config itself)."""
    return "base.config" if module.startswith("base.config.") else module


def record_calls(argv: list[str]) -> list[tuple[str, str, list]]:
    """(module, function, its arguments that are config objects) of every call made in src/multicard
    by `multicard ARGV` until the first optimizer step; the objects are kept (identity is compared later)."""
    calls: list[tuple[str, str, list]] = []
    config_types = tuple({Config, *(type(getattr(Config(), f.name)) for f in dataclasses.fields(Config))})

    def trace(frame, event, arg) -> None:  # called for each new frame only (returns no local tracer)
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return
        code = frame.f_code
        count = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)
        values = [frame.f_locals.get(name) for name in code.co_varnames[:count]]
        values += [v for tup in values if isinstance(tup, tuple) for v in tup]  # *args
        found = [v for v in values if isinstance(v, config_types)]
        calls.append((module_of(code.co_filename), code.co_qualname, found))
        if code.co_name == "optimizer_step" and module_of(code.co_filename) == "engine.loop":
            sys.settrace(None)

    import multicard.cli.commands  # noqa: F401  (the training stack, loaded first: its imports are not the path)

    sys.settrace(trace)
    try:
        run_here(*argv)
    finally:
        sys.settrace(None)
    return calls


def cfg_path(calls: list[tuple[str, str, list]]) -> list[tuple[str, list[str]]]:
    """The modules, in the order the run's config first reaches them, each with its functions that
    receive the config or a section of it."""
    cfg = next(found[0] for module, name, found in calls if module == "cli.commands" and name == "train")
    sections = [getattr(cfg, f.name) for f in dataclasses.fields(cfg)]
    parts = [cfg, *(s for s in sections if dataclasses.is_dataclass(s))]
    path: dict[str, list[str]] = {}
    for module, name, found in calls:
        if any(obj is part for obj in found for part in parts):
            names = path.setdefault(unit_of(module), [])
            where = name if unit_of(module) == module else f"{module.rpartition('.')[2]}.{name}"
            if where not in names:
                names.append(where)
    return list(path.items())


def test_cfg_crosses_few_modules_on_its_way_to_the_first_optimizer_step(tmp_path):
    small = ["data.train_size=64", "data.val_size=32", "train.max_steps=2"]
    calls = record_calls(["train", *TINY, *small, f"out_dir={tmp_path}"])
    assert any(module == "engine.loop" and name.endswith("optimizer_step") for module, name, _ in calls)
    path = cfg_path(calls)
    listing = "\n".join(f"{i:2}. {module}: {', '.join(names)}" for i, (module, names) in enumerate(path, 1))
    print(listing)
    assert len(path) <= MAX_MODULES, f"cfg crosses {len(path)} modules:\n{listing}"
