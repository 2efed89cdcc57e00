"""Code of the user's that multicard runs in its own process: a dataset or model module's import
and its function (`data.name=` / `model.name=package.module:function`), the model's forward.

An exception of that code's own is the user's to read: it keeps its traceback (exit 1), with a
note naming what multicard had called (`user_code`, `noted`); only what multicard can tell is
bad input — arguments from the config that the function does not take (`check_arguments`), a
module that is not there — becomes one line.

Such code may change what the whole process runs under: torch's default dtype (the run's
precision comes from the config, and tensors multicard makes, e.g. the loaders' normalisation,
would follow the changed default), or the handlers of the stop signals (a module that ignores
SIGTERM would silently turn off the graceful stop). `user_code` puts both back as they were
before the call and says so in one line.
"""

from __future__ import annotations

import importlib
import inspect
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from multicard.base.errors import MulticardError, UserError
from multicard.runtime.stopping import HANDLED_SIGNALS


def noted(exc: BaseException, what: str) -> None:
    """Say on the user's own exception, below its traceback, what multicard had called (Python
    3.11's exception notes; before that the traceback alone says it)."""
    if not isinstance(exc, MulticardError) and hasattr(exc, "add_note"):
        exc.add_note(f"multicard: raised by {what}")


def check_arguments(function: Callable[..., Any], what: str, *args: Any, **kwargs: Any) -> None:
    """One line, before the call, if `function` cannot take these arguments: the config gave it
    keyword arguments (model.kwargs, data.kwargs) its signature has no place for."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a callable whose signature Python cannot read: the call will say
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise UserError(f"{what}: {exc}") from None


def missing_module(exc: ImportError, module: str) -> bool:
    """The import failed because `module` itself (or its package) is not there, not because the
    module's own code failed, or a module it imports is missing."""
    name = getattr(exc, "name", None) or ""
    return isinstance(exc, ModuleNotFoundError) and bool(name) and (module == name or module.startswith(name + "."))


def _handlers() -> dict[int, Any]:
    return {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}


@contextmanager
def user_code(what: str) -> Iterator[None]:
    """Run the block (the user's `what`, e.g. "data.name=M:F"), then put back torch's default
    dtype and the stop signals' handlers if it changed them, with one warning line. An exception
    of the user's own passes with a note naming `what`."""
    dtype, handlers = torch.get_default_dtype(), _handlers()
    try:
        yield
    except Exception as exc:
        noted(exc, what)
        raise
    finally:
        changes = []
        changed = torch.get_default_dtype()
        if changed != dtype:
            torch.set_default_dtype(dtype)
            changes.append(
                f"set torch's default dtype to {changed} (multicard put back {dtype}: the run's precision comes from "
                f"the config)"
            )
        moved = [sig for sig, handler in _handlers().items() if handler != handlers[sig]]
        for sig in moved:
            signal.signal(sig, handlers[sig])  # only the main thread can have changed them
        if moved:
            changes.append(
                f"changed the handler of {', '.join(signal.Signals(sig).name for sig in moved)} (multicard put back "
                f"the previous handlers: a stop signal still stops a training run with a checkpoint)"
            )
        if changes:
            print(f"multicard: warning: {what} {' and '.join(changes)}", file=sys.stderr, flush=True)


def import_function(spec: str, key: str, reason: Callable[[ImportError], str] = str) -> Callable[..., Any]:
    """`package.module:function`, given for `key` (model.name, data.name) → the function, or a one-line
    error (`reason`: how it words the failed import)."""
    module_name, _, func_name = spec.partition(":")
    try:
        with user_code(f"{key}={spec}"):
            module = importlib.import_module(module_name)
    except ImportError as exc:
        if not missing_module(exc, module_name):
            raise  # the module's own code failed: its traceback says where
        raise UserError(f"{key}={spec}: cannot import module {module_name} ({reason(exc)})") from None
    function = getattr(module, func_name, None)
    if not callable(function):
        raise UserError(f"{key}={spec}: module {module_name} has no function {func_name}")
    return function
