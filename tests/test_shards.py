"""Packed shards (`multicard pack`, `data.name=shards`): the same training as the folder they were
packed from, read by standard tools, written atomically, and damaged packs refused in one line.

A folder of 192 + 50 small photos (CIFAR-10 JPEGs where the shared data is present, some turned
into PNGs) is packed into several shards; training from them and from the folder ends with the
same parameters bit for bit, under one process and ddp×2, with the workers and device loaders.

The hostile cases run on a smaller pack of noise: what `pack --verify` checks, symbolic-link loops
in a class folder, a resume onto other samples, packing into the source, a full disk, a file in
--out's path, a killed pack, read errors that name their cause, the advice for a folder without an
index, and --workers above the cores.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from rich.console import Console

from conftest import (
    assert_bitwise_equal,
    cli,
    final_params,
    load_checkpoint,
    max_rel_diff,
    one_line,
    run_here,
    slowed,
    start,
    stopped_after_first_checkpoint,
    wait_for,
)
from multicard.base.config import load_config
from multicard.base.errors import UserError
from multicard.cli.main import main
from multicard.data import read_splits, sample_list_fingerprint
from multicard.data.augmentation.transforms import FitSquare
from multicard.data.loading.sampling import BatchSplit, ShardedBatchSampler, epoch_permutation
from multicard.data.loading.workers import SourceImages
from multicard.data.sources.shards import INDEX, PARTIAL, RUN, WINDOW, ShardSamples, local_order, order_of
from multicard.runtime.process_group import cpu_cores
from multicard.tools.pack import PackOptions, pack, plan_chunks, run_pack, verify_pack

CIFAR = Path("/work/shared/data/cifar10/train")
CLASSES = ("airplane", "cat", "dog")
TRAIN_PER_CLASS, VAL_PER_CLASS = 64, (17, 17, 16)  # 192 training images: 6 steps of 32; 50 divides by neither 2 nor 3
COMMON = [
    "model.name=smallcnn", "data.image_size=16", "data.crop_padding=2", "train.epochs=1",
    "train.global_batch_size=32", "log_every=2", "data.num_workers=1",
]  # fmt: skip
STEPS = 192 // 32
SHARD_MB = "0.06"  # several shards of a split, so reads cross shard files


def _photo(rng: np.random.Generator, label: int) -> Image.Image:
    base = rng.integers(0, 256, (9, 9, 3)).astype(np.float32)
    base[..., label] = base[..., label] * 0.5 + 127
    return Image.fromarray(base.astype(np.uint8)).resize((32, 32), Image.Resampling.BILINEAR)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """root/{train,val}/<class>/NNNN.jpg|png: CIFAR-10 files (or made-up photos without them)."""
    root = tmp_path_factory.mktemp("folder")
    rng = np.random.default_rng(0)
    for label, name in enumerate(CLASSES):
        originals = sorted((CIFAR / name).iterdir())[: TRAIN_PER_CLASS + 20] if (CIFAR / name).is_dir() else []
        for split, count, skip in (("train", TRAIN_PER_CLASS, 0), ("val", VAL_PER_CLASS[label], TRAIN_PER_CLASS)):
            (root / split / name).mkdir(parents=True)
            for k in range(count):
                image = Image.open(originals[skip + k]) if originals else _photo(rng, label)
                ext = "png" if k % 5 == 0 else "jpg"  # both formats: bytes are stored as they are
                if originals and ext == "jpg":
                    (root / split / name / f"{k:04d}.jpg").write_bytes(originals[skip + k].read_bytes())
                else:
                    image.convert("RGB").save(root / split / name / f"{k:04d}.{ext}", quality=90)
    return root


def folder_data(root: Path) -> list[str]:
    return ["data.name=imagefolder", f"data.root={root}"]


def shards_data(packed: Path) -> list[str]:
    return ["data.name=shards", f"data.root={packed}"]


@pytest.fixture(scope="module")
def packed(folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "shards"
    result = cli("pack", "--out", str(out), "--shard-mb", SHARD_MB, *folder_data(folder))
    assert result.returncode == 0, result.stderr
    assert "packed 192 training and 50 validation samples" in result.stdout
    return out


def splits_of(*overrides: str):
    return read_splits(load_config(None, list(overrides)).data, 0)


def one_line_error(result) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("multicard: error: "), result.stderr
    return lines[0]


# Small photos of noise in two classes, packed in shards of a few KiB: for the hostile cases.
NOISE_CLASSES = ("a", "b")
NOISE_TRAIN, NOISE_VAL = 6, 2  # images per class


def noise_photos(root: Path, seed: int = 0, sizes: tuple[int, int] = (12, 20)) -> Path:
    """root/{train,val}/<class>/NN.png: small made-up photos of noise, of sides in `sizes` (another
    seed: other images; one size: files of one length, as noise does not compress)."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", NOISE_TRAIN), ("val", NOISE_VAL)):
        for name in NOISE_CLASSES:
            (root / split / name).mkdir(parents=True)
            for k in range(count):
                side = int(rng.integers(sizes[0], sizes[1] + 1))
                pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{k:02d}.png")
    return root


