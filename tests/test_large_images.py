"""The large-image pipeline: crop distribution, determinism, geometry and pixels against torchvision;
images of every mode (16-bit greyscale scaled, not clipped), and very large ones decoded without
Pillow's decompression-bomb warning."""

from __future__ import annotations

import functools
import io
import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from multicard.base.config import load_config
from multicard.base.errors import UserError
from multicard.data import build_data
from multicard.data.augmentation.transforms import FitSquare, RandomResizedCropFlip, reduction
from multicard.data.decoding import jpeg
from multicard.data.decoding.crops import DRAWS, RATIO, centre_region, crop_uniforms, random_resized_box
from multicard.data.decoding.decode import read_image
from multicard.data.loading.sampling import BatchSplit
from multicard.data.sources.encoded import to_rgb
from multicard.data.sources.user import to_picture
from multicard.runtime.process_group import ProcessContext

PHOTOS = Path(__file__).resolve().parents[2] / "shared" / "data" / "imagenet-sample"
N = 10_000
KS_ALPHA_COEF = math.sqrt(-math.log(0.001 / 2) / 2)  # two-sample KS at significance 0.001


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Largest gap between the two empirical CDFs."""
    a, b = np.sort(a), np.sort(b)
    points = np.concatenate([a, b])
    gaps = np.searchsorted(a, points, "right") / a.size - np.searchsorted(b, points, "right") / b.size
    return float(np.abs(gaps).max())


def ks_critical(n: int, m: int) -> float:
    return KS_ALPHA_COEF * math.sqrt((n + m) / (n * m))


def to_hwc(chw: torch.Tensor) -> np.ndarray:
    return chw.permute(1, 2, 0).numpy().astype(np.int32)


def mad(a: np.ndarray, b: np.ndarray) -> float:
    """Mean absolute difference in uint8 levels."""
    return float(np.abs(a.astype(np.int32) - b.astype(np.int32)).mean())


def photo_like(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A smooth scene with edges and mild texture: what a JPEG of a photo holds, without a photo."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    channels = [
        128 + 60 * np.sin(2 * np.pi * (f1 * x + f2 * y) + phase)
        for f1, f2, phase in rng.uniform([1, 1, 0], [6, 6, 6], size=(3, 3))
    ]
    pixels = np.stack(channels, axis=-1)
    for _ in range(6):  # a few flat objects with sharp edges
        x0, y0 = rng.integers(0, width - 20), rng.integers(0, height - 20)
        pixels[y0 : y0 + rng.integers(10, height // 3), x0 : x0 + rng.integers(10, width // 3)] = rng.uniform(0, 255, 3)
    pixels += rng.normal(0, 4, pixels.shape)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def save(tmp_path: Path, name: str, image: Image.Image, **options) -> Path:
    path = tmp_path / name
    image.save(path, **options)
    return path


def reference_crop(path: Path, corners: tuple[int, int, int, int], size: int) -> np.ndarray:
    """What torchvision's PIL pipeline makes of the same crop: full decode, then Pillow's resize."""
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR, box=corners))


def reference_eval(path: Path, resize: int, size: int) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(T.Compose([T.Resize(resize), T.CenterCrop(size)])(image.convert("RGB")))


# ------------------------------------------------------------------ crop distribution


@functools.cache
def sample_uniforms() -> np.ndarray:
    """The random numbers of samples 0..N-1 (seed 0, epoch 0), as the training transform draws them."""
    return np.stack([crop_uniforms(0, 0, i) for i in range(N)])


def ours(width: int, height: int, scale=(0.08, 1.0), warp=None) -> tuple[np.ndarray, np.ndarray]:
    """(area fraction, aspect ratio) of N crops; `warp` rewrites the uniforms (to break the recipe)."""
    boxes = []
    for uniforms in sample_uniforms():
        boxes.append(random_resized_box(width, height, scale, warp(uniforms) if warp else uniforms))
    w = np.array([b.width for b in boxes], dtype=float)
    h = np.array([b.height for b in boxes], dtype=float)
    return w * h / (width * height), w / h


@functools.cache
def torchvision_draws(width: int, height: int, scale=(0.08, 1.0)) -> tuple[np.ndarray, np.ndarray]:
    torch.manual_seed(0)
    image = torch.empty(1, height, width)
    params = np.array([T.RandomResizedCrop.get_params(image, list(scale), list(RATIO)) for _ in range(N)], dtype=float)
    h, w = params[:, 2], params[:, 3]
    return w * h / (width * height), w / h


@pytest.mark.parametrize("width, height", [(500, 375), (1000, 200)])  # ImageNet's median; many fallbacks
def test_crop_scale_and_aspect_ratio_match_torchvision(width, height):
    area, aspect = ours(width, height)
    ref_area, ref_aspect = torchvision_draws(width, height)
    limit = ks_critical(N, N)
    assert ks_statistic(area, ref_area) < limit
    assert ks_statistic(aspect, ref_aspect) < limit


def uniform_aspect(u: np.ndarray) -> np.ndarray:
    """Aspect ratio uniform in RATIO instead of log-uniform: the usual mistake."""
    u = u.copy()
    lo, hi = RATIO
    u[1::4][:10] = (np.log(lo + (hi - lo) * u[1::4][:10]) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return u


def uniform_side(u: np.ndarray) -> np.ndarray:
    """Side (square root of the area) uniform instead of the area: another usual mistake."""
    u = u.copy()
    lo, hi = 0.08, 1.0
    side = math.sqrt(lo) + (1 - math.sqrt(lo)) * u[0::4][:10]
    u[0::4][:10] = (side**2 - lo) / (hi - lo)
    return u


@pytest.mark.parametrize("warp, which", [(uniform_aspect, 1), (uniform_side, 0)])
def test_the_histogram_check_rejects_a_wrong_distribution(warp, which):
    ref = torchvision_draws(500, 375)[which]
    assert ks_statistic(ours(500, 375, warp=warp)[which], ref) > ks_critical(N, N)


def test_fallback_is_torchvision_centre_crop():
    # No attempt can fit 90% of a 1000 × 10 strip at aspect ratio ≤ 4/3: both take the centre.
    box = random_resized_box(1000, 10, (0.9, 1.0), crop_uniforms(3, 1, 4))
    i, j, h, w = T.RandomResizedCrop.get_params(torch.empty(1, 10, 1000), [0.9, 1.0], list(RATIO))
    assert (box.top, box.left, box.height, box.width) == (i, j, h, w) == (0, 493, 10, 13)


# ------------------------------------------------------------------ determinism


def test_crop_and_flip_are_a_function_of_seed_epoch_and_index(tmp_path):
    path = save(tmp_path, "a.png", Image.fromarray(photo_like(320, 240)))
    transform = RandomResizedCropFlip(96, (0.08, 1.0), flip=True, seed=5)
    keys = [(epoch, index) for epoch in range(3) for index in range(8)]
    forward = {k: transform(read_image(path), *k) for k in keys}
    again = RandomResizedCropFlip(96, (0.08, 1.0), flip=True, seed=5)  # another instance, reverse order
    assert all(torch.equal(again(read_image(path), *k), forward[k]) for k in reversed(keys))
    assert len({forward[k].numpy().tobytes() for k in keys}) == len(keys)  # every key its own crop
    other_seed = RandomResizedCropFlip(96, (0.08, 1.0), flip=True, seed=6)
    assert not torch.equal(other_seed(read_image(path), 0, 0), forward[(0, 0)])
    assert np.array_equal(crop_uniforms(5, 2, 7), crop_uniforms(5, 2, 7)) and crop_uniforms(5, 2, 7).size == DRAWS


def loader_epoch(root: Path, world: int, workers: int, seed: int = 0) -> torch.Tensor:
    """One training epoch of the workers loader, all ranks' micro-batches in global order."""
    cfg = load_config(
        None,
        [
            "data.name=imagefolder", f"data.root={root}", "data.loader=workers", "data.image_size=80",
            "data.val_fraction=0.2", f"data.num_workers={workers}", f"seed={seed}",
        ],
    )  # fmt: skip
    per_rank = []
    for rank in range(world):
        ctx = ProcessContext(rank, 0, world, 1, torch.device("cpu"), distributed=False)
        data = build_data(cfg.data, cfg.seed, BatchSplit(8, 1, world), ctx)
        data.train.set_epoch(1)
        per_rank.append([x for x, _ in data.train])
        data.close()
    return torch.cat([torch.cat(step) for step in zip(*per_rank, strict=True)])


