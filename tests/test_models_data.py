import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import TINY, cli, one_line
from multicard.base.errors import UserError
from multicard.cli.main import main
from multicard.data.sources.synthetic import make_synthetic
from multicard.strategy.base import Strategy
from multicard.strategy.models import build_model, check_input_size
from multicard.strategy.precision import AutocastForward, Precision


def tiny_user_model(num_classes):
    """A user model given as package.module:function."""
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))


class TypoInForward(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.fc = nn.Linear(3, num_classes)

    def forward(self, x):
        return self.fc(x.mean((2, 3)).flaten(1))  # a user's bug: Tensor has no `flaten`


def typo_in_forward(num_classes):
    """A user model (package.module:function) whose forward has a bug."""
    return TypoInForward(num_classes)


def for_32_pixels(num_classes, hidden=8):
    """A user model that takes 32×32 images only."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, hidden), nn.Linear(hidden, num_classes))


def typo_in_factory(num_classes):
    return nn.Linaer(3, num_classes)  # a user's bug in the function itself


def test_torchvision_model_by_name_has_the_dataset_classes():
    model = build_model("resnet18", 7)
    assert model.fc.out_features == 7


def test_resnet18_cifar_keeps_resolution_in_the_stem():
    model = build_model("resnet18_cifar", 10)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_user_model_from_module_function():
    model = build_model("test_models_data:tiny_user_model", 4)
    assert model(torch.randn(3, 3, 8, 8)).shape == (3, 4)


@pytest.mark.parametrize(
    "name, fragment",
    [("nosuchnet", "is unknown"), ("nosuchmodule:f", "cannot import"), ("math:nosuch", "has no function")],
)
def test_bad_model_names(name, fragment):
    with pytest.raises(UserError, match=fragment):
        build_model(name, 10)


@pytest.mark.slow
def test_a_bug_in_a_users_model_forward_keeps_its_traceback(tmp_path):
    """Before: one line `model.name=… cannot take 16×16 images (…); set data.image_size …`, exit 2."""
    result = cli("train", *TINY, "model.name=test_models_data:typo_in_forward", f"out_dir={tmp_path}",
                 env={"PYTHONPATH": str(Path(__file__).parent)})  # fmt: skip
    assert result.returncode == 1, result.stderr
    err = result.stderr
    assert "Traceback" in err and "test_models_data.py" in err and ".flaten(1)" in err, err
    assert "AttributeError: 'Tensor' object has no attribute 'flaten'" in err and "cannot take" not in err
    if sys.version_info >= (3, 11):  # exception notes
        assert "multicard: raised by model.name=test_models_data:typo_in_forward's forward of 2 blank 16×16" in err


def test_what_a_users_model_function_raises_is_its_own_and_config_it_cannot_take_one_line():
    with pytest.raises(AttributeError, match="Linaer"):  # a bug in the function: its own exception
        build_model("test_models_data:typo_in_factory", 4)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # a size it cannot take, said by torch
        check_input_size(build_model("test_models_data:for_32_pixels", 4), "test_models_data:for_32_pixels", 16, 4)
    with pytest.raises(UserError, match="rejected model.kwargs={'width': 3}: got an unexpected keyword argument"):
        build_model("test_models_data:for_32_pixels", 4, {"width": 3})  # the config's, not the function's


def test_num_classes_in_model_kwargs_says_it_comes_from_the_data(tmp_path, capsys):
    with pytest.raises(UserError, match=r"model.kwargs.num_classes=5: the number of classes comes from the data"):
        build_model("smallcnn", 10, {"num_classes": 5})
    pytest.importorskip("timm")
    argv = ["train", *TINY, "model.name=timm:resnet18", "model.kwargs={num_classes: 5}", f"out_dir={tmp_path}"]
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert "remove it from model.kwargs" in line and "<locals>" not in line


def test_smallcnn_without_norm_has_no_batchnorm():
    model = build_model("smallcnn", 10, {"norm": "none"})
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def test_synthetic_is_deterministic_and_balanced():
    x1, y1 = make_synthetic(500, 16, seed=3)
    x2, y2 = make_synthetic(500, 16, seed=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.dtype == torch.uint8 and x1.shape == (500, 3, 16, 16)
    assert torch.bincount(y1).tolist() == [50] * 10
    x3, _ = make_synthetic(500, 16, seed=4)
    assert not torch.equal(x1, x3)
    assert make_synthetic(10, 64, seed=0)[0].shape == (10, 3, 64, 64)


@pytest.mark.slow
def test_linear_classifier_stays_far_below_90_percent():
    """The embedded dataset must not be solvable by a linear model on pixels."""
    torch.manual_seed(0)
    xtr, ytr = make_synthetic(6000, 16, seed=0)
    xva, yva = make_synthetic(2000, 16, seed=1)
    xtr, xva = (xtr.float() / 255 - 0.5).flatten(1), (xva.float() / 255 - 0.5).flatten(1)
    linear = nn.Linear(xtr.shape[1], 10)
    opt = torch.optim.Adam(linear.parameters(), lr=1e-3)
    for _ in range(30):
        for idx in torch.randperm(6000).split(200):
            opt.zero_grad()
            F.cross_entropy(linear(xtr[idx]), ytr[idx]).backward()
            opt.step()
    accuracy = (linear(xva).argmax(1) == yva).float().mean().item()
    assert accuracy < 0.5, accuracy


def test_autocast_wrapper_runs_forward_in_bf16_and_unwraps():
    model = nn.Linear(4, 2)
    wrapped = AutocastForward(model, Precision("bf16", "cpu"))
    assert wrapped(torch.randn(3, 4)).dtype == torch.bfloat16
    assert Strategy.unwrap(nn.DataParallel(wrapped)) is model
    assert list(Strategy.unwrap(wrapped).state_dict()) == ["weight", "bias"]
