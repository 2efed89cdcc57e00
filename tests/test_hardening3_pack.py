"""Issue 37, hardening round 3: packing, shards and folders. A symbolic-link loop in a class
folder, what `pack --verify` checks, resuming onto other training samples, packing into the
source, a full disk, a file in --out's path, a killed pack, read errors that name their cause,
the advice for a folder without an index, and --workers above the cores. Each test is named
after its case."""

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
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from rich.console import Console

from conftest import run_here, start, wait_for
from multicard.base.config import load_config
from multicard.base.errors import UserError
from multicard.cli.main import main
from multicard.data import read_splits, sample_list_fingerprint
from multicard.data.sources.shards import INDEX, PARTIAL, ShardSamples
from multicard.runtime.process_group import cpu_cores
from multicard.tools.pack import PackOptions, pack, run_pack, verify_pack

CLASSES = ("a", "b")
TRAIN, VAL = 6, 2  # images per class


def photos(root: Path, seed: int = 0, sizes: tuple[int, int] = (12, 20)) -> Path:
    """root/{train,val}/<class>/NN.png: small made-up photos of noise, of sides in `sizes` (another
    seed: other images; one size: files of one length, as noise does not compress)."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", TRAIN), ("val", VAL)):
        for name in CLASSES:
            (root / split / name).mkdir(parents=True)
            for k in range(count):
                side = int(rng.integers(sizes[0], sizes[1] + 1))
                pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{k:02d}.png")
    return root


def folder_data(root: Path) -> list[str]:
    return ["data.name=imagefolder", f"data.root={root}"]


def splits_of(*overrides: str):
    return read_splits(load_config(None, list(overrides)).data, 0)


def pack_quietly(root: Path, out: Path, shard_mb: float = 256.0, workers: int = 1) -> str:
    d = load_config(None, folder_data(root)).data
    return pack(d, read_splits(d, 0), PackOptions(out, shard_mb, workers), Console(file=io.StringIO()))


def one_line(err: str) -> str:
    """stderr holds exactly one line and no traceback; that line."""
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    return err.strip()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return photos(tmp_path_factory.mktemp("photos"))


@pytest.fixture(scope="module")
def packed(folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "shards"
    pack_quietly(folder, out, shard_mb=0.004)  # several shards per split
    return out


@pytest.fixture
def copy(packed, tmp_path) -> Path:
    return Path(shutil.copytree(packed, tmp_path / "copy"))


def edit_index(folder: Path, change) -> None:
    index = json.loads((folder / INDEX).read_text())
    change(index)
    (folder / INDEX).write_text(json.dumps(index))


# ------------------------------------------------------------------ 1: a link back into the folder


def test_37_1_a_symlink_loop_in_a_class_folder_is_refused_and_a_link_elsewhere_followed(folder, tmp_path):
    root = Path(shutil.copytree(folder, tmp_path / "data"))
    elsewhere = photos(tmp_path / "elsewhere", seed=1) / "train" / "b"
    (root / "train" / "a" / "more").symlink_to(elsewhere, target_is_directory=True)  # a folder of images elsewhere
    splits = splits_of(*folder_data(root))
    assert len(splits.train) == 2 * TRAIN + TRAIN and splits.train.labels.tolist().count(0) == 2 * TRAIN
    (root / "train" / "a" / "loop").symlink_to("..", target_is_directory=True)  # the hostile tester's link
    message = f"{root / 'train' / 'a' / 'loop'} is a symbolic link to {root / 'train'}, a folder that holds it"
    with pytest.raises(UserError, match=message):
        splits_of(*folder_data(root))  # training
    with pytest.raises(UserError, match=message):
        run_pack(None, folder_data(root), str(tmp_path / "shards"), None, 256.0, 1)
    assert not (tmp_path / "shards").exists()


# ------------------------------------------------------------------ 2: verify checks what the index says


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
def test_37_2_verify_checks_everything_the_index_states(packed, copy, change, message):
    assert "verified" in verify_pack(packed)
    edit_index(copy, change)
    with pytest.raises(UserError, match=message):
        verify_pack(copy)
    if change in (_fewer_classes, _no_val):  # training refuses them at start-up too, not mid-epoch
        with pytest.raises(UserError, match=message):
            splits_of("data.name=shards", f"data.root={copy}")


def test_verify_names_a_shard_member_that_holds_no_file(packed, copy):
    """A shard whose label member is a folder entry (its checksum and size recorded as the index's, so
    only the member check sees it) is one line naming the member, not a traceback."""
    shard = copy / json.loads((copy / INDEX).read_text())["splits"]["train"]["shards"][0]["name"]
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

    edit_index(copy, record)
    with pytest.raises(UserError, match=f"shard .*{shard.name}: member {label.name} is not a file; pack again"):
        verify_pack(copy)


# ------------------------------------------------------------------ 3: resuming onto other samples

RUN = ["model.name=smallcnn", "data.image_size=16", "train.global_batch_size=4", "train.epochs=1", "log_every=1"]


def test_37_3_resuming_onto_other_samples_is_refused_and_the_same_samples_elsewhere_resume(
    folder, tmp_path, capsys
):  # fmt: skip
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    run_here("train", *RUN, *folder_data(folder), cache, "train.max_steps=1", f"out_dir={tmp_path / 'run'}")
    other = photos(tmp_path / "other", seed=1)  # the same class names and counts, other images
    args = ["train", *RUN, cache, "train.max_steps=2", f"out_dir={tmp_path / 'run'}"]
    assert main([*args, *folder_data(other)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "was trained on other training samples than this data gives" in line
    assert "train.resume=never or another out_dir" in line and "model.weights=" in line
    moved = Path(shutil.copytree(folder, tmp_path / "moved"))  # the same samples at another path
    assert "resumed from" in run_here(*args, *folder_data(moved))


def test_37_3_the_fingerprint_of_shards_holds_across_paths_and_shard_sizes_not_other_samples(folder, tmp_path):
    def of(root: Path, kind: str = "shards") -> str | None:
        return sample_list_fingerprint(splits_of(f"data.name={kind}", f"data.root={root}").train)

    # Two datasets of the same names, counts and file lengths (noise of one size): only their bytes differ.
    same = [photos(tmp_path / f"photos-{seed}", seed, sizes=(16, 16)) for seed in (0, 1)]
    for name, (source, shard_mb) in {"small": (same[0], 0.004), "big": (same[0], 256), "other": (same[1], 256)}.items():
        pack_quietly(source, tmp_path / name, shard_mb)
    moved = Path(shutil.copytree(tmp_path / "small", tmp_path / "moved"))
    assert of(tmp_path / "small") == of(tmp_path / "big") == of(moved) is not None
    assert of(tmp_path / "other") != of(tmp_path / "small")
    # Image folders: relative paths, sizes and labels (documented: cheap, contents not read).
    assert of(folder, "imagefolder") == of(Path(shutil.copytree(folder, tmp_path / "copy")), "imagefolder")
    assert of(folder, "imagefolder") != of(photos(tmp_path / "other-photos", seed=1), "imagefolder")


# ------------------------------------------------------------------ 6: packing into the source


def test_37_6_pack_into_its_own_source_or_around_it_is_refused(folder, tmp_path):
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    with pytest.raises(UserError, match=r"--out .*zz_packed lies inside data.root=.*, the dataset being packed"):
        run_pack(None, folder_data(folder), str(folder / "train" / "zz_packed"), None, 256.0, 1)
    with pytest.raises(UserError, match=r"data.root=.* lies inside --out .*, where the pack is written"):
        run_pack(None, folder_data(folder), str(folder.parent), None, 256.0, 1)
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before  # nothing written into it


# ------------------------------------------------------------------ 12, 13: a full disk, a file in the path


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


def test_37_12_a_full_disk_during_pack_is_one_line_keeps_finished_work_and_a_rerun_continues(
    tmp_path, small_disk, capsys
):  # fmt: skip
    disk, grow = small_disk
    big = tmp_path / "big"
    for name in CLASSES:  # 24 photos of 64 KiB of noise, 1.6 MB: the chunks fill 1 MiB, chunks and shards 2 MiB
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


def test_37_13_pack_out_under_a_file_is_one_line(folder, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(UserError, match=f"--out {tmp_path / 'file' / 'sub'}: {tmp_path / 'file'} is a file"):
        run_pack(None, folder_data(folder), str(tmp_path / "file" / "sub"), None, 256.0, 1)


# ------------------------------------------------------------------ 14: a killed pack

# A dataset function over a folder's files whose item 5 blocks on a FIFO until the test writes to it.
BLOCKING = """
import os
from pathlib import Path