def pack_quietly(root: Path, out: Path, shard_mb: float = 256.0, workers: int = 1) -> str:
    d = load_config(None, folder_data(root)).data
    return pack(d, read_splits(d, 0), PackOptions(out, shard_mb, workers), Console(file=io.StringIO()))


@pytest.fixture(scope="module")
def noise_folder(tmp_path_factory) -> Path:
    return noise_photos(tmp_path_factory.mktemp("photos"))


@pytest.fixture(scope="module")
def noise_packed(noise_folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "shards"
    pack_quietly(noise_folder, out, shard_mb=0.004)  # several shards per split
    return out


@pytest.fixture
def noise_copy(noise_packed, tmp_path) -> Path:
    return Path(shutil.copytree(noise_packed, tmp_path / "copy"))


def edit_index(folder: Path, change) -> None:
    index = json.loads((folder / INDEX).read_text())
    change(index)
    (folder / INDEX).write_text(json.dumps(index))


# ------------------------------------------------------------------ the packed files


def test_shards_hold_each_files_bytes_and_label_where_the_index_says(folder, packed):
    shards, files = splits_of(*shards_data(packed)), splits_of(*folder_data(folder))
    assert shards.classes == files.classes == list(CLASSES)
    assert len(list(packed.glob("train-*.tar"))) > 2
    for part in ("train", "val"):
        ours, theirs = getattr(shards, part), getattr(files, part)
        assert len(ours) == len(theirs)
        for i in range(len(theirs)):
            image, label = ours.dataset[i]
            assert image.data == (theirs.root / theirs.paths[i]).read_bytes() and label == theirs.labels[i]
    index = json.loads((packed / INDEX).read_text())
    assert index["splits"]["train"]["width"][0] == 32 and index["splits"]["train"]["height"][0] == 32


def test_webdataset_and_tar_read_the_shards(folder, packed):
    wds = pytest.importorskip("webdataset")
    files = splits_of(*folder_data(folder)).train
    names = sorted(p.name for p in packed.glob("train-*.tar"))
    samples = list(wds.WebDataset([str(packed / n) for n in names], shardshuffle=False))
    assert sorted(int(s["__key__"]) for s in samples) == list(range(len(files)))  # the key: its place in the split
    for sample in samples:
        i = int(sample["__key__"])
        ext = "png" if files.paths[i].endswith(".png") else "jpg"
        assert sample[ext] == (files.root / files.paths[i]).read_bytes()
        assert int(sample["cls"]) == files.labels[i]
    listing = subprocess.run(["tar", "tf", str(packed / names[0])], capture_output=True, text=True, check=True)
    first = samples[0]["__key__"]
    assert listing.stdout.splitlines()[:2] == [f"{first}.{'png' if 'png' in samples[0] else 'jpg'}", f"{first}.cls"]


@pytest.mark.slow
def test_verify_accepts_the_pack_and_names_a_changed_shard(packed, tmp_path):
    result = cli("pack", "--verify", str(packed))
    assert result.returncode == 0 and "242 samples in" in result.stdout, result.stderr
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in packed.iterdir():
        copy.joinpath(path.name).write_bytes(path.read_bytes())
    shard = copy / "train-00001.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF  # same size, other content: only the checksum tells
    shard.write_bytes(bytes(data))
    assert f"shard {shard} does not hold what was packed" in one_line_error(cli("pack", "--verify", str(copy)))


def _wider(index):
    index["splits"]["train"]["width"][3] += 7


def _fewer_classes(index):
    index["classes"] = index["classes"][:1]


def _no_val(index):
    del index["splits"]["val"]


def _renamed(index):
    index["classes"] = ["cat", "dog"]


@pytest.mark.parametrize(
    "change, message",
    [
        (_wider, r"index .* says sample 3 of split train is \d+x\d+ PNG RGB \(.png\), but its image in .* is \d+x\d+"),
        (_fewer_classes, r"index .* is damaged: sample \d+ of split \w+ has label 1, but the index names 1 classes"),
        (_no_val, "index .* has no val split"),
        (_renamed, r"index .* was changed after packing \(its class names or source differ\); pack again"),
    ],
    ids=["false-width", "cut-class-list", "no-val-split", "renamed-classes"],
)
def test_verify_checks_everything_the_index_states(noise_packed, noise_copy, change, message):
    assert "verified" in verify_pack(noise_packed)
    edit_index(noise_copy, change)
    with pytest.raises(UserError, match=message):
        verify_pack(noise_copy)
    if change in (_fewer_classes, _no_val):  # training refuses them at start-up too, not mid-epoch
        with pytest.raises(UserError, match=message):
            splits_of("data.name=shards", f"data.root={noise_copy}")


def test_verify_names_a_shard_member_that_holds_no_file(noise_packed, noise_copy):
    """A shard whose label member is a folder entry (its checksum and size recorded as the index's, so
    only the member check sees it) is one line naming the member, not a traceback."""
    shard = noise_copy / json.loads((noise_copy / INDEX).read_text())["splits"]["train"]["shards"][0]["name"]
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    label = members[1][0]
    folder = tarfile.TarInfo(label.name)
    folder.type = tarfile.DIRTYPE
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data in [members[0], (folder, b""), *members[2:]]:
            tar.addfile(member, io.BytesIO(data) if member.isfile() else None)

    def record(index):
        index["splits"]["train"]["shards"][0].update(
            bytes=shard.stat().st_size, sha256=hashlib.sha256(shard.read_bytes()).hexdigest()
        )

    edit_index(noise_copy, record)
    with pytest.raises(UserError, match=f"shard .*{shard.name}: member {label.name} is not a file; pack again"):
        verify_pack(noise_copy)


def test_a_symlink_loop_in_a_class_folder_is_refused_and_a_link_elsewhere_followed(noise_folder, tmp_path):
    root = Path(shutil.copytree(noise_folder, tmp_path / "data"))
    elsewhere = noise_photos(tmp_path / "elsewhere", seed=1) / "train" / "b"
    (root / "train" / "a" / "more").symlink_to(elsewhere, target_is_directory=True)  # a folder of images elsewhere
    splits = splits_of(*folder_data(root))
    assert len(splits.train) == 2 * NOISE_TRAIN + NOISE_TRAIN and (  # both classes, and the linked folder's
        splits.train.labels.tolist().count(0) == 2 * NOISE_TRAIN
    )
    (root / "train" / "a" / "loop").symlink_to("..", target_is_directory=True)  # the hostile tester's link
    message = f"{root / 'train' / 'a' / 'loop'} is a symbolic link to {root / 'train'}, a folder that holds it"
    with pytest.raises(UserError, match=message):
        splits_of(*folder_data(root))  # training
    with pytest.raises(UserError, match=message):
        run_pack(None, folder_data(root), str(tmp_path / "shards"), None, 256.0, 1)
    assert not (tmp_path / "shards").exists()


def test_the_fingerprint_of_shards_holds_across_paths_and_shard_sizes_not_other_samples(noise_folder, tmp_path):
    def of(root: Path, kind: str = "shards") -> str | None:
        return sample_list_fingerprint(splits_of(f"data.name={kind}", f"data.root={root}").train)

    # Two datasets of the same names, counts and file lengths (noise of one size): only their bytes differ.
    same = [noise_photos(tmp_path / f"photos-{seed}", seed, sizes=(16, 16)) for seed in (0, 1)]
    for name, (source, shard_mb) in {"small": (same[0], 0.004), "big": (same[0], 256), "other": (same[1], 256)}.items():
        pack_quietly(source, tmp_path / name, shard_mb)
    moved = Path(shutil.copytree(tmp_path / "small", tmp_path / "moved"))
    assert of(tmp_path / "small") == of(tmp_path / "big") == of(moved) is not None
    assert of(tmp_path / "other") != of(tmp_path / "small")
    # Image folders: relative paths, sizes and labels (documented: cheap, contents not read).
    assert of(noise_folder, "imagefolder") == of(Path(shutil.copytree(noise_folder, tmp_path / "copy")), "imagefolder")
    assert of(noise_folder, "imagefolder") != of(noise_photos(tmp_path / "other-photos", seed=1), "imagefolder")


def test_reads_in_flight_give_the_same_samples_in_the_same_order(packed):
    source = splits_of(*shards_data(packed), "data.reads_in_flight=8").train
    one_by_one = SourceImages(splits_of(*shards_data(packed), "data.reads_in_flight=1").train, FitSquare(16))
    keys = [(0, i) for i in (5, 190, 3, 64, 65, 5)]
    batch = SourceImages(source, FitSquare(16)).__getitems__(keys)
    for (x, y, i), key in zip(batch, keys, strict=True):
        ex, ey, ei = one_by_one[key]
        assert torch.equal(x, ex) and y == ey and i == ei


def test_a_batch_read_in_runs_gives_each_samples_bytes(packed):
    samples = ShardSamples(splits_of(*shards_data(packed)).train.dataset.split, reads_in_flight=4)
    assert len(samples._runs(list(range(192)))) < 192 / 4  # neighbours are read together
    samples.prefetch(list(range(192)))
    assert all(samples[i][0].data == samples.read(i) for i in range(192))


def test_the_local_order_is_a_function_of_seed_and_epoch_that_reads_few_runs():
    stored = torch.randperm(5000, generator=torch.Generator().manual_seed(1))
    perm = local_order(stored, 5000, 3, 0)
    assert torch.equal(perm.sort().values, torch.arange(5000)) and torch.equal(perm, local_order(stored, 5000, 3, 0))
    assert not torch.equal(perm, local_order(stored, 5000, 3, 1))
    position = torch.empty(5000, dtype=torch.long)
    position[stored] = torch.arange(5000)
    runs_per_batch = [len(set((position[b] // RUN).tolist())) for b in perm[: 19 * 256].view(19, 256)]
    # A batch reads the runs of its window (of two where it straddles them): far from one run per sample.
    assert sorted(runs_per_batch)[len(runs_per_batch) // 2] == WINDOW and max(runs_per_batch) <= 2 * WINDOW


def test_the_local_order_gives_the_same_global_batches_at_any_world_size(packed):
    train = splits_of(*shards_data(packed)).train
    order = order_of(train, "local")

    def batches(world: int) -> list[torch.Tensor]:
        samplers = [ShardedBatchSampler(192, BatchSplit(32, 1, world), r, 5, order=order) for r in range(world)]
        for sampler in samplers:
            sampler.set_epoch(2, start_step=1)
        return [torch.cat(parts) for parts in zip(*samplers, strict=True)]

    one, two = batches(1), batches(2)
    assert len(one) == STEPS - 1 and all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    assert not torch.equal(torch.cat(one), epoch_permutation(192, 5, 2)[32:])


def test_reads_in_flight_below_one_is_refused():
    with pytest.raises(UserError, match="data.reads_in_flight=0 must be > 0"):
        load_config(None, ["data.reads_in_flight=0"])


def test_pixels_of_an_in_memory_dataset_are_packed_losslessly(tmp_path):
    d = load_config(None, ["data.train_size=40", "data.val_size=10", "data.image_size=8"]).data
    splits = read_splits(d, 0)
    pack(d, splits, PackOptions(tmp_path / "p", workers=1))
    packed = read_splits(load_config(None, [*shards_data(tmp_path / "p"), "data.image_size=8"]).data, 0)
    for i in (0, 39):
        image, label = packed.train.dataset[i]
        pixels = torch.from_numpy(np.array(Image.open(io.BytesIO(image.data)))).permute(2, 0, 1)
        assert torch.equal(pixels, splits.train.images[i]) and label == splits.train.labels[i]


# ------------------------------------------------------------------ the same training


def train(out: Path, *args: str, launch: tuple[str, ...] = ()) -> Path:
    """out, after `multicard train` there, run by this process (conftest.run_here)."""
    run_here("train", *launch, *COMMON, *args, f"out_dir={out}")
    return out


@pytest.fixture(scope="module")
def folder_run(folder, tmp_path_factory) -> Callable[[tuple[str, ...]], Path]:
    """The out_dir of a training on the folder under `launch`, once per launch: either loader
    gives it (the same samples, augmented alike), so one run is the reference of both."""
    runs: dict[tuple[str, ...], Path] = {}

    def get(launch: tuple[str, ...]) -> Path:
        if launch not in runs:
            runs[launch] = train(tmp_path_factory.mktemp("folder"), *folder_data(folder), launch=launch)
        return runs[launch]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "launch, loader",
    [
        pytest.param((), "workers", id="single-workers"),
        pytest.param(("--nproc-per-node", "2"), "workers", id="ddp2-workers", marks=pytest.mark.distributed),
        pytest.param((), "device", id="single-device"),
        pytest.param(("--nproc-per-node", "2"), "device", id="ddp2-device", marks=pytest.mark.distributed),
    ],
)
def test_shards_and_folder_train_to_bitwise_equal_parameters(folder, packed, folder_run, tmp_path, launch, loader):
    from_shards = train(tmp_path / "shards", *shards_data(packed), f"data.loader={loader}", launch=launch)
    assert_bitwise_equal(final_params(from_shards), final_params(folder_run(launch)))
    assert load_checkpoint(tmp_path / "shards" / "checkpoints" / "last.pt")["classes"] == list(CLASSES)


# float64, no BatchNorm, two epochs under a constant LR with a checkpoint every 2 steps.
EXACT = ["precision=fp64", "model.kwargs={norm: none}", "train.epochs=2", "sched.name=constant",
         "checkpoint.every_steps=2", "data.loader=workers"]  # fmt: skip


@pytest.fixture(scope="module")
def ddp2_fp64(packed, tmp_path_factory) -> Path:
    return train(tmp_path_factory.mktemp("ddp2"), *shards_data(packed), *EXACT, launch=("--nproc-per-node", "2"))


def sigterm_mid_epoch(packed: Path, out: Path) -> int:
    """A ddp×2 run on shards stopped by SIGTERM after its first checkpoint; the step it stopped at."""
    args = ["--nproc-per-node", "2", *COMMON, *shards_data(packed), *EXACT]
    stopped = stopped_after_first_checkpoint(out, *args, env=slowed(300))
    assert stopped % STEPS and stopped < 2 * STEPS  # inside an epoch
    return stopped


@pytest.mark.distributed
@pytest.mark.parametrize("resume_on", [2, 1], ids=["ddp2", "single"])
def test_sigterm_mid_epoch_on_shards_then_resume_continues_the_epoch(packed, ddp2_fp64, tmp_path, resume_on):
    stopped = sigterm_mid_epoch(packed, tmp_path)
    if resume_on == 2:
        train(tmp_path, *shards_data(packed), *EXACT, launch=("--nproc-per-node", "2"))
        assert_bitwise_equal(final_params(tmp_path), final_params(ddp2_fp64))
    else:
        output = run_here("train", *COMMON, *shards_data(packed), *EXACT, f"out_dir={tmp_path}")
        assert f"step {stopped} of {2 * STEPS}" in output
        assert max_rel_diff(final_params(tmp_path), final_params(ddp2_fp64)) < 1e-10


@pytest.mark.slow
@pytest.mark.distributed
def test_the_local_order_trains_alike_on_one_process_and_ddp2(packed, tmp_path):
    args = [*shards_data(packed), *EXACT, "data.order=local", "train.epochs=1"]
    single = final_params(train(tmp_path / "single", *args))
    ddp2 = final_params(train(tmp_path / "ddp2", *args, launch=("--nproc-per-node", "2")))
    assert max_rel_diff(ddp2, single) < 1e-10


@pytest.mark.distributed
def test_eval_from_shards_on_3_processes_equals_eval_from_the_folder_on_1(folder, packed, ddp2_fp64):
    ckpt = str(ddp2_fp64 / "checkpoints" / "last.pt")
    on_3 = run_here("eval", "--checkpoint", ckpt, "--json", "--nproc-per-node", "3", "--oversubscribe")
    on_1 = run_here("eval", "--checkpoint", ckpt, "--json", *folder_data(folder))
    shards, files = (json.loads(output.strip().splitlines()[-1]) for output in (on_3, on_1))
    assert shards["samples"] == files["samples"] == sum(VAL_PER_CLASS)
    assert (shards["top1"], shards["top5"]) == (files["top1"], files["top5"])
    assert shards["loss"] == pytest.approx(files["loss"], rel=1e-12)


FEW_STEPS = ["model.name=smallcnn", "data.image_size=16", "train.global_batch_size=4", "train.epochs=1", "log_every=1"]


def test_resuming_onto_other_samples_is_refused_and_the_same_samples_elsewhere_resume(
    noise_folder, tmp_path, capsys
):  # fmt: skip
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    run_here("train", *FEW_STEPS, *folder_data(noise_folder), cache, "train.max_steps=1", f"out_dir={tmp_path / 'run'}")
    other = noise_photos(tmp_path / "other", seed=1)  # the same class names and counts, other images
    args = ["train", *FEW_STEPS, cache, "train.max_steps=2", f"out_dir={tmp_path / 'run'}"]
    assert main([*args, *folder_data(other)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "was trained on other training samples than this data gives" in line
    assert "train.resume=never or another out_dir" in line and "model.weights=" in line
    moved = Path(shutil.copytree(noise_folder, tmp_path / "moved"))  # the same samples at another path
    assert "resumed from" in run_here(*args, *folder_data(moved))


# ------------------------------------------------------------------ atomic packing


# A dataset function over a folder's files whose item `block_at` blocks on a FIFO while MCPACK_BLOCK
# names one: a pack of it is certainly mid-way when the test interrupts it, whatever the machine's speed.
# A split without a folder is None (the dataset has no validation split then).
BLOCKING = """
import os
from pathlib import Path


class Photos:
    def __init__(self, root, block_at):
        self.paths = sorted(Path(root).glob("*/*"))
        self.classes = sorted({p.parent.name for p in self.paths})
        self.block_at = block_at

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        if i == self.block_at and os.environ.get("MCPACK_BLOCK"):
            open(os.environ["MCPACK_BLOCK"]).read()  # blocks: nobody writes to it
        return self.paths[i].read_bytes(), self.classes.index(self.paths[i].parent.name)


def photos(split, root, block_at=100):
    folder = Path(root) / split
    return Photos(folder, block_at) if folder.is_dir() else None
"""


def packed_chunks(out: Path) -> int:
    return len(list((out / PARTIAL).glob("*-*.json")))


def chunks_planned(out: Path) -> int:
    plan = out / PARTIAL / "plan.json"
    return len(plan_chunks(json.loads(plan.read_text())["sizes"])) if plan.is_file() else -1


@pytest.mark.slow
@pytest.mark.parametrize("when", ["a first chunk is packed", "every other chunk is packed"])
def test_sigint_mid_pack_then_rerun_continues_to_a_complete_verified_pack(folder, tmp_path, when):
    """One packing process blocks in the dataset; SIGINT comes while the other packs, or waits idle for
    work (then it holds the pool's task queue: the pool must still end)."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "blocking.py").write_text(BLOCKING)
    os.mkfifo(tmp_path / "fifo")
    out = tmp_path / "shards"
    args = ["pack", "--out", str(out), "--workers", "2", "data.name=blocking:photos", f"data.kwargs={{root: {folder}}}"]
    env = {"PYTHONPATH": str(tmp_path / "code")}
    proc = start(*args, env={**env, "MCPACK_BLOCK": str(tmp_path / "fifo")})
    if when == "a first chunk is packed":
        wait_for(lambda: packed_chunks(out) > 0, what=when)
    else:
        wait_for(lambda: packed_chunks(out) == chunks_planned(out) - 1, what=when)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert not (out / INDEX).exists()
    with pytest.raises(UserError, match="holds an unfinished pack .* rerun multicard pack to finish it"):
        splits_of(*shards_data(out))
    result = cli(*args, env=env)
    assert result.returncode == 0, result.stderr
    assert "continuing the unfinished pack" in result.stderr
    assert not (out / ".partial").exists() and not list(out.glob(".*.tmp"))
    assert "242 samples in" in verify_pack(out)
    splits = splits_of(*shards_data(out))
    assert splits.train.dataset[100][0].data == sorted((folder / "train").glob("*/*"))[100].read_bytes()


def test_a_pack_of_another_source_starts_over(folder, tmp_path):
    d = load_config(None, folder_data(folder)).data
    out = tmp_path / "shards"
    pack(d, read_splits(d, 0), PackOptions(out, workers=1))
    again = load_config(None, [*folder_data(folder), "data.val_root=" + str(folder / "train")]).data
    said = io.StringIO()
    pack(again, read_splits(again, 0), PackOptions(out, workers=1), Console(file=said, width=200))
    assert f"starting over in {out}: its pack was made from another source or with other options" in said.getvalue()
    assert len(splits_of(*shards_data(out)).val) == 192


def test_pack_into_a_folder_that_holds_other_files_is_refused(folder, tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    result = cli("pack", "--out", str(tmp_path), *folder_data(folder))
    said = f"--out {tmp_path} holds files that are no pack's (mine.txt); choose a new or empty folder"
    assert said in one_line_error(result)


@pytest.mark.parametrize(
    "out, shard_mb, message",
    [
        (None, 256.0, "multicard pack needs --out DIR \\(the folder to pack into\\), or --verify DIR"),
        ("x", 0.0, "--shard-mb 0.0 must be > 0"),
    ],
)
def test_pack_without_a_folder_or_with_a_bad_shard_size_is_refused(tmp_path, out, shard_mb, message):
    with pytest.raises(UserError, match=message):
        run_pack(None, [], out and str(tmp_path / out), None, shard_mb, 0)


def test_pack_into_its_own_source_or_around_it_is_refused(noise_folder, tmp_path):
    before = sorted(p.relative_to(noise_folder) for p in noise_folder.rglob("*"))
    with pytest.raises(UserError, match=r"--out .*zz_packed lies inside data.root=.*, the dataset being packed"):
        run_pack(None, folder_data(noise_folder), str(noise_folder / "train" / "zz_packed"), None, 256.0, 1)
    with pytest.raises(UserError, match=r"data.root=.* lies inside --out .*, where the pack is written"):
        run_pack(None, folder_data(noise_folder), str(noise_folder.parent), None, 256.0, 1)
    assert sorted(p.relative_to(noise_folder) for p in noise_folder.rglob("*")) == before  # nothing written into it


def test_pack_out_under_a_file_is_one_line(noise_folder, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(UserError, match=f"--out {tmp_path / 'file' / 'sub'}: {tmp_path / 'file'} is a file"):
        run_pack(None, folder_data(noise_folder), str(tmp_path / "file" / "sub"), None, 256.0, 1)


def test_pack_workers_above_the_cores_are_capped_and_said(noise_folder, tmp_path, capsys, monkeypatch):
    import multicard.tools.pack as packing

    started = []
    real = packing._pack_in_processes
    monkeypatch.setattr(packing, "_pack_in_processes", lambda *a: started.append(a[5]) or real(*a))
    many = cpu_cores() + 62
    run_pack(None, folder_data(noise_folder), str(tmp_path / "shards"), None, 256.0, many)
    note = capsys.readouterr().err
    assert f"multicard: --workers {many} is more than the {cpu_cores()} core(s)" in note
    assert started == [cpu_cores()]


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (root only), unmounted afterwards; grow(mib) makes it larger."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")

    def grow(mib: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={mib}m", str(disk)], check=True)

    try:
        yield disk, grow
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_full_disk_during_pack_is_one_line_keeps_finished_work_and_a_rerun_continues(
    tmp_path, small_disk, capsys
):  # fmt: skip
    disk, grow = small_disk
    big = tmp_path / "big"
    for name in NOISE_CLASSES:  # 24 photos of 64 KiB of noise, 1.6 MB: the chunks fill 1 MiB, chunks and shards 2 MiB
        (big / "train" / name).mkdir(parents=True)
        for k in range(12):
            noise = np.random.default_rng(k).integers(0, 256, (128, 128, 4), dtype=np.uint8)
            Image.fromarray(noise, "RGBA").save(big / "train" / name / f"{k}.png")
    out = disk / "shards"
    args = ["pack", "--out", str(out), "--workers", "2", *folder_data(big)]

    def pack_on_the_disk(code: int) -> list[str]:
        """Its stderr's lines; nothing half-written is left, whatever the outcome."""
        assert main(args) == code
        err = capsys.readouterr().err
        assert "Traceback" not in err and not [p for p in out.rglob("*") if p.name.endswith(".tmp")], err
        return err.strip().splitlines()

    def the_disk_is_full(line: str) -> None:
        assert line.startswith(f"multicard: error: cannot write {out}") and "(No space left on device)" in line
        assert line.endswith("run the same command: it continues from the chunks already packed")

    def continuing(lines: list[str], finished: int) -> bool:  # rich wraps the line, inside a word too
        said = "".join("".join(lines).split())
        return "".join(f"continuing the unfinished pack in {out}: {finished} of 4 chunks".split()) in said

    [line] = pack_on_the_disk(2)  # the chunks fill the disk
    the_disk_is_full(line)
    finished = len([p for p in (out / PARTIAL).glob("*.json") if p.name != "plan.json"])
    assert finished < 4
    grow(2)
    *said, line = pack_on_the_disk(2)  # the chunks are finished; the shards fill the disk
    the_disk_is_full(line)
    assert continuing(said, finished) and not list(out.glob("train-*.tar"))  # its one shard did not fit
    grow(4)
    assert continuing(pack_on_the_disk(0), 4)
    assert "24 samples in" in verify_pack(out)


@pytest.mark.slow
def test_sigkill_of_pack_leaves_workers_that_end_quietly(tmp_path):
    root = tmp_path / "many"
    for name in NOISE_CLASSES:
        (root / "train" / name).mkdir(parents=True)
        for k in range(40):
            Image.new("RGB", (8, 8), (k, 0, 0)).save(root / "train" / name / f"{k:02d}.png")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "blocking.py").write_text(BLOCKING)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    out = tmp_path / "shards"
    env = {"PYTHONPATH": str(tmp_path / "code"), "MCPACK_BLOCK": str(fifo)}
    proc = start("pack", "--out", str(out), "--workers", "2", "data.name=blocking:photos",
                 f"data.kwargs={{root: {root}, block_at: 5}}", env=env)  # fmt: skip
    wait_for(lambda: proc.poll() is not None or any((out / PARTIAL).glob("train-*.json")), what="a packed chunk")
    assert proc.poll() is None, proc.communicate()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    try:  # let the blocked worker go on: it then finds its parent gone
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as exc:
        assert exc.errno == errno.ENXIO  # no reader left: that worker has ended already
    _, err = proc.communicate(timeout=60)  # the workers hold stderr: it ends when they have
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


# ------------------------------------------------------------------ damaged packs: one line, exit 2


@pytest.fixture
def copy(packed, tmp_path) -> Path:
    out = tmp_path / "copy"
    out.mkdir()
    for path in packed.iterdir():
        out.joinpath(path.name).write_bytes(path.read_bytes())
    return out


@pytest.mark.slow
def test_a_truncated_shard_is_one_line_naming_it(copy):
    shard = copy / "train-00002.tar"
    shard.write_bytes(shard.read_bytes()[:-1024])
    result = cli("train", *COMMON, *shards_data(copy), "train.max_steps=1", f"out_dir={copy / 'run'}")
    assert f"shard {shard} has " in one_line_error(result) and "it is truncated or was changed" in result.stderr


def test_a_missing_shard_is_named(copy):
    (copy / "val-00000.tar").unlink()
    with pytest.raises(UserError, match=f"shard {copy / 'val-00000.tar'} is missing"):
        splits_of(*shards_data(copy))


def test_an_index_of_another_version_is_named(copy):
    index = json.loads((copy / INDEX).read_text())
    (copy / INDEX).write_text(json.dumps({**index, "version": 99}))
    with pytest.raises(UserError, match=f"index {copy / INDEX} is format version 99; this multicard reads version 1"):
        splits_of(*shards_data(copy))


@pytest.mark.parametrize("offset", [10**9, -5])
def test_an_index_entry_outside_its_shard_names_the_damaged_index(noise_copy, offset):
    def move(index):
        index["splits"]["train"]["offset"][0] = offset

    edit_index(noise_copy, move)
    message = r"index .*index.json is damaged: sample 0 of split train lies outside its shard .*multicard pack --verify"
    with pytest.raises(UserError, match=message):
        splits_of("data.name=shards", f"data.root={noise_copy}")
    with pytest.raises(UserError, match=message):
        verify_pack(noise_copy)


def test_a_shard_cut_or_removed_while_in_use_is_said_so(noise_copy):
    samples = splits_of("data.name=shards", f"data.root={noise_copy}").train.dataset
    assert isinstance(samples, ShardSamples) and len(samples.split.shards) > 2
    first = [int(np.flatnonzero(samples.shard_of == shard)[0]) for shard in range(2)]  # a sample of each of 2 shards
    removed, cut = (Path(samples.split.shards[shard]) for shard in range(2))
    removed.unlink()
    with pytest.raises(UserError, match=f"cannot read shard {removed} \\(No such file or directory\\); restore it"):
        samples[first[0]]
    os.truncate(cut, int(samples.offset[first[1]]))
    with pytest.raises(UserError, match=f"shard {cut} ends before sample {first[1]}'s bytes: it was truncated while"):
        samples[first[1]]


def test_a_folder_without_an_index_says_how_to_make_one(tmp_path):
    with pytest.raises(UserError, match=f"data.root={tmp_path} has no index.json; make it with multicard pack"):
        splits_of(*shards_data(tmp_path))


def test_a_folder_without_an_index_gets_advice_pack_would_follow(noise_folder, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (tmp_path / "data.tar").write_bytes(b"\0" * 1024)
    with pytest.raises(UserError, match=f"data.root={run} has no index.json: it is not a folder multicard pack wrote; "
                                        f"pack the dataset into a new folder"):  # fmt: skip
        splits_of("data.name=shards", f"data.root={run}")
    with pytest.raises(UserError, match=f"data.root={tmp_path / 'data.tar'}: .* is a file, not a folder multicard"):
        splits_of("data.name=shards", f"data.root={tmp_path / 'data.tar'}")
    with pytest.raises(UserError, match=f"^--verify {noise_folder} has no index.json: it is not a folder") as refused:
        verify_pack(noise_folder)
    assert "data.root" not in str(refused.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=f"make it with multicard pack --out {tmp_path / 'empty'}"):
        splits_of("data.name=shards", f"data.root={tmp_path / 'empty'}")


def test_shard_samples_survive_a_fork(packed):
    """Loader processes fork from their trainer: each opens its own files (read after a fork)."""
    samples = ShardSamples(splits_of(*shards_data(packed)).train.dataset.split, reads_in_flight=4)
    first = samples[0][0].data
    pid = os.fork()
    if pid == 0:
        os._exit(0 if samples[0][0].data == first and samples._pid == os.getpid() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
