"""Real datasets and both loaders: readers, layouts, cache, sharding and determinism."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import image_folder, one_line
from multicard.base.config import load_config
from multicard.base.errors import UserError
from multicard.data import build_data as build_loaders
from multicard.data import loader_processes
from multicard.data import read_splits as read_sources
from multicard.data.decoding import decode
from multicard.data.loading.sampling import BatchSplit
from multicard.runtime.process_group import ProcessContext, cpu_cores

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10"
CPU = torch.device("cpu")
# With mean 0 and std 1/255, a normalised pixel equals its uint8 value: images can carry their id.
IDENTITY_NORM = ["data.mean=[0,0,0]", f"data.std=[{1 / 255},{1 / 255},{1 / 255}]"]


def write_coded_folder(root: Path, n: int, classes=("cat", "ant", "bee"), size: int = 8) -> None:
    """n PNG images whose red/green channels encode their number; class = number % len(classes)."""
    for i in range(n):
        folder = root / classes[i % len(classes)]
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.zeros((size, size, 3), dtype=np.uint8)
        pixels[..., 0], pixels[..., 1], pixels[..., 2] = i % 256, i // 256, 7
        Image.fromarray(pixels).save(folder / f"{i:04d}.png")


def decode_ids(x: torch.Tensor) -> torch.Tensor:
    """Recover the image numbers from a batch built with IDENTITY_NORM (centre pixel)."""
    centre = x[:, :, x.shape[2] // 2, x.shape[3] // 2].round().long()
    return centre[:, 0] + 256 * centre[:, 1]


def config(*overrides: str):
    return load_config(None, list(overrides))


BUILT = []  # the loaders a test built: their loader processes end with the test


@pytest.fixture(autouse=True)
def close_built_loaders():
    yield
    while BUILT:
        BUILT.pop().close()


def build_data(cfg, plan, rank, world, device):
    """This rank's loaders, as a process of a `world`-process job would build them."""
    data = build_loaders(cfg.data, cfg.seed, plan, ProcessContext(rank, 0, world, 1, device, distributed=False))
    BUILT.append(data)
    return data


def read_splits(cfg):
    return read_sources(cfg.data, cfg.seed)


def folder_config(root: Path, *extra: str):
    return config(
        "data.name=imagefolder", f"data.root={root}", "data.image_size=8", "data.val_fraction=0.2",
        "data.num_workers=1", f"data.cache_dir={root.parent / 'cache'}", *extra,
    )  # fmt: skip


def epoch_ids(cfg, world: int, global_batch: int, epoch: int = 0) -> list[torch.Tensor]:
    """For each optimizer step, what all ranks read together (rank order), as image numbers."""
    per_rank = []
    for rank in range(world):
        data = build_data(cfg, BatchSplit(global_batch, 1, world), rank, world, CPU)
        data.train.set_epoch(epoch)
        per_rank.append([decode_ids(x) for x, _ in data.train])
    return [torch.cat(step) for step in zip(*per_rank, strict=True)]


# ------------------------------------------------------------------ CIFAR-10 reader


