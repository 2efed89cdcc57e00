"""Which modules FSDP shards as units (each gathered whole while it runs, then freed again).

Per model family, one residual block or encoder block per unit: small units keep the
gathered parameters small, and on CPU they were fastest too (docs/benchmarks.md). Models of
no known family get a size rule; `fsdp.units` names module classes outright.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from multicard.base.config import FSDPConfig, ModelConfig
from multicard.base.errors import UserError
from multicard.strategy.models import build_model


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def family_units(model: nn.Module) -> list[nn.Module] | None:
    """The units of a known family, or None."""
    from multicard.strategy.models import torchvision_models

    tv = torchvision_models()
    if isinstance(model, tv.ResNet):  # each BasicBlock / Bottleneck
        return [m for m in model.modules() if isinstance(m, (tv.resnet.BasicBlock, tv.resnet.Bottleneck))]
    if isinstance(model, tv.VisionTransformer):  # each encoder block
        return list(model.encoder.layers)
    if isinstance(model, tv.ConvNeXt):  # each stage (a run of CNBlocks)
        return [m for m in model.features if any(isinstance(c, tv.convnext.CNBlock) for c in m.children())]
    # timm's ResNets (and others of torchvision's layout): layer1..layer4, each a Sequential of
    # residual blocks; each block is a unit, as for torchvision's ResNet. Matched by layout, since
    # timm is an optional extra.
    layers = [getattr(model, f"layer{i}", None) for i in range(1, 5)]
    sequences = [layer for layer in layers if isinstance(layer, nn.Sequential) and len(layer) > 0]
    if len(sequences) == len(layers):
        return [block for layer in sequences for block in layer]
    for name in ("blocks", "stages", "layers"):  # timm: ViTs have blocks (one per unit), ConvNeXt/EfficientNet stages
        children = getattr(model, name, None)
        if isinstance(children, (nn.Sequential, nn.ModuleList)) and len(children) > 1:
            return list(children)
    return None


def size_units(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Every module of at least `min_params` parameters whose children are all smaller; smaller
    modules stay with the nearest unit above them (the root at the last)."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if _params(child) < min_params:
                continue
            if any(_params(grandchild) >= min_params for grandchild in child.children()):
                visit(child)
            else:
                units.append(child)

    visit(model)
    return units


def named_units(model: nn.Module, names: list[str], model_name: str) -> list[nn.Module]:
    units = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not units:
        classes = sorted({type(m).__name__ for m in model.modules() if m is not model and _params(m) > 0})
        raise UserError(
            f"fsdp.units={names} matches no module of model.name={model_name}; its module classes with "
            f"parameters: {', '.join(classes[:12])}{', …' if len(classes) > 12 else ''}"
        )
    return units


def choose_units(model: nn.Module, options: FSDPConfig, model_name: str) -> list[nn.Module]:
    """The units to shard before the root, innermost first (FSDP shards nested units bottom-up)."""
    if options.units:
        units = named_units(model, list(options.units), model_name)
    else:
        units = family_units(model) or size_units(model, options.min_unit_params)
    depth = {id(m): name.count(".") for name, m in model.named_modules()}
    return sorted(units, key=lambda m: depth[id(m)], reverse=True)


def check_units(model_cfg: ModelConfig, units: list[str], num_classes: int) -> None:
    """fsdp.units names module classes of this model: checked on a model built on the meta
    device (no memory, no initialisation), before any worker starts."""
    if units:
        with torch.device("meta"):
            model = build_model(model_cfg.name, num_classes, dict(model_cfg.kwargs))
        named_units(model, units, model_cfg.name)
