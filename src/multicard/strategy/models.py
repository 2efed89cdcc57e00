"""Model registry: torchvision names, CIFAR variants, a small CNN, `timm:NAME`, and `package.module:function`."""

from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from multicard.base.errors import UserError
from multicard.runtime.user_code import check_arguments, import_function, user_code


def resnet18_cifar(num_classes: int, **kwargs: Any) -> nn.Module:
    """ResNet-18 for 32×32 inputs: a 3×3 stride-1 stem and no max-pool."""
    model = torchvision_models().resnet18(weights=None, num_classes=num_classes, **kwargs)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def smallcnn(num_classes: int, width: int = 32, norm: str = "batch") -> nn.Module:
    """Three conv blocks and global max-pool: trains in seconds on a CPU.

    norm="none" gives a model without BatchNorm, whose DDP and single-process runs agree
    exactly (used by the parity tests and `multicard verify`).
    """
    if norm not in ("batch", "none"):
        raise UserError(f"model.kwargs.norm={norm} is not one of batch, none")

    def block(cin: int, cout: int) -> nn.Sequential:
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1, bias=norm == "none")]
        if norm == "batch":
            layers.append(nn.BatchNorm2d(cout))
        layers.append(nn.ReLU(inplace=True))
        return nn.Sequential(*layers)

    return nn.Sequential(
        block(3, width),
        nn.MaxPool2d(2),
        block(width, 2 * width),
        nn.MaxPool2d(2),
        block(2 * width, 4 * width),
        nn.AdaptiveMaxPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, num_classes),
    )


class _Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class _Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def fastnet(num_classes: int, widths: tuple[int, ...] = (32, 64, 128), head_scale: float = 0.125) -> nn.Module:
    """A compact residual conv net for fast training on CIFAR-size images.

    Each stage max-pools right after its first convolution, so its residual convolution runs
    at the lower resolution, and the logits are scaled down (head_scale), which keeps training
    stable at high learning rates.
    """

    def conv_bn(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.GELU()]

    layers: list[nn.Module] = conv_bn(3, widths[0])
    cin = widths[0]
    for width in widths:
        conv, *rest = conv_bn(cin, width)
        layers += [conv, nn.MaxPool2d(2), *rest, _Residual(nn.Sequential(*conv_bn(width, width)))]
        cin = width
    layers += [nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes, bias=False), _Scale(head_scale)]
    return nn.Sequential(*layers)


EXACT_BITS = 53  # float64 holds every integer up to 2^53 exactly