def write_cifar(root: Path, per_batch: int = 6) -> torch.Tensor:
    """A small dataset in the cifar-10-batches-py format; returns all training images."""
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True)
    rng = np.random.default_rng(0)
    train = []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=per_batch)]
        with (base / name).open("wb") as f:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, f)
        if name != "test_batch":
            train.append(torch.from_numpy(data.reshape(-1, 3, 32, 32)))
    names = [n.encode() for n in ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")]
    with (base / "batches.meta").open("wb") as f:
        pickle.dump({b"label_names": names}, f)
    return torch.cat(train)


def test_cifar10_reader_reads_the_pickled_batches(tmp_path):
    images = write_cifar(tmp_path)
    splits = read_splits(config("data.name=cifar10", f"data.root={tmp_path}"))
    assert torch.equal(splits.train.images, images)
    assert len(splits.train) == 30 and len(splits.val) == 6
    assert splits.classes[:2] == ["plane", "car"]


def test_cifar10_trains_through_the_device_loader(tmp_path):
    write_cifar(tmp_path)
    cfg = config("data.name=cifar10", f"data.root={tmp_path}", "data.loader=auto")
    data = build_data(cfg, BatchSplit(10, 1, 1), 0, 1, CPU)
    assert data.loader == "device" and data.num_classes == 10
    data.train.set_epoch(0)
    x, y = next(iter(data.train))
    assert x.shape == (10, 3, 32, 32) and x.dtype == torch.float32


def test_cifar10_missing_and_corrupt_files_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="data_batch_1 is missing; expected .*data_batch_1.*test_batch"):
        read_splits(config("data.name=cifar10", f"data.root={tmp_path}"))
    write_cifar(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(UserError, match="data_batch_3 is corrupt") as info:
        read_splits(config("data.name=cifar10", f"data.root={tmp_path}"))
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------ image folders


def test_image_folder_classes_and_seeded_split(tmp_path):
    write_coded_folder(tmp_path / "d" / "train", 50)
    cfg = folder_config(tmp_path / "d")
    a, b = read_splits(cfg), read_splits(cfg)
    assert a.classes == ["ant", "bee", "cat"]  # sorted folder names
    assert len(a.val) == 10 and len(a.train) == 40
    assert a.val.paths == b.val.paths  # fixed by data.split_seed, not by the run's seed
    assert read_splits(folder_config(tmp_path / "d", "seed=5")).val.paths == a.val.paths
    assert read_splits(folder_config(tmp_path / "d", "data.split_seed=1")).val.paths != a.val.paths
    assert not set(a.val.paths) & set(a.train.paths)


def test_val_directory_and_val_root(tmp_path):
    write_coded_folder(tmp_path / "d" / "train", 30)
    write_coded_folder(tmp_path / "d" / "val", 9)
    assert len(read_splits(folder_config(tmp_path / "d")).val) == 9
    write_coded_folder(tmp_path / "other", 12)
    splits = read_splits(folder_config(tmp_path / "d", f"data.val_root={tmp_path / 'other'}"))
    assert len(splits.val) == 12 and len(splits.train) == 30
    # Evaluation alone reads only val_root (the training folder may be absent there).
    alone = build_data(folder_config(tmp_path / "nowhere", f"data.val_root={tmp_path / 'other'}"), None, 0, 1, CPU)
    assert alone.num_classes == 3 and sum(len(y) for _, y in alone.val) == 12
    write_coded_folder(tmp_path / "wrong", 4, classes=("dog", "emu"))
    with pytest.raises(UserError, match="2 classes that differ from training's 3"):
        read_splits(folder_config(tmp_path / "d", f"data.val_root={tmp_path / 'wrong'}"))


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda root: root.mkdir(), "has no train/ directory; expected"),
        (lambda root: (root / "train").mkdir(parents=True), "expected .*train/<class>/<image files>"),
        (lambda root: (root / "train" / "a").mkdir(parents=True), "expected .*train/<class>/<image files>"),
    ],
)
def test_wrong_layouts_are_one_line_errors(tmp_path, make, fragment):
    make(tmp_path / "d")
    with pytest.raises(UserError, match=fragment) as info:
        read_splits(folder_config(tmp_path / "d"))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("loader", ["device", "workers"])
def test_corrupt_image_names_the_file(tmp_path, loader):
    write_coded_folder(tmp_path / "d" / "train", 20)
    bad = tmp_path / "d" / "train" / "ant" / "0001.png"
    bad.write_bytes(b"\x89PNG broken")
    cfg = folder_config(tmp_path / "d", f"data.loader={loader}", "data.val_fraction=0.5")
    with pytest.raises(UserError) as info:
        data = build_data(cfg, BatchSplit(10, 1, 1), 0, 1, CPU)
        data.train.set_epoch(0)
        list(data.train)
        list(data.val)
    message = str(info.value)
    assert f"cannot decode image {bad}" in message and "replace the file" in message and "\n" not in message


def test_a_fifo_or_dangling_link_named_like_an_image_is_named(tmp_path):
    root = image_folder(tmp_path / "d" / "train", ["a", "b"]).parent
    fifo = root / "train" / "a" / "x.jpg"
    os.mkfifo(fifo)
    cfg = load_config(None, ["data.name=imagefolder", f"data.root={root}"])
    with pytest.raises(UserError, match=re.escape(f"{fifo} is not a regular file")):
        read_splits(cfg)
    fifo.unlink()
    (root / "train" / "b" / "gone.png").symlink_to(tmp_path / "nowhere.png")
    with pytest.raises(UserError, match="gone.png is a broken symbolic link; remove it or fix its target"):
        read_splits(cfg)


