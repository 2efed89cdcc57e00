"""Fake tensors for planning: a model built and stepped with shapes and dtypes only.

Nothing is allocated and no GPU is needed, so a 300M-parameter model plans on a laptop. Two
quirks of torch's FakeTensorMode are handled here:

- `nn.init` functions are made no-ops while the model is built: some read values back
  (data-dependent), which fake tensors cannot answer, and values do not change memory or FLOPs.
- `Module.to()` replaces fake parameters by swapping tensors, which torch refuses while a weak
  reference to the parameter exists, and the mode's memo of converted tensors holds weak
  references. So the memo holds strong references while the model is built and placed, and
  weak ones again before the step is traced (a strong memo would keep activations alive). What a
  forward without gradients makes while the model is built (the check of its input size) is held
  weakly even then: no parameter is made there, and a view of one, held, would block its swap.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn.init
from torch._subclasses.fake_tensor import FakeTensorMode


def _keep(*args: Any, **kwargs: Any) -> Any:
    """An nn.init function that leaves its tensor as it is."""
    return args[0] if args else next(iter(kwargs.values()))


@contextmanager
def no_init() -> Iterator[None]:
    """torch.nn.init.*_ (the in-place initialisers) do nothing inside the block."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved: dict[str, Callable[..., Any]] = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for name in names:
            setattr(torch.nn.init, name, _keep)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


class BuildingMemo(dict):
    """The fake mode's memo of converted tensors while a model is built: strong references, but for
    what a forward without gradients makes (weak ones, see the module docstring)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value if torch.is_grad_enabled() else weakref.ref(value))

    def __getitem__(self, key: Any) -> Any:
        value = super().__getitem__(key)
        if isinstance(value, weakref.ref):
            value = value()
            if value is None:
                raise KeyError(key)
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def tensors(self) -> dict[Any, Any]:
        """The tensors it holds, those held weakly that are still alive included."""
        return {key: value for key in list(self) if (value := self.get(key)) is not None}


class FakeWorld:
    """One FakeTensorMode for one plan trace: `building()` to make and place the model, then
    `stepping()` to run it."""

    _converter: Any  # the mode's meta converter: its tensor_memo is the memo (one of ours, so untyped here)

    def __init__(self) -> None:
        self.mode = FakeTensorMode()
        self._converter = self.mode.fake_tensor_converter.meta_converter
        self._converter.tensor_memo = BuildingMemo(self._converter.tensor_memo)

    @contextmanager
    def building(self) -> Iterator[None]:
        with self.mode, no_init():
            yield

    @contextmanager
    def stepping(self) -> Iterator[None]:
        self._converter.tensor_memo = weakref.WeakValueDictionary(self._converter.tensor_memo.tensors())
        with self.mode:
            yield