def _all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """`tensor` reduced over the ranks ("sum" or "max") in place when a process group is up."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(tensor, getattr(torch.distributed.ReduceOp, op.upper()))
    return tensor


def patch_moments(patches: torch.Tensor, unit: float, bits: int) -> torch.Tensor:
    """Σ p·pᵀ over the rows p of `patches`, each value first rounded to the grid unit·2^-bits; in
    units of (unit·2^-bits)².

    unit is a power of two ≥ every |value|, so each rounded value is an integer of at most 2^bits
    (the scaling is exact); with 2·bits + ⌈log2 rows of the whole batch⌉ ≤ EXACT_BITS every
    product and every partial sum is an integer that float64 holds exactly. So the sum has the
    same bits in any order: any split of the rows over ranks, any BLAS kernel, CPU or GPU."""
    grid = (patches * (2.0**bits / unit)).round()
    return grid.T @ grid


class PatchWhitening(nn.Module):
    """A frozen convolution that whitens the image's patch×patch pixel patches (ZCA-like), with a
    learned bias: each eigenvector of the patch covariance, divided by the root of its eigenvalue,
    is a filter, and so is its negative (the GELU after it then sees both signs).

    The covariance comes from the first batch the model trains on (the first forward in training
    mode), summed over all ranks when a process group is up; it is a buffer, kept in checkpoints,
    so a resumed run does not recompute it. Until then (an eval before training) the filters are
    the identity on the patch's first pixel.

    The sum is exact (patch_moments), so every world size fits the same bits. It must be: the
    eigenvectors of nearly equal eigenvalues turn by rounding / gap, and each filter is a channel
    of its own, so a float sum in another order (1e-16) moved ddp×2's parameters after 4 steps
    6e-11 away from one process's on synthetic data, against 3e-14 with this sum (issue 37).
    """

    weight: torch.Tensor  # buffers (register_buffer), declared for the type checker
    fitted: torch.Tensor

    def __init__(self, patch: int = 2, eps: float = 5e-4) -> None:
        super().__init__()
        dims = 3 * patch * patch
        self.eps = eps
        self.register_buffer("weight", torch.zeros(2 * dims, 3, patch, patch))
        self.weight[:3, :, 0, 0] = torch.eye(3)
        self.weight[dims : dims + 3, :, 0, 0] = -torch.eye(3)
        self.register_buffer("fitted", torch.zeros((), dtype=torch.bool))
        self.bias = nn.Parameter(torch.zeros(2 * dims))

    def covariance(self, images: torch.Tensor) -> torch.Tensor:
        """The uncentred covariance of the batch's patches over all ranks, in float64."""
        patch = self.weight.shape[-1]
        patches = F.unfold(images.double(), patch).transpose(1, 2).reshape(-1, self.weight.shape[0] // 2)
        largest = _all_reduce(patches.abs().max().reshape(1), "max").item()
        count = int(_all_reduce(patches.new_tensor([len(patches)], dtype=torch.long), "sum"))
        unit = math.ldexp(1.0, math.frexp(largest)[1])  # the power of two above every |value|
        bits = (EXACT_BITS - (count - 1).bit_length()) // 2  # CIFAR's batch of 512: 17, 1/500 of a pixel step
        sums = _all_reduce(patch_moments(patches, unit, bits), "sum")  # integers below 2^53: exact
        return sums * (math.ldexp(unit, -bits) ** 2 / count)

    @torch.no_grad()
    def fit(self, images: torch.Tensor) -> None:
        eigenvalues, eigenvectors = torch.linalg.eigh(self.covariance(images))
        filters = eigenvectors.T / (eigenvalues + self.eps).sqrt().view(-1, 1)
        self.weight.copy_(torch.cat([filters, -filters]).view_as(self.weight))
        self.fitted.fill_(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and not self.fitted:
            self.fit(x)
        return F.conv2d(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


class _Shift(nn.Module):
    """A per-channel shift of bias_scale × a parameter: SGD moves it bias_scale² times faster than
    a plain bias at the same learning rate (the fast BatchNorm biases of the speed records).

    Apart from the BatchNorm before it (which has no affine part), so sync_bn's conversion of
    BatchNorm layers keeps it."""

    def __init__(self, channels: int, bias_scale: float) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(channels))
        self.bias_scale = bias_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.shift * self.bias_scale).to(x.dtype).view(1, -1, 1, 1)


def speednet(
    num_classes: int,
    widths: tuple[int, ...] = (64, 256, 256),
    patch: int = 2,
    whiten_eps: float = 5e-4,
    bn_momentum: float = 0.4,
    bias_scale: float = 8.0,
    head_scale: float = 1 / 9,
) -> nn.Module:
    """The net of our CIFAR-10 speed recipe (configs/cifar10_speedrun.yaml), after the published
    designs of the CIFAR speed records (airbench): a frozen patch-whitening first layer
    (PatchWhitening), then per width a block conv → max-pool → BN → GELU → conv → BN → GELU, where
    BatchNorm has no learned scale and a fast-moving shift, every convolution starts as the identity
    on its first input channels, and the logits are scaled down. The default widths are airbench's;
    the recipe uses 32/128/128, a third of their cost per image on our CPUs.
    """

    def conv(cin: int, cout: int) -> nn.Conv2d:
        layer = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        with torch.no_grad():
            nn.init.dirac_(layer.weight[: min(cin, cout)])
        return layer

    def norm(width: int) -> list[nn.Module]:
        batchnorm = nn.BatchNorm2d(width, eps=1e-12, momentum=bn_momentum, affine=False)
        return [batchnorm, _Shift(width, bias_scale), nn.GELU()]

    whitening = PatchWhitening(patch, whiten_eps)
    layers: list[nn.Module] = [whitening, nn.GELU()]
    cin = whitening.weight.shape[0]
    for width in widths:
        layers += [conv(cin, width), nn.MaxPool2d(2), *norm(width), conv(width, width), *norm(width)]
        cin = width
    layers += [nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes, bias=False), _Scale(head_scale)]
    return nn.Sequential(*layers)


BUILTIN: dict[str, Callable[..., nn.Module]] = {
    "resnet18_cifar": resnet18_cifar,
    "smallcnn": smallcnn,
    "fastnet": fastnet,
    "speednet": speednet,
}


TIMM_PREFIX = "timm:"