class Photos:
    def __init__(self, root):
        self.paths = sorted(Path(root).glob("*/*"))
        self.classes = sorted({p.parent.name for p in self.paths})

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        if i == 5:
            open(os.environ["MCPACK_BLOCK"]).read()
        return self.paths[i].read_bytes(), self.classes.index(self.paths[i].parent.name)


def photos(split, root):
    return Photos(Path(root) / split) if split == "train" else None
"""


@pytest.mark.slow
def test_37_14_sigkill_of_pack_leaves_workers_that_end_quietly(tmp_path):
    root = tmp_path / "many"
    for name in CLASSES:
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
                 f"data.kwargs={{root: {root}}}", env=env)  # fmt: skip
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


# ------------------------------------------------------------------ 22: read errors name their cause


@pytest.mark.parametrize("offset", [10**9, -5])
def test_37_22_an_index_entry_outside_its_shard_names_the_damaged_index(copy, offset):
    def move(index):
        index["splits"]["train"]["offset"][0] = offset

    edit_index(copy, move)
    message = r"index .*index.json is damaged: sample 0 of split train lies outside its shard .*multicard pack --verify"
    with pytest.raises(UserError, match=message):
        splits_of("data.name=shards", f"data.root={copy}")
    with pytest.raises(UserError, match=message):
        verify_pack(copy)


def test_37_22_a_shard_cut_or_removed_while_in_use_is_said_so(copy):
    samples = splits_of("data.name=shards", f"data.root={copy}").train.dataset
    assert isinstance(samples, ShardSamples) and len(samples.split.shards) > 2
    first = [int(np.flatnonzero(samples.shard_of == shard)[0]) for shard in range(2)]  # a sample of each of 2 shards
    removed, cut = (Path(samples.split.shards[shard]) for shard in range(2))
    removed.unlink()
    with pytest.raises(UserError, match=f"cannot read shard {removed} \\(No such file or directory\\); restore it"):
        samples[first[0]]
    os.truncate(cut, int(samples.offset[first[1]]))
    with pytest.raises(UserError, match=f"shard {cut} ends before sample {first[1]}'s bytes: it was truncated while"):
        samples[first[1]]


def test_37_22_a_missing_image_file_of_a_parquet_dataset_is_named(folder, tmp_path):
    os.environ.setdefault("HF_HOME", str(tmp_path / "hf-home"))  # the datasets cache, before its import
    datasets = pytest.importorskip("datasets")
    import pyarrow.parquet as pq

    from multicard.data.sources.user import read_item

    files, gone = [str(f) for f in sorted((folder / "train").glob("*/*.png"))], tmp_path / "gone.png"
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES))})
    (tmp_path / "hf").mkdir()
    for split, images in (("train", [*files, str(gone)]), ("validation", files[:2])):
        rows = datasets.Dataset.from_dict({"image": images, "label": [0] * len(images)}, features=features)
        pq.write_table(rows.data.table, tmp_path / "hf" / f"{split}-00000-of-00001.parquet")  # paths, no bytes
    train = splits_of("data.name=hf", f"data.root={tmp_path / 'hf'}").train
    with pytest.raises(UserError, match=f"split train item {len(files)} names image file {gone}, which cannot be read"):
        read_item(train, len(files))


# ------------------------------------------------------------------ 24: advice that fits the folder


def test_37_24_a_folder_without_an_index_gets_advice_pack_would_follow(folder, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (tmp_path / "data.tar").write_bytes(b"\0" * 1024)
    with pytest.raises(UserError, match=f"data.root={run} has no index.json: it is not a folder multicard pack wrote; "
                                        f"pack the dataset into a new folder"):  # fmt: skip
        splits_of("data.name=shards", f"data.root={run}")
    with pytest.raises(UserError, match=f"data.root={tmp_path / 'data.tar'}: .* is a file, not a folder multicard"):
        splits_of("data.name=shards", f"data.root={tmp_path / 'data.tar'}")
    with pytest.raises(UserError, match=f"^--verify {folder} has no index.json: it is not a folder") as refused:
        verify_pack(folder)
    assert "data.root" not in str(refused.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=f"make it with multicard pack --out {tmp_path / 'empty'}"):
        splits_of("data.name=shards", f"data.root={tmp_path / 'empty'}")


# ------------------------------------------------------------------ 25: --workers above the cores


def test_37_25_pack_workers_above_the_cores_are_capped_and_said(folder, tmp_path, capsys, monkeypatch):
    import multicard.tools.pack as packing

    started = []
    real = packing._pack_in_processes
    monkeypatch.setattr(packing, "_pack_in_processes", lambda *a: started.append(a[5]) or real(*a))
    many = cpu_cores() + 62
    run_pack(None, folder_data(folder), str(tmp_path / "shards"), None, 256.0, many)
    note = capsys.readouterr().err
    assert f"multicard: --workers {many} is more than the {cpu_cores()} core(s)" in note
    assert started == [cpu_cores()]
