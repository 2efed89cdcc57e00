"""timm models (`model.name=timm:NAME`, the optional `timm` extra): built without downloads, trained
and evaluated through the CLI, DDP parity in float64, FSDP units, weights from a timm state dict.

Tests that need timm skip without it; the missing-extra error is tested by hiding timm.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from conftest import clean_env, final_params, load_checkpoint, max_rel_diff, run_here
from multicard.base.errors import UserError
from multicard.checkpoint.weights import load_weights
from multicard.strategy.fsdp_units import family_units
from multicard.strategy.models import build_model

needs_timm = pytest.mark.skipif(
    importlib.util.find_spec("timm") is None, reason="timm is not installed (pip install 'multicard[timm]')"
)

VIT = ["model.name=timm:vit_tiny_patch16_224", "model.kwargs={img_size: 32, drop_rate: 0.0, drop_path_rate: 0.0}"]
FAMILIES = {
    "resnet": ["model.name=timm:resnet18"],
    "convnext": ["model.name=timm:convnext_atto"],
    "vit": VIT,
}
# 32 px synthetic images, 2 optimizer steps: enough to run every path of a model family.
SHORT = [
    "data.image_size=32",
    "data.train_size=64",
    "data.val_size=50",
    "train.global_batch_size=16",
    "train.max_steps=2",
    "log_every=1",
    "devices=cpu",
]


def _model_name(args: list[str]) -> str:
    return next(a for a in args if a.startswith("model.name=")).split("=", 1)[1]


def test_timm_without_the_extra_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # `import timm` now raises ImportError
    with pytest.raises(UserError) as info:
        build_model("timm:resnet18", 10)
    message = str(info.value)
    assert "\n" not in message and "pip install 'multicard[timm]'" in message


@pytest.mark.slow
def test_cli_without_timm_exits_2_with_one_line(tmp_path):
    """The same, through `multicard train` in a process where timm cannot be imported."""
    hide_timm = "import sys; sys.modules['timm'] = None; from multicard.cli.main import main; sys.exit(main())"
    result = subprocess.run(
        [sys.executable, "-c", hide_timm, "train", "model.name=timm:resnet18", *SHORT, f"out_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120, env=clean_env(),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "multicard[timm]" in result.stderr


@needs_timm
def test_unknown_timm_model_is_named_with_close_matches():
    with pytest.raises(UserError, match=r"has no model convnext_attoo \(close: convnext_atto"):
        build_model("timm:convnext_attoo", 10)


@needs_timm
def test_pretrained_is_refused_so_nothing_is_downloaded():
    with pytest.raises(UserError, match="never downloads weights"):
        build_model("timm:resnet18", 10, {"pretrained": True})


@needs_timm
def test_kwargs_reach_timm_create_model():
    model = build_model("timm:vit_tiny_patch16_224", 7, {"img_size": 32, "depth": 2})
    assert len(model.blocks) == 2 and model.head.out_features == 7
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 7)


@needs_timm
def test_a_timm_state_dict_file_loads_as_model_weights(tmp_path):
    """torch.save(model.state_dict()) of a timm model, with another head: the body loads, the head
    keeps its initialisation and is named."""
    torch.manual_seed(0)
    trained = build_model("timm:convnext_atto", 1000)
    path = tmp_path / "convnext_atto.pth"
    torch.save(trained.state_dict(), path)
    torch.manual_seed(1)
    fresh = build_model("timm:convnext_atto", 10)
    head = fresh.head.fc.weight.detach().clone()
    note = load_weights(fresh, str(path))
    loaded, source = fresh.state_dict(), trained.state_dict()
    body = [k for k in loaded if not k.startswith("head.fc.")]
    assert body and all(torch.equal(loaded[k], source[k]) for k in body)
    assert torch.equal(loaded["head.fc.weight"], head)
    assert "2 keep their initialisation (head.fc.weight, head.fc.bias)" in note


@needs_timm
def test_fsdp_units_follow_each_timm_family():
    """timm's ResNet: each residual block (like torchvision's); ConvNeXt: each stage; ViT: each block."""
    expected = {
        "timm:resnet18": ([f"layer{i}.{j}" for i in range(1, 5) for j in range(2)], "BasicBlock"),
        "timm:convnext_atto": ([f"stages.{i}" for i in range(4)], "ConvNeXtStage"),
        "timm:vit_tiny_patch16_224": ([f"blocks.{i}" for i in range(12)], "Block"),
    }
    for name, (units, kind) in expected.items():
        model = build_model(name, 10)
        names = {id(m): n for n, m in model.named_modules()}
        chosen = family_units(model)
        assert [names[id(m)] for m in chosen] == units, name
        assert {type(m).__name__ for m in chosen} == {kind}, name


@needs_timm
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_timm_family_trains_and_evaluates(tmp_path, family):
    args = FAMILIES[family]
    run_here("train", *args, *SHORT, f"out_dir={tmp_path}")
    checkpoint = tmp_path / "checkpoints" / "last.pt"
    state = load_checkpoint(checkpoint)
    assert state["step"] == 2
    fresh = build_model(_model_name(args), 10, state["config"]["model"]["kwargs"])
    assert list(state["model"]) == list(fresh.state_dict())  # plain keys: no module./_orig_mod. prefix
    scores = json.loads(run_here("eval", "--checkpoint", str(checkpoint), "--json", "devices=cpu").splitlines()[-1])
    epochs = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "epoch"]
    assert scores["samples"] == 50
    assert (scores["top1"], scores["top5"]) == (epochs[-1]["val_top1"], epochs[-1]["val_top5"])


@needs_timm
@pytest.mark.distributed
def test_timm_vit_ddp2_equals_single_process_in_float64(tmp_path):
    """A BatchNorm-free timm model with dropout off: ddp×2 ends with the single process's parameters."""
    parity = [*VIT, *SHORT, "precision=fp64", "train.max_steps=3", "data.val_size=16"]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    run_here("train", *parity, f"out_dir={single}")
    assert "world_size=2" in run_here("train", "--nproc-per-node", "2", *parity, f"out_dir={ddp}")
    assert max_rel_diff(final_params(ddp), final_params(single)) < 1e-10


@needs_timm
@pytest.mark.distributed
def test_fsdp2_trains_a_timm_resnet(tmp_path):
    run_here("train", "--nproc-per-node", "2", "strategy=fsdp", *FAMILIES["resnet"], *SHORT, f"out_dir={tmp_path}")
    params = final_params(tmp_path)  # whole tensors, read from the shards
    torch.manual_seed(0)  # the run's seed: its initial weights
    initial = build_model("timm:resnet18", 10).state_dict()
    assert params.keys() == initial.keys()
    assert all(params[k].shape == initial[k].shape and params[k].isfinite().all() for k in initial)
    convs = [k for k in initial if k.endswith("conv1.weight")]
    assert all(not torch.equal(params[k], initial[k]) for k in convs)  # both steps updated every block