def _timm_factory(name: str) -> Callable[..., nn.Module]:
    """`timm:NAME` → timm.create_model(NAME, pretrained=False, num_classes=K, **model.kwargs).

    Never a download: pretrained is always False (initial weights come from a local file through
    model.weights=PATH), so a run behaves the same on a machine without internet.
    """
    arch = name.removeprefix(TIMM_PREFIX)
    try:
        import timm
    except ImportError:
        raise UserError(f"model.name={name} needs timm, an optional extra: pip install 'multicard[timm]'") from None
    if not timm.is_model(arch):
        close = difflib.get_close_matches(arch, timm.list_models(), n=3)
        hint = f" (close: {', '.join(close)})" if close else ""
        raise UserError(f"model.name={name}: timm {timm.__version__} has no model {arch}{hint}")

    def factory(num_classes: int, **kw: Any) -> nn.Module:
        if "pretrained" in kw:
            raise UserError(
                "model.kwargs.pretrained: multicard never downloads weights; "
                "give a local state dict file with model.weights=PATH"
            )
        return timm.create_model(arch, pretrained=False, num_classes=num_classes, **kw)

    return factory


def torchvision_models() -> Any:
    """torchvision.models, imported on first use: the import takes about a second (it pulls in
    torch's compiler), which processes that build our own models or none should not pay."""
    import torchvision.models

    return torchvision.models


def build_model(name: str, num_classes: int, kwargs: dict[str, Any] | None = None) -> nn.Module:
    """Build an untrained classifier with `num_classes` outputs."""
    kwargs = dict(kwargs or {})
    if "num_classes" in kwargs:  # every factory takes it from the data: two values would clash
        raise UserError(
            f"model.kwargs.num_classes={kwargs['num_classes']}: the number of classes comes from the data "
            f"(data.num_classes for synthetic data, else the class folders); remove it from model.kwargs"
        )
    if name.startswith(TIMM_PREFIX):
        factory = _timm_factory(name)
    elif ":" in name:
        factory = import_function(name, "model.name")
    elif name in BUILTIN:
        factory = BUILTIN[name]
    elif name in (tv := torchvision_models()).list_models(module=tv):
        def factory(num_classes: int, **kw: Any) -> nn.Module:
            return tv.get_model(name, weights=None, num_classes=num_classes, **kw)
    else:
        raise UserError(
            f"model.name={name} is unknown: use a torchvision classification model (e.g. resnet18), "
            f"{', '.join(BUILTIN)}, timm:NAME, or package.module:function"
        )
    rejected = f"model.name={name} rejected model.kwargs={kwargs}"
    check_arguments(factory, rejected, num_classes=num_classes, **kwargs)
    try:
        with warnings.catch_warnings(), user_code(f"model.name={name}"):
            # torchvision announces future changes of its defaults on every build (inception_v3,
            # googlenet): noise for a run that names its arguments in model.kwargs.
            warnings.simplefilter("ignore", FutureWarning)
            model = factory(num_classes=num_classes, **kwargs)
    except UserError:
        raise
    except (TypeError, ValueError, RuntimeError, AssertionError) as exc:
        if users_own(name):
            raise  # the user's function: its traceback is the report
        raise UserError(f"{rejected}: {_first_line(exc)}") from None  # a library's check of a value
    if not isinstance(model, nn.Module):
        raise UserError(f"model.name={name} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def users_own(name: str) -> bool:
    """model.name names the user's own code (package.module:function), not a model multicard,
    torchvision or timm builds: its exceptions are the user's to read, with their traceback."""
    return ":" in name and not name.startswith(TIMM_PREFIX)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_input_size(model: nn.Module, name: str, image_size: int, num_classes: int) -> None:
    """A forward of two blank images: a model that cannot take this image size (a ViT made for
    224 px, Inception at 32 px) fails here in one line, not in the middle of training; the user's
    own model (users_own) fails with its own traceback, which tells a bug from a size.

    Evaluation mode without gradients, so no state (BatchNorm statistics, random streams) changes.
    """
    was_training = model.training
    model.eval()
    blank = f"{image_size}×{image_size}"
    try:
        with torch.no_grad(), user_code(f"model.name={name}'s forward of 2 blank {blank} images (data.image_size)"):
            out = model(torch.zeros(2, 3, image_size, image_size))
    except Exception as exc:
        if users_own(name):
            raise  # a bug in the forward, or a size it cannot take: its traceback says which
        raise UserError(
            f"model.name={name} cannot take {blank} images ({_first_line(exc)}); "
            f"set data.image_size to a size it accepts (224 for most ImageNet models)"
        ) from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise UserError(
            f"model.name={name} returned {shape} for 2 images; a classifier returns (batch, {num_classes}) logits"
        )
