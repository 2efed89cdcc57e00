"""ImageNet scale: the recipes (configs/imagenet_*.yaml) and GPU JPEG decoding (data.decode).

The recipes are checked against their published settings, their comments' commands are parsed,
and both train 8 steps under ddp×2 on CPU on real ImageNet photos at 224 px (symbolic links to
../shared/data/imagenet-sample, read in place). GPU decoding runs here with torchvision's CPU
decoder in nvjpeg's place: the batching, crop plans, resizing, flips and fallbacks are the same
code; the `cuda`-marked twins decode with nvjpeg.
"""

from __future__ import annotations

import io
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import ROOT, cli, load_checkpoint, run_here
from multicard import data as data_module
from multicard.base.config import load_config
from multicard.base.errors import UserError
from multicard.cli.main import parse
from multicard.data import build_data
from multicard.data.augmentation.transforms import FitSquare, RandomResizedCropFlip
from multicard.data.decoding.choice import choose_decode
from multicard.data.decoding.crops import crop_uniforms
from multicard.data.decoding.decode import read_image
from multicard.data.decoding.gpu_decode import TORCHVISION_DEPRECATION, GpuDecode, nvjpeg
from multicard.data.decoding.jpeg_crop import JpegFile, JpegTransform, collate_encoded
from multicard.data.loading.sampling import BatchSplit
from multicard.data.sources.folders import Files, InMemory, Splits
from multicard.runtime.process_group import ProcessContext
from multicard.strategy.optim import scaled_lr
from test_large_images import mad, photo_like, to_hwc

PHOTOS = ROOT.parent / "shared" / "data" / "imagenet-sample"
needs_photos = pytest.mark.skipif(not PHOTOS.is_dir(), reason=f"ImageNet sample photos not found at {PHOTOS}")
RECIPES = {"imagenet_resnet18": "resnet18", "imagenet_resnet50": "resnet50"}
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
SMOKE_CLASSES = 16  # global batch 2 × 8 steps: one epoch, one image per class
MODERN_CLASSES = 40  # the modern recipes' schedules below count epochs of 40 photos


def recipe(name: str) -> Path:
    return ROOT / "configs" / f"{name}.yaml"


# ------------------------------------------------------------------ recipes


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_is_the_reference_scaled_to_1024(name):
    """torchvision's reference recipe (lr 0.1 at batch 256, step ×0.1 every 30 of 90 epochs, weight
    decay 1e-4 on every parameter), linearly scaled to 1024 with a 5-epoch warm-up."""
    cfg = load_config(str(recipe(name)))
    assert cfg.model.name == RECIPES[name]
    d = cfg.data
    assert (d.name, d.image_size, d.eval_resize, d.crop_scale) == ("imagefolder", 224, 256, [0.08, 1.0])
    assert (d.mean, d.std) == (IMAGENET_MEAN, IMAGENET_STD)
    assert cfg.train.global_batch_size == 1024 and cfg.train.epochs == 90 and cfg.train.label_smoothing == 0
    assert scaled_lr(cfg.optim, cfg.train.global_batch_size) == pytest.approx(0.1 * 1024 / 256)
    assert (cfg.optim.momentum, cfg.optim.nesterov, cfg.optim.weight_decay) == (0.9, False, 1e-4)
    assert cfg.optim.decay_bias_and_norm
    assert (cfg.sched.name, cfg.sched.step_epochs, cfg.sched.gamma, cfg.sched.warmup_epochs) == ("step", 30, 0.1, 5)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_comments_cite_the_accuracy_and_give_valid_commands(name):
    text = recipe(name).read_text()
    comments = "\n".join(line[1:].strip() for line in text.splitlines() if line.startswith("#"))
    assert re.search(r"acc@1 \d\d\.\d{3}", comments) and "torchvision" in comments and "Goyal et al." in comments
    joined = comments.replace("\\\n", " ")
    one_node = re.search(r"^multicard (train .*)$", joined, re.M)[1].split()
    args = parse(one_node)
    assert args.nproc_per_node == 8 and Path(args.config) == Path(f"configs/{name}.yaml")
    load_config(str(ROOT / args.config), args.overrides)
    # examples/slurm/train.sbatch runs `multicard train --config configs/demo.yaml out_dir=... "$@"`
    slurm = re.search(r"^sbatch (.*)$", joined, re.M)[1].split()
    script_args = slurm[slurm.index("examples/slurm/train.sbatch") + 1 :]
    args = parse(["train", "--config", "configs/demo.yaml", "out_dir=runs/x", *script_args])
    assert Path(args.config) == Path(f"configs/{name}.yaml")  # the later --config wins
    assert load_config(str(ROOT / args.config), args.overrides).data.root == "/data/imagenet"