def test_one_class_and_hidden_folders(tmp_path):
    root = image_folder(tmp_path / "d" / "train", ["only"]).parent
    cfg = load_config(None, ["data.name=imagefolder", f"data.root={root}"])
    with pytest.raises(UserError, match="has 1 class folder .*a classifier needs at least 2"):
        read_splits(cfg)
    image_folder(root / "train", ["second", ".ipynb_checkpoints"])
    image_folder(root / "train" / "only", [".hidden"])  # hidden folders inside a class: not images of it
    splits = read_splits(cfg)
    assert splits.classes == ["only", "second"] and len(splits.train) + len(splits.val) == 16


# ------------------------------------------------------------------ cache


def test_decoded_cache_is_reused_and_invalidated(tmp_path, monkeypatch):
    write_coded_folder(tmp_path / "d" / "train", 30)
    cfg = folder_config(tmp_path / "d", "data.loader=device")
    cache = tmp_path / "cache"
    first = build_data(cfg, BatchSplit(8, 1, 1), 0, 1, CPU)
    entries = sorted(cache.glob("*.pt"))
    assert len(entries) == 2  # train and val

    real_decode = decode.decode_files
    calls = []

    def counting_decode(files, size):
        calls.append(len(files))
        return real_decode(files, size)

    monkeypatch.setattr(decode, "decode_files", counting_decode)
    second = build_data(cfg, BatchSplit(8, 1, 1), 0, 1, CPU)
    assert calls == []  # served from the cache
    assert torch.equal(first.train.data.images, second.train.data.images)

    # Change one training image: the training entry is decoded again and replaces the stale one.
    changed = next(p for p in (tmp_path / "d" / "train").rglob("*.png") if p.name == "0005.png")
    Image.fromarray(np.full((8, 8, 3), 200, dtype=np.uint8)).save(changed)
    os.utime(changed, ns=(1, 1))
    third = build_data(cfg, BatchSplit(8, 1, 1), 0, 1, CPU)
    assert calls == [len(third.train.data)] or calls == [len(third.val.data)]
    assert len(sorted(cache.glob("*.pt"))) == 2
    assert sorted(cache.glob("*.pt")) != entries


# ------------------------------------------------------------------ sharding and determinism


@pytest.mark.parametrize("loader", ["device", "workers"])
def test_every_training_sample_once_per_epoch_across_ranks(tmp_path, loader):
    write_coded_folder(tmp_path / "d" / "train", 100)
    cfg = folder_config(tmp_path / "d", f"data.loader={loader}", "data.augment=false", *IDENTITY_NORM)
    train_ids = {int(Path(p).stem) for p in read_splits(cfg).train.paths}
    reference = epoch_ids(cfg, world=1, global_batch=20)
    for world in (1, 2, 4):
        steps = epoch_ids(cfg, world=world, global_batch=20)
        seen = torch.cat(steps).tolist()
        assert sorted(seen) == sorted(train_ids)  # 80 training images, each once
        assert all(torch.equal(a, b) for a, b in zip(steps, reference, strict=True))  # same global batches
    next_epoch = epoch_ids(cfg, world=2, global_batch=20, epoch=1)
    assert not torch.equal(torch.cat(next_epoch), torch.cat(reference))  # reshuffled each epoch


def test_loader_processes_start_when_the_data_is_built_and_serve_every_epoch(tmp_path):
    """Forked while the run is built (no thread of ours runs yet), before any batch is asked for,
    and persistent: the same processes serve every epoch, with the device loader's batches."""
    write_coded_folder(tmp_path / "d" / "train", 100)
    cfg = folder_config(tmp_path / "d", "data.loader=workers", "data.augment=false", *IDENTITY_NORM)
    before = set(multiprocessing.active_children())
    data = build_data(cfg, BatchSplit(20, 1, 1), 0, 1, CPU)
    started = set(multiprocessing.active_children()) - before
    assert len(started) == 2  # one for the training loader, one for evaluation
    device = folder_config(tmp_path / "d", "data.loader=device", "data.augment=false", *IDENTITY_NORM)
    for epoch in (0, 1):
        data.train.set_epoch(epoch)
        ids = torch.cat([decode_ids(x) for x, _ in data.train])
        assert torch.equal(ids, torch.cat(epoch_ids(device, 1, 20, epoch)))
    assert set(multiprocessing.active_children()) - before == started
    data.close()
    assert not set(multiprocessing.active_children()) & started


