"""What one training step does, op by op: live tensor bytes, FLOPs and bytes moved.

`OpRecorder` is a TorchDispatchMode that sees every aten op of the step (forward, backward
and optimizer alike). It counts each live storage once (a weak reference tells it when the
storage dies, so tensors autograd saves for backward stay counted as long as they live) and,
after every op, records:

- live bytes (and the same with each storage rounded up to CUDA's 512-byte blocks),
- bytes of live storages that autograd saved for backward (activations),
- gradient bytes accumulated so far,
- the op's FLOPs, by torch's own formulas (torch.utils.flop_counter's registry), the bytes
  it reads and writes (inputs + outputs; views move nothing), and of those the bytes written
  to storages the op allocated (on a CPU, fresh pages cost a page fault each),
- the loop's phase (forward, backward, optimizer, ...).

It sees what the dispatcher sees: temporaries inside one kernel (oneDNN, cuDNN workspaces)
are not in it; the memory rules add them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils import flop_counter

from multicard.base.torch_compat import VIEW_OPS as _VIEW_OPS
from multicard.base.torch_compat import TorchDispatchMode, tree_flatten

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every block up to this many bytes
aten = torch.ops.aten
_IGNORED = {torch.ops.prim.device.default}  # asked thousands of times by fake tensors; no work


def _cpu_attention_flops() -> dict[Any, Callable[..., int]]:
    """FLOP formulas for the CPU flash-attention kernels, which torch's registry lacks (it has
    the CUDA ones): the same counts as torch's formulas for the same shapes."""
    table: dict[Any, Callable[..., int]] = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):

        def forward_count(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any, **__: Any) -> int:
            return flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape)

        def backward_count(
            go: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any, **__: Any
        ) -> int:
            return flop_counter.sdpa_backward_flop_count(go.shape, q.shape, k.shape, v.shape)

        table[aten._scaled_dot_product_flash_attention_for_cpu] = forward_count
        table[aten._scaled_dot_product_flash_attention_for_cpu_backward] = backward_count
    return table


_CPU_ATTENTION = _cpu_attention_flops()
_CONVOLUTIONS = {aten.convolution, aten._convolution, aten.convolution_backward, aten.cudnn_convolution}


def _grouped_conv_backward_flops(args: tuple) -> int:
    """torch's formula for convolution_backward leaves `groups` out (a depthwise convolution's
    backward comes out ~40× too high); each gradient it makes costs what the forward does."""
    grad_out, x, w, transposed, mask = args[0], args[1], args[2], args[7], args[10]
    forward = flop_counter.conv_flop_count(x.shape, w.shape, grad_out.shape, transposed)
    return forward * (int(mask[0]) + int(mask[1]))