def test_loader_batches_do_not_depend_on_world_size_or_workers(tmp_path):
    for i in range(20):
        folder = tmp_path / "d" / "train" / ("ab"[i % 2])
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(photo_like(120, 90, seed=i)).save(folder / f"{i}.jpg", quality=90)
    single = loader_epoch(tmp_path / "d", world=1, workers=0)
    assert single.shape == (16, 3, 80, 80)
    assert torch.equal(single, loader_epoch(tmp_path / "d", world=2, workers=1))
    assert not torch.equal(single, loader_epoch(tmp_path / "d", world=1, workers=0, seed=1))


def test_flip_mirrors_about_half_of_the_samples():
    image = torch.from_numpy(photo_like(200, 150)).permute(2, 0, 1)
    plain = RandomResizedCropFlip(64, (0.08, 1.0), flip=False, seed=1)
    flipping = RandomResizedCropFlip(64, (0.08, 1.0), flip=True, seed=1)
    flipped = 0
    for index in range(200):
        a, b = plain(image, 0, index), flipping(image, 0, index)
        assert torch.equal(a, b) or torch.equal(a.flip(-1), b)
        flipped += not torch.equal(a, b)
    assert 70 <= flipped <= 130  # Binomial(200, 1/2): 5 standard deviations either side


def test_files_and_tensors_of_the_same_pixels_give_the_same_crops(tmp_path):
    pixels = photo_like(300, 200)
    path = save(tmp_path, "a.png", Image.fromarray(pixels))
    tensor = torch.from_numpy(pixels).permute(2, 0, 1).contiguous()
    train = RandomResizedCropFlip(128, (0.08, 1.0), flip=True, seed=0)
    evaluate = FitSquare(128, 146)
    for index in range(5):
        assert mad(to_hwc(train(read_image(path), 0, index)), to_hwc(train(tensor, 0, index))) < 0.5
    assert mad(to_hwc(evaluate(read_image(path), 0, 0)), to_hwc(evaluate(tensor, 0, 0))) < 0.5


# ------------------------------------------------------------------ geometry and pixels


@pytest.mark.parametrize("width, height, resize, size", [(300, 200, 256, 224), (201, 333, 256, 224), (120, 90, 80, 96)])
def test_eval_is_resize_then_centre_crop(tmp_path, width, height, resize, size):
    # Noise: any misplaced sampling point shows as a large difference.
    noise = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    path = save(tmp_path, "noise.png", Image.fromarray(noise))
    out = FitSquare(size, resize)(read_image(path), 0, 0)
    assert out.shape == (3, size, size) and out.dtype == torch.uint8
    assert mad(to_hwc(out), reference_eval(path, resize, size)) < 1.0  # rounding differences only


def test_centre_region_is_what_resize_and_centre_crop_keep(tmp_path):
    noise = np.random.default_rng(1).integers(0, 256, (375, 500, 3), dtype=np.uint8)
    image = Image.fromarray(noise)
    path = save(tmp_path, "noise.png", image)
    region = centre_region(500, 375, 256, 224)
    direct = np.asarray(image.resize((224, 224), Image.Resampling.BILINEAR, box=region))
    assert mad(direct, reference_eval(path, 256, 224)) < 0.5


def test_reduced_jpeg_decoding_keeps_size_and_coordinates(tmp_path):
    path = save(tmp_path, "big.jpg", Image.fromarray(photo_like(1001, 750)), quality=92)
    full, r1 = read_image(path).decode(1)
    assert full.shape == (750, 1001, 3) and r1 == 1
    for reduce in (2, 4, 8):
        pixels, r = read_image(path).decode(reduce)
        assert r == reduce and pixels.shape == (math.ceil(750 / r), math.ceil(1001 / r), 3)
        # The reduced image is the full one averaged over r × r blocks, up to JPEG's own filtering.
        blocks = full[: 750 // r * r, : 1001 // r * r].float().reshape(750 // r, r, 1001 // r, r, 3).mean((1, 3))
        assert (pixels[: 750 // r, : 1001 // r].float() - blocks).abs().mean() < 3
    png = save(tmp_path, "big.png", Image.fromarray(photo_like(400, 300)))
    assert read_image(png).decode(4)[1] == 1  # only JPEG reduces


@pytest.mark.parametrize("scale, reduced", [((0.05, 0.1), False), ((0.8, 1.0), True)])
def test_training_crops_are_close_to_the_reference_resample(tmp_path, scale, reduced):
    path = save(tmp_path, "big.jpg", Image.fromarray(photo_like(1600, 1200)), quality=90)
    transform = RandomResizedCropFlip(224, scale, flip=False, seed=0)
    errors = []
    for index in range(6):
        box = random_resized_box(1600, 1200, scale, crop_uniforms(0, 0, index))
        assert (reduction(read_image(path), min(box.width, box.height) / 224) > 1) == reduced
        out = transform(read_image(path), 0, index)
        errors.append(mad(to_hwc(out), reference_crop(path, box.corners, 224)))
    # At full scale only rounding differs; at reduced scale the DCT's downscaling filter too.
    assert max(errors) < (3.0 if reduced else 0.5)


def test_eval_of_a_large_jpeg_is_close_to_the_reference(tmp_path):
    path = save(tmp_path, "big.jpg", Image.fromarray(photo_like(1400, 1050)), quality=90)
    assert reduction(read_image(path), 1050 / 256) == 4
    assert mad(to_hwc(FitSquare(224, 256)(read_image(path), 0, 0)), reference_eval(path, 256, 224)) < 3.0


def cmyk(pixels: np.ndarray) -> Image.Image:
    return Image.fromarray(pixels).convert("CMYK")


@pytest.mark.parametrize(
    "name, make, options",
    [
        ("rgb.png", lambda p: Image.fromarray(p), {}),
        ("gray.jpg", lambda p: Image.fromarray(p).convert("L"), {"quality": 95}),
        ("gray.png", lambda p: Image.fromarray(p).convert("L"), {}),
        ("cmyk.jpg", cmyk, {"quality": 95}),
        ("rgba.png", lambda p: Image.fromarray(p).convert("RGBA"), {}),
        ("palette.png", lambda p: Image.fromarray(p).convert("P"), {}),
        ("progressive.jpg", lambda p: Image.fromarray(p), {"quality": 95, "progressive": True}),
        ("tiny.png", lambda p: Image.fromarray(p[:3, :5]), {}),
        ("tiny.jpg", lambda p: Image.fromarray(p[:7, :9]), {"quality": 95}),
    ],
)
def test_formats_modes_and_tiny_images(tmp_path, name, make, options):
    path = save(tmp_path, name, make(photo_like(640, 480)), **options)
    width, height = read_image(path).size
    train = RandomResizedCropFlip(224, (0.08, 1.0), flip=False, seed=0)
    for index in range(3):
        out = train(read_image(path), 0, index)
        assert out.shape == (3, 224, 224) and out.dtype == torch.uint8
        box = random_resized_box(width, height, (0.08, 1.0), crop_uniforms(0, 0, index))
        assert mad(to_hwc(out), reference_crop(path, box.corners, 224)) < 3.0
        if "gray" in name:
            assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])
    out = FitSquare(224, 256)(read_image(path), 0, 0)
    assert out.shape == (3, 224, 224) and mad(to_hwc(out), reference_eval(path, 256, 224)) < 3.0


def test_sixteen_bit_greyscale_is_scaled_not_clipped(tmp_path):
    noise = np.random.default_rng(0).integers(0, 65536, (48, 64)).astype(np.uint16)
    expected = noise / 257  # the same picture in 8 bits
    path = tmp_path / "grey16.png"
    Image.fromarray(noise).save(path)
    assert Image.open(path).mode == "I;16"
    full = read_image(path).tensor()  # the device loader's decoding
    assert full.shape == (3, 48, 64) and torch.equal(full[0], full[2])
    assert np.abs(full[0].numpy() - expected).max() <= 0.5 + 1e-9  # rounded, not clipped to white
    for transform in (FitSquare(32, 40), RandomResizedCropFlip(32, (0.5, 1.0), flip=True, seed=0)):  # workers loader
        assert abs(transform(read_image(path), 0, 0).float().mean().item() - expected.mean()) < 4
    big_endian = Image.frombytes("I;16B", (64, 48), noise.astype(">u2").tobytes())
    little_endian = Image.frombytes("I;16L", (64, 48), noise.astype("<u2").tobytes())
    thirty_two_bit = Image.fromarray(noise.astype(np.int32))  # mode I: how older Pillow opens 16-bit PNGs
    for image in (big_endian, little_endian, thirty_two_bit):
        assert np.array_equal(np.asarray(to_rgb(image))[..., 0], full[0].numpy()), image.mode
    assert torch.equal(to_picture(big_endian, "item 0"), full)  # a dataset function's PIL image


def test_fast_decoder_and_pillow_give_the_same_pixels(tmp_path, monkeypatch):
    if not jpeg.AVAILABLE:
        pytest.skip("simplejpeg (the optional `jpeg` extra) is not installed")
    path = save(tmp_path, "a.jpg", Image.fromarray(photo_like(1200, 900)), quality=90)
    train, evaluate = RandomResizedCropFlip(224, (0.08, 1.0), flip=True, seed=0), FitSquare(224, 256)
    fast = [train(read_image(path), 0, i) for i in range(8)] + [evaluate(read_image(path), 0, 0)]
    monkeypatch.setattr(jpeg, "simplejpeg", None)
    slow = [train(read_image(path), 0, i) for i in range(8)] + [evaluate(read_image(path), 0, 0)]
    assert all(mad(to_hwc(a), to_hwc(b)) < 0.5 for a, b in zip(fast, slow, strict=True))


# ------------------------------------------------------------------ bad files


def test_unreadable_files_are_one_line_errors_naming_them(tmp_path):
    text = tmp_path / "notes.jpg"
    text.write_text("not an image")
    with pytest.raises(UserError, match=re.escape(f"cannot decode image {text} (") + ".*replace the file") as info:
        read_image(text)
    assert "\n" not in str(info.value)
    data = io.BytesIO()
    Image.fromarray(photo_like(640, 480)).save(data, "JPEG", quality=90)
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(data.getvalue()[: len(data.getvalue()) // 2])
    for transform in (RandomResizedCropFlip(224, (0.08, 1.0), flip=True, seed=0), FitSquare(224, 256)):
        with pytest.raises(UserError, match=re.escape(f"cannot decode image {truncated} (")) as info:
            transform(read_image(truncated), 0, 0)
        assert "\n" not in str(info.value)


def test_a_very_large_image_decodes_without_pillows_bomb_warning(tmp_path, monkeypatch):
    # Pillow warns above MAX_IMAGE_PIXELS (89 M by default: a 12000×9000 photo) and refuses above
    # twice that; a small limit makes small images stand for those.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1500)
    photo = np.random.default_rng(0).integers(0, 256, (30, 40, 3)).astype(np.uint8)  # 1200 px
    large, huge = tmp_path / "large.jpg", tmp_path / "huge.jpg"
    Image.fromarray(np.tile(photo, (1, 2, 1))).save(large, quality=90)  # 2400 px: warned of
    Image.fromarray(np.tile(photo, (2, 2, 1))).save(huge, quality=90)  # 4800 px: refused
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        for transform in (FitSquare(16, 20), RandomResizedCropFlip(16, (0.5, 1.0), flip=True, seed=0)):
            assert transform(read_image(large), 0, 0).shape == (3, 16, 16)
        assert read_image(large).tensor().shape == (3, 30, 80)
        with pytest.raises(UserError, match=r"cannot decode image .*huge.jpg \(Image size \(4800 pixels\) exceeds"):
            read_image(huge)
    data = io.BytesIO()
    Image.fromarray(np.tile(photo, (1, 2, 1))).save(data, "PNG")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert to_picture(data.getvalue(), "item 3").tensor().shape == (3, 30, 80)  # a dataset function's bytes


# ------------------------------------------------------------------ real photos


@pytest.mark.skipif(not PHOTOS.is_dir(), reason=f"ImageNet sample photos not found at {PHOTOS}")
def test_real_photos_are_close_to_torchvision():
    paths = sorted(PHOTOS.glob("*/*.JPEG"))[::10]  # 50 of the 500, spread over the classes
    train = RandomResizedCropFlip(224, (0.08, 1.0), flip=False, seed=0)
    evaluate = FitSquare(224, 256)
    train_errors, eval_errors = [], []
    for index, path in enumerate(paths):
        image = read_image(path)
        box = random_resized_box(*image.size, (0.08, 1.0), crop_uniforms(0, 0, index))
        train_errors.append(mad(to_hwc(train(image, 0, index)), reference_crop(path, box.corners, 224)))
        eval_errors.append(mad(to_hwc(evaluate(image, 0, index)), reference_eval(path, 256, 224)))
    assert np.mean(train_errors) < 1.0 and max(train_errors) < 5.0
    assert np.mean(eval_errors) < 1.0 and max(eval_errors) < 5.0