def test_loader_processes_are_capped_to_the_cores_and_said_once(capsys):
    cores = cpu_cores()
    main_rank, other_rank = (ProcessContext(r, r, 2, 2, CPU, distributed=False) for r in (0, 1))
    share = max(1, cores // 2)
    assert loader_processes(100, main_rank) == share
    assert f"data.num_workers=100 is more than the {share} core(s) each of the 2 process(es)" in one_line(
        capsys.readouterr().err
    )
    assert loader_processes(100, other_rank) == share and capsys.readouterr().err == ""  # rank 0 says it
    assert loader_processes(1, main_rank) == 1 and loader_processes(-1, main_rank) == min(8, share)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("loader", ["device", "workers"])
def test_every_validation_sample_once_across_ranks(tmp_path, loader):
    write_coded_folder(tmp_path / "d" / "train", 100)
    cfg = folder_config(tmp_path / "d", f"data.loader={loader}", *IDENTITY_NORM, "data.eval_batch_size=3")
    val_ids = sorted(int(Path(p).stem) for p in read_splits(cfg).val.paths)
    for world in (1, 2, 3):
        seen = [decode_ids(x) for rank in range(world) for x, _ in build_data(cfg, None, rank, world, CPU).val]
        assert sorted(torch.cat(seen).tolist()) == val_ids


def augmented_epoch(cfg, world: int) -> torch.Tensor:
    parts = []
    for rank in range(world):
        data = build_data(cfg, BatchSplit(16, 1, world), rank, world, CPU)
        data.train.set_epoch(2)
        parts.append([x for x, _ in data.train])
    return torch.cat([torch.cat(step) for step in zip(*parts, strict=True)])


def test_augmented_batches_same_for_both_loaders_any_world_size_and_reruns(tmp_path):
    write_coded_folder(tmp_path / "d" / "train", 60, size=12)
    base = ["data.image_size=12", "data.crop_padding=3"]
    device = augmented_epoch(folder_config(tmp_path / "d", "data.loader=device", *base), world=1)
    assert torch.equal(device, augmented_epoch(folder_config(tmp_path / "d", "data.loader=device", *base), 1))
    assert torch.equal(device, augmented_epoch(folder_config(tmp_path / "d", "data.loader=device", *base), 2))
    assert torch.equal(device, augmented_epoch(folder_config(tmp_path / "d", "data.loader=workers", *base), 2))
    other_seed = augmented_epoch(folder_config(tmp_path / "d", "data.loader=device", "seed=1", *base), 1)
    assert not torch.equal(device, other_seed)


def test_large_images_use_random_resized_crop_reproducibly(tmp_path):
    write_coded_folder(tmp_path / "d" / "train", 24, size=96)
    cfg = folder_config(tmp_path / "d", "data.image_size=80", "data.num_workers=2")
    a, b = augmented_epoch(cfg, 1), augmented_epoch(cfg, 2)
    assert a.shape == (16, 3, 80, 80) and torch.equal(a, b)
    data = build_data(cfg, None, 0, 1, CPU)
    assert data.loader == "workers"  # auto: large images go through workers
    x, _ = next(iter(data.val))
    assert x.shape[-2:] == (80, 80)
    with pytest.raises(UserError, match="needs data.loader=workers"):
        build_data(folder_config(tmp_path / "d", "data.image_size=80", "data.loader=device"), None, 0, 1, CPU)


# ------------------------------------------------------------------ the real images in ../shared


@pytest.mark.skipif(not (SHARED / "train").is_dir(), reason=f"real CIFAR-10 images not found at {SHARED}")
def test_real_cifar10_image_folder(tmp_path):
    cfg = config(
        "data.name=imagefolder", f"data.root={SHARED}", "data.loader=workers", "data.num_workers=0",
        "data.eval_batch_size=250",
    )  # fmt: skip
    splits = read_splits(cfg)
    assert splits.classes[:3] == ["airplane", "automobile", "bird"] and len(splits.classes) == 10
    assert len(splits.train) == 45000 and len(splits.val) == 5000
    data = build_data(cfg, None, 0, 1, CPU)
    x, y = next(iter(data.val))
    assert x.shape == (250, 3, 32, 32) and 0 <= int(y.min()) and int(y.max()) <= 9
    assert 0.6 < float(x.std()) < 1.4  # real pixels, normalised with the default mean 0.5, std 0.25