def linked_imagenet(tmp_path_factory, count: int) -> Path:
    """train/ and val/ of `count` class folders, each a link to the photo's folder."""
    if not PHOTOS.is_dir():
        pytest.skip(f"ImageNet sample photos not found at {PHOTOS}")
    root = tmp_path_factory.mktemp("imagenet")
    classes = sorted(p.name for p in PHOTOS.iterdir() if p.is_dir())[:count]
    for split in ("train", "val"):
        (root / split).mkdir()
        for name in classes:
            (root / split / name).symlink_to(PHOTOS / name, target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def small_imagenet(tmp_path_factory) -> Path:
    return linked_imagenet(tmp_path_factory, SMOKE_CLASSES)


@pytest.fixture(scope="module")
def modern_imagenet(tmp_path_factory) -> Path:
    return linked_imagenet(tmp_path_factory, MODERN_CLASSES)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_trains_8_steps_under_ddp2_on_cpu(small_imagenet, tmp_path, name):
    """The recipe as it is (model, 224 px, bf16, channels_last, schedule), with a batch of 2."""
    steps, batch = 8, 2
    small = ["devices=cpu", f"data.root={small_imagenet}", f"train.global_batch_size={batch}",
             f"train.max_steps={steps}", "data.eval_batch_size=8", "log_every=5", f"out_dir={tmp_path}"]  # fmt: skip
    assert "world_size=2" in run_here("train", "--config", str(recipe(name)), "--nproc-per-node", "2", *small)
    state = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert state["step"] == steps and state["config"]["model"]["name"] == RECIPES[name]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    epoch = next(r for r in records if r["kind"] == "epoch")
    assert epoch["val_samples"] == SMOKE_CLASSES and np.isfinite(epoch["train_loss"])
    # the recipe's schedule reached the optimizer: the linearly scaled lr, 9 steps into its warm-up
    cfg = load_config(str(recipe(name)), small)
    warmup_steps = cfg.sched.warmup_epochs * SMOKE_CLASSES / batch
    last = [r for r in records if r["kind"] == "step"][-1]
    assert last["step"] == steps
    assert last["lr"] == pytest.approx(scaled_lr(cfg.optim, batch) * (steps + 1) / warmup_steps)


# ------------------------------------------------------------------ GPU decoding: choice and errors


@pytest.mark.slow
def test_decode_gpu_without_cuda_is_one_line_exit_2(tmp_path):
    result = cli("train", "data.decode=gpu", "devices=cpu", "data.train_size=64", f"out_dir={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "data.decode=cpu" in result.stderr and "data.decode=auto" in result.stderr


def test_auto_decodes_on_the_gpu_only_where_it_applies():
    files = Files(Path("."), ["a.jpg"], torch.zeros(1, dtype=torch.long))
    folder = Splits(files, files, ["a"])
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # a device object: no GPU needed
    assert choose_decode("auto", "workers", folder, 224, cpu) == "cpu"
    assert choose_decode("auto", "workers", folder, 224, cuda) == "gpu"
    assert choose_decode("auto", "workers", folder, 64, cuda) == "cpu"  # small images: decoded once or tiny
    assert choose_decode("auto", "device", folder, 32, cuda) == "cpu"
    in_memory = InMemory(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), torch.zeros(1, dtype=torch.long))
    assert choose_decode("auto", "workers", Splits(in_memory, in_memory, ["a"]), 224, cuda) == "cpu"
    assert choose_decode("cpu", "workers", folder, 224, cuda) == "cpu"
    assert choose_decode("gpu", "workers", folder, 224, cuda) == "gpu"
    with pytest.raises(UserError, match="data.decode=gpu decodes image files of more than 64 px"):
        choose_decode("gpu", "device", folder, 32, cuda)
    with pytest.raises(UserError, match="uses none; use data.decode=cpu"):
        choose_decode("gpu", "workers", folder, 224, cpu)


# ------------------------------------------------------------------ GPU decoding: the arithmetic, on CPU


def planned_batch(paths: list[Path], transform, epoch: int, decode=nvjpeg, device="cpu") -> torch.Tensor:
    """What data.decode=gpu makes of `paths` (dataset indices 0..n-1) on `device`: uint8 values as
    floats. On the CPU the `nvjpeg` wrapper decodes with torchvision's CPU decoder."""
    plan = JpegTransform(transform)
    items = [(plan(read_image(path), epoch, i), torch.tensor(0), i) for i, path in enumerate(paths)]
    batch, _, _ = collate_encoded(items)
    return GpuDecode([0, 0, 0], [1, 1, 1], torch.device(device), 0, transform.size, decode).assemble(batch)


def cpu_batch(paths: list[Path], transform, epoch: int) -> torch.Tensor:
    return torch.stack([transform(read_image(path), epoch, i) for i, path in enumerate(paths)]).float()


def image_errors(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return [mad(to_hwc(x), to_hwc(y)) for x, y in zip(a, b, strict=True)]


@needs_photos
def test_gpu_path_crops_like_the_cpu_path_on_real_photos():
    """The same boxes and flips from (seed, epoch, index), resampled alike: close pixels, as the CPU
    path is to torchvision's own pipeline (tests/test_large_images.py)."""
    paths = sorted(PHOTOS.glob("*/*.JPEG"))[::25]  # 20 photos across the classes
    train = RandomResizedCropFlip(224, (0.08, 1.0), flip=True, seed=0)
    for transform, epoch in ((train, 0), (train, 1), (FitSquare(224, 256), 0)):
        ours = planned_batch(paths, transform, epoch)
        errors = image_errors(ours, cpu_batch(paths, transform, epoch))
        assert np.mean(errors) < 1.0 and max(errors) < 5.0, (epoch, errors)
    flips = sum(crop_uniforms(0, 0, i)[-1] < 0.5 for i in range(len(paths)))
    assert 0 < flips < len(paths)  # both kinds were compared
    # the check tells crops apart: another epoch's crops are far off
    assert np.mean(image_errors(planned_batch(paths, train, 1), cpu_batch(paths, train, 0))) > 10


def save_image(folder: Path, name: str, image: Image.Image, **options) -> Path:
    path = folder / name
    image.save(path, **options)
    return path


def test_other_files_are_decoded_by_the_workers_as_on_the_cpu(tmp_path):
    """PNG and CMYK JPEG stay on the CPU path (exact pixels); RGB and greyscale JPEGs go to nvjpeg."""
    pixels = photo_like(400, 300)
    paths = [
        save_image(tmp_path, "rgb.jpg", Image.fromarray(pixels), quality=90),
        save_image(tmp_path, "rgb.png", Image.fromarray(pixels)),
        save_image(tmp_path, "cmyk.jpg", Image.fromarray(pixels).convert("CMYK"), quality=95),
        save_image(tmp_path, "grey.jpg", Image.fromarray(pixels).convert("L"), quality=95),
    ]
    transform = RandomResizedCropFlip(96, (0.08, 1.0), flip=True, seed=3)
    planned = [JpegTransform(transform)(read_image(path), 0, i) for i, path in enumerate(paths)]
    assert [isinstance(p, JpegFile) for p in planned] == [True, False, False, True]
    ours, theirs = planned_batch(paths, transform, 0), cpu_batch(paths, transform, 0)
    assert torch.equal(ours[1], theirs[1]) and torch.equal(ours[2], theirs[2])
    assert max(image_errors(ours, theirs)) < 3.0
    assert torch.equal(ours[3][0], ours[3][1])  # greyscale decoded to three equal channels


def test_a_batch_nvjpeg_refuses_is_decoded_on_the_cpu(tmp_path):
    paths = [save_image(tmp_path, f"{i}.jpg", Image.fromarray(photo_like(300, 200, seed=i)), quality=90)
             for i in range(3)]  # fmt: skip
    transform = FitSquare(128, 146)

    def refuses(jpegs, device):
        raise RuntimeError("Error while decoding JPEG images: unsupported\nsecond line")

    with pytest.warns(UserWarning, match=r"nvjpeg could not decode a batch \(Error while decoding JPEG images"):
        fallen_back = planned_batch(paths, transform, 0, decode=refuses)
    assert max(image_errors(fallen_back, planned_batch(paths, transform, 0))) < 1.0
    data = io.BytesIO()
    Image.fromarray(photo_like(300, 200)).save(data, "JPEG", quality=90)
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(data.getvalue()[: len(data.getvalue()) // 2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(UserError, match=re.escape(f"cannot decode image {truncated} (")) as info:
            planned_batch([*paths, truncated], transform, 0, decode=refuses)  # and Pillow cannot either
    assert "\n" not in str(info.value)


def test_only_torchvisions_deprecation_warning_is_silenced(tmp_path):
    path = save_image(tmp_path, "a.jpg", Image.fromarray(photo_like(64, 48)), quality=90)
    jpeg = read_image(path)
    data = torch.frombuffer(bytearray(jpeg.data), dtype=torch.uint8)
    import torchvision
    from torchvision.io import decode_jpeg

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decode_jpeg(data)  # torchvision warns on its own (from 0.29; earlier releases say nothing)
        if tuple(int(v) for v in torchvision.__version__.split(".")[:2]) >= (0, 29):
            assert any(TORCHVISION_DEPRECATION in str(w.message) for w in caught)
        caught.clear()
        (image,) = nvjpeg([data], torch.device("cpu"))
        warnings.warn("another warning still shows", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["another warning still shows"]
    assert image.shape == (3, 48, 64) and image.dtype == torch.uint8


def epoch_batches(root: Path, on_gpu_path: bool, monkeypatch) -> tuple[list, list]:
    """Training batches of epoch 1 and the validation batches, through build_data with worker
    processes; `on_gpu_path` builds the data.decode=gpu pipeline on the CPU device."""
    cfg = load_config(None, [
        "data.name=imagefolder", f"data.root={root}", "data.image_size=80", "data.val_fraction=0.25",
        "data.num_workers=1", "data.mean=[0,0,0]", "data.std=[1,1,1]", "data.decode=cpu",
    ])  # fmt: skip
    with monkeypatch.context() as patch:
        if on_gpu_path:  # what choose_decode answers on a CUDA device
            patch.setattr(data_module, "choose_decode", lambda *args: "gpu")
        ctx = ProcessContext(0, 0, 1, 1, torch.device("cpu"), distributed=False)
        data = build_data(cfg.data, cfg.seed, BatchSplit(8, 1, 1), ctx)
    assert isinstance(data.train.finish, GpuDecode) == on_gpu_path
    try:
        data.train.set_epoch(1)
        return [(x * 255, y) for x, y in data.train], [(x * 255, y) for x, y in data.val]
    finally:
        data.close()


def test_gpu_decoding_pipeline_through_loader_workers(tmp_path, monkeypatch):
    """build_data's data.decode=gpu wiring: worker processes plan and collate, the device decodes."""
    for i in range(20):
        folder = tmp_path / "d" / "train" / "ab"[i % 2]
        folder.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray(photo_like(160 + 8 * i, 120, seed=i))
        image.save(folder / (f"{i}.png" if i % 5 == 0 else f"{i}.jpg"), **({} if i % 5 == 0 else {"quality": 90}))
    gpu_train, gpu_val = epoch_batches(tmp_path / "d", True, monkeypatch)
    cpu_train, cpu_val = epoch_batches(tmp_path / "d", False, monkeypatch)
    for ours, theirs in ((gpu_train, cpu_train), (gpu_val, cpu_val)):
        assert len(ours) == len(theirs) > 0
        for (x, y), (x_cpu, y_cpu) in zip(ours, theirs, strict=True):
            assert torch.equal(y, y_cpu) and x.shape == x_cpu.shape
            errors = image_errors(x.round(), x_cpu.round())
            assert np.mean(errors) < 1.0 and max(errors) < 5.0


# ------------------------------------------------------------------ GPU decoding on CUDA


@pytest.mark.cuda
@needs_photos
def test_cuda_nvjpeg_crops_like_the_cpu_path():
    paths = sorted(PHOTOS.glob("*/*.JPEG"))[::25]
    for transform, epoch in ((RandomResizedCropFlip(224, (0.08, 1.0), flip=True, seed=0), 0), (FitSquare(224, 256), 0)):
        ours = planned_batch(paths, transform, epoch, device="cuda").cpu()
        errors = image_errors(ours, cpu_batch(paths, transform, epoch))
        assert np.mean(errors) < 1.5 and max(errors) < 6.0, errors  # nvjpeg's IDCT differs a little from libjpeg's


@pytest.mark.cuda
@pytest.mark.slow
@needs_photos
def test_cuda_training_with_gpu_decoding(small_imagenet, tmp_path):
    result = cli("train", "--config", str(recipe("imagenet_resnet18")), "devices=[0]", "data.decode=gpu",
                 f"data.root={small_imagenet}", "train.global_batch_size=8", "train.max_steps=5",
                 "data.eval_batch_size=16", f"out_dir={tmp_path}")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["step"] == 5


MODERN = {"imagenet_resnet50_v2": "acc@1 80.858", "imagenet_resnet50_fast": "74.6%"}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", MODERN)
def test_modern_recipe_trains_4_steps_under_ddp2_on_cpu(modern_imagenet, tmp_path, name):
    """torchvision's V2 recipe (mixing, TrivialAugment, erasing, repeats, EMA, per-epoch warm-up) and
    ffcv's fast one (progressive resizing, linear schedule, evaluation at 256 px with a flip), as they
    are but for a batch of 4 and 4 steps on 40 photos (V2: a batch of 8, its 4 repeated copies of 2
    samples: with 1 sample, mixup would mix each copy with itself, which is refused)."""
    assert MODERN[name] in recipe(name).read_text()  # the published figure it cites
    steps, batch = 4, 8 if name == "imagenet_resnet50_v2" else 4
    small = ["devices=cpu", f"data.root={modern_imagenet}", f"train.global_batch_size={batch}", "ema.every=2",
             f"train.max_steps={steps}", "data.eval_batch_size=8", "log_every=2", f"out_dir={tmp_path}"]  # fmt: skip
    run_here("train", "--config", str(recipe(name)), "--nproc-per-node", "2", *small)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    epoch = next(r for r in records if r["kind"] == "epoch")
    assert epoch["val_samples"] == MODERN_CLASSES and np.isfinite(epoch["train_loss"])
    cfg = load_config(str(recipe(name)), small)
    lr = [r for r in records if r["kind"] == "step"][-1]["lr"]
    if cfg.ema.decay:  # V2: the EMA validated beside the model; the warm-up's first lr held for the epoch
        assert np.isfinite(epoch["ema_val_top1"])
        assert lr == pytest.approx(cfg.optim.lr * cfg.sched.warmup_start)
    else:  # fast: the lr rises every step from 1e-4 × its peak over 2 epochs of 10 steps
        assert lr == pytest.approx(cfg.optim.lr * (1e-4 + (1 - 1e-4) * (steps + 1) / 20))