def op_flops(packet: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one op by torch.utils.flop_counter's formulas (matmuls, convolutions, attention)."""
    if packet in _CPU_ATTENTION:
        return int(_CPU_ATTENTION[packet](*args, **kwargs))
    if packet is aten.convolution_backward and len(args) > 10 and _groups(packet, args) > 1:
        return _grouped_conv_backward_flops(args)
    formula = flop_counter.flop_registry.get(packet)
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


# Kinds of op, for the time model: which rate applies. On a CPU a grouped or depthwise
# convolution runs far below a dense one's rate, its backward below its forward's, and a
# normalisation reads its input more than once (statistics, then the normalised values).
OTHER, MATMUL, CONV, GROUPED_CONV, GROUPED_CONV_BACKWARD, NORM = 0, 1, 2, 3, 4, 5
_NORMS = {
    "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "batch_norm_backward", "native_layer_norm", "native_layer_norm_backward",
    "native_group_norm", "native_group_norm_backward",
}  # fmt: skip
# Where each convolution op takes `groups` among its arguments.
_GROUPS_AT = {aten.convolution: 8, aten._convolution: 8, aten.convolution_backward: 9, aten.cudnn_convolution: 5}


# Elementwise ops that evaluate an exponential (or erf, tanh) per value: on a CPU their time is
# that arithmetic more than their bytes (SiLU, GELU, sigmoid, softmax and their backward).
_TRANSCENDENTAL = {
    "silu", "silu_backward", "sigmoid", "sigmoid_backward", "gelu", "gelu_backward", "tanh", "tanh_backward",
    "exp", "erf", "mish", "mish_backward", "elu", "elu_backward", "_softmax", "_softmax_backward_data",
    "_log_softmax", "_log_softmax_backward_data",
}  # fmt: skip


def _compute_kind(packet: Any, args: tuple) -> int:
    if packet not in _CONVOLUTIONS:
        return MATMUL
    if _groups(packet, args) == 1:
        return CONV
    return GROUPED_CONV_BACKWARD if packet is aten.convolution_backward else GROUPED_CONV


def _groups(packet: Any, args: tuple) -> int:
    at = _GROUPS_AT.get(packet)
    return int(args[at]) if at is not None and len(args) > at else 1


@dataclass
class OpSeries:
    """Per-op records of one traced step (lists and numpy arrays of equal length)."""

    phase: list[str]
    names: list[str]
    live: np.ndarray
    live_cuda: np.ndarray
    saved: np.ndarray
    grads: np.ndarray
    flops: np.ndarray
    moved: np.ndarray
    fresh: np.ndarray  # bytes of `moved` written into storages this op allocated
    elements: np.ndarray  # values a transcendental elementwise op evaluates (0 for other ops)
    kind: np.ndarray  # OTHER / MATMUL / CONV / GROUPED_CONV / GROUPED_CONV_BACKWARD / NORM


class OpRecorder(TorchDispatchMode):
    """Records the series above for every op run inside it (see the module docstring)."""

    def __init__(self, phase: Callable[[], str]) -> None:
        super().__init__()
        self._phase = phase
        self._bytes: dict[int, int] = {}  # id(storage) -> bytes
        self._refs: dict[int, weakref.ref] = {}
        self._saved: set[int] = set()
        self._persistent: set[int] = set()  # parameters and buffers: saved for backward, but not activations
        self._grads: set[int] = set()
        self.live = 0
        self.live_cuda = 0
        self.saved_live = 0
        self.grads = 0
        self.largest_new = 0  # largest storage created inside the mode (an activation, usually)
        self._rows: list[tuple[int, ...]] = []
        self._phases: list[str] = []
        self._names: list[str] = []

    # ------------------------------------------------------------ storages

    def track(self, tensor: torch.Tensor, new: bool = False, persistent: bool = False) -> None:
        """Count `tensor`'s storage from now until it dies (once, however many views share it)."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if persistent:
            self._persistent.add(key)
        size = storage.nbytes()
        known = self._bytes.get(key)
        if known is not None:
            if size != known:  # resized in place (FSDP frees unsharded parameters this way)
                self._resize(key, known, size)
            return
        self._resize(key, 0, size)
        if new:
            self.largest_new = max(self.largest_new, size)
        self._refs[key] = weakref.ref(storage, lambda _: self._forget(key))

    def _resize(self, key: int, old: int, new: int) -> None:
        self._bytes[key] = new
        self.live += new - old
        self.live_cuda += _rounded(new) - _rounded(old)
        if key in self._saved:
            self.saved_live += new - old
        if key in self._grads:
            self.grads += new - old

    def _forget(self, key: int) -> None:
        self._resize(key, self._bytes.get(key, 0), 0)
        del self._bytes[key]
        self._refs.pop(key, None)
        self._saved.discard(key)
        self._grads.discard(key)

    def mark_saved(self, tensor: torch.Tensor) -> None:
        """`tensor` is kept by autograd for backward: its storage counts as activation memory."""
        self.track(tensor)
        key = id(tensor.untyped_storage())
        if key not in self._saved and key not in self._persistent:
            self._saved.add(key)
            self.saved_live += self._bytes[key]

    def mark_grad(self, tensor: torch.Tensor) -> None:
        """`tensor` is a parameter's gradient: its storage counts as gradient memory while it lives."""
        self.track(tensor)
        key = id(tensor.untyped_storage())
        if key not in self._grads:
            self._grads.add(key)
            self.grads += self._bytes[key]

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Tensors autograd saves inside the block are marked as activations."""

        def pack(t: torch.Tensor) -> torch.Tensor:
            self.mark_saved(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    # ------------------------------------------------------------ ops

    @property
    def ops(self) -> int:
        return len(self._rows)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _IGNORED:
            return func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for t in inputs:  # tensors made outside the mode (parameters, torch.tensor constants)
            self.track(t)
        # Fused optimizer kernels update in place and return nothing; fake tensors have no kernel for
        # them and would run the real one on zero-filled copies of every parameter (slow, and real memory).
        out = None if _is_fused_update(func) else func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        known = len(self._bytes)
        for t in outputs:
            self.track(t, new=True)
        created = len(self._bytes) > known
        packet = func._overloadpacket
        flops = op_flops(packet, args, kwargs, out)
        moved = fresh = 0
        if packet not in _VIEW_OPS:
            read = sum(t.numel() * t.element_size() for t in inputs)
            written = sum(t.numel() * t.element_size() for t in outputs)
            in_place = func._schema.name.endswith("_") or not outputs
            moved = read + (max(written, read) if in_place else written)
            fresh = written if created and not in_place else 0
        kind = NORM if packet.__name__ in _NORMS else OTHER
        if flops:
            kind = _compute_kind(packet, args)
        elements = sum(t.numel() for t in outputs) if packet.__name__.rstrip("_") in _TRANSCENDENTAL else 0
        # in OpSeries's order of fields (after phase and names)
        self._rows.append((self.live, self.live_cuda, self.saved_live, self.grads, flops, moved, fresh, elements, kind))
        self._phases.append(self._phase())
        self._names.append(packet.__name__)
        return out

    def series(self) -> OpSeries:
        rows = np.array(self._rows, dtype=np.int64).reshape(-1, 9)
        return OpSeries(list(self._phases), list(self._names), *rows.T)


def _is_fused_update(func: Any) -> bool:
    name = func._schema.name
    return name.startswith("aten::_fused_") and name.endswith("_") and not func._schema.returns


def _rounded(nbytes: int) -> int:
    return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK
