"""`multicard input-split`: where a loader's time goes, and the one line that says what to change.

A reader made slow on purpose (a dataset function whose reads wait, no FUSE needed) is attributed
to storage reads and told to pack; shards on local disk are not. Where this machine can build the
real network filesystem (root, sshfs: ../shared/tools/sharedfs.sh), an image folder read across it
without a cache is attributed to storage reads too.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT, cli
from multicard.tools.input_split import BOUND, RankSplit, recommend

CLASSES = ("a", "b")
COMMON = ["model.name=smallcnn", "data.image_size=16", "train.global_batch_size=8", "data.num_workers=1",
          "--batches", "2"]  # fmt: skip
SHAREDFS = ROOT.parent / "shared" / "tools" / "sharedfs.sh"

# Items read through a file object whose every read waits READ_MS: storage with a round trip per read.
SLOW = """
import time
from pathlib import Path

READ_MS = 20


class SlowFile:
    def __init__(self, path):
        self.path = path

    def read(self):
        time.sleep(READ_MS / 1000)
        return self.path.read_bytes()


class Photos:
    def __init__(self, root):
        self.paths = sorted(Path(root).glob("*/*.jpg"))
        self.classes = sorted({p.parent.name for p in self.paths})

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return SlowFile(self.paths[i]).read(), self.classes.index(self.paths[i].parent.name)


def photos(split, root):
    return Photos(Path(root) / "train") if split == "train" else None
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("split")
    rng = np.random.default_rng(0)
    for name in CLASSES:
        (root / "train" / name).mkdir(parents=True)
        for k in range(24):
            pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "train" / name / f"{k:03d}.jpg", quality=90)
    (root / "code").mkdir()
    (root / "code" / "slowdata.py").write_text(SLOW)
    return root


def split_lines(*args: str, env: dict | None = None) -> list[str]:
    result = cli("input-split", *COMMON, *args, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()


def read_share(line: str) -> float:
    return float(line.split("read ", 1)[1].split("(", 1)[1].split("%", 1)[0]) / 100


@pytest.mark.slow
def test_a_slow_reader_is_attributed_to_storage_reads_and_told_to_pack(folder):
    rank, advice = split_lines("data.name=slowdata:photos", f"data.kwargs={{root: {folder}}}",
                               env={"PYTHONPATH": str(folder / "code")})  # fmt: skip
    assert rank.startswith("rank 0: per micro-batch of 8 with 1 loader process(es): read ")
    assert read_share(rank) > 0.5
    assert "read takes" in advice and "pack the dataset into shards (multicard pack)" in advice


@pytest.mark.slow
def test_shards_on_local_disk_are_not_attributed_to_reads(tmp_path):
    # Photos that take a decode's time (224 px PNGs, ~1 ms each): against 32 px JPEGs (~0.1 ms), a
    # batch's read from the page cache weighs as much as the thread wake-ups of a loaded machine.
    rng = np.random.default_rng(1)
    for name in CLASSES:
        (tmp_path / "photos" / "train" / name).mkdir(parents=True)
        for k in range(8):
            pixels = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "photos" / "train" / name / f"{k:03d}.png")
    packed = tmp_path / "shards"
    photos = f"data.root={tmp_path / 'photos'}"
    assert cli("pack", "--out", str(packed), "data.name=imagefolder", photos).returncode == 0
    rank, advice = split_lines("data.name=shards", f"data.root={packed}")
    assert read_share(rank) < 0.5 and "multicard pack" not in advice, rank


def test_recommendation_follows_the_largest_stage():
    def split(read: float, decode: float, augment: float, step: float = 0.001) -> RankSplit:
        return RankSplit(0, 64, 32, 2, {"read": read, "decode": decode, "augment": augment, "to_device": 0.0}, step)

    assert "pack the dataset into shards" in recommend(split(1.0, 0.1, 0.1), "imagefolder", True, False)
    assert "data.reads_in_flight" in recommend(split(1.0, 0.1, 0.1), "shards", True, False)
    assert "data.loader=device" in recommend(split(0.1, 1.0, 0.1), "shards", True, False)
    assert "data.decode=gpu" in recommend(split(0.1, 1.0, 0.1), "imagefolder", False, True)
    assert "data.num_workers=2 now" in recommend(split(0.1, 0.1, 1.0), "imagefolder", False, False)
    assert "input is not the limit" in recommend(split(0.01, 0.01, 0.01, step=1.0), "imagefolder", True, False)


@pytest.fixture
def mount(tmp_path):
    """The real network filesystem (1 Gbit/s, no cache) at tmp_path/mnt, where this machine can build it."""
    if not SHAREDFS.is_file() or shutil.which("sshfs") is None or not Path("/usr/sbin/sshd").exists():
        pytest.skip("needs ../shared/tools/sharedfs.sh, sshfs and sshd (apt-get install -y openssh-server sshfs)")
    where = tmp_path / "mnt"
    up = subprocess.run(["bash", str(SHAREDFS), "up", str(where), "1gbit", "nocache"], capture_output=True, text=True)
    if up.returncode != 0:
        if "File exists" not in up.stderr:  # not another mount's namespace: undo what this one started
            subprocess.run(["bash", str(SHAREDFS), "down", str(where)], capture_output=True)
        pytest.skip(f"sharedfs could not start here (root and network namespaces needed; or one is up): {up.stderr}")
    yield where
    subprocess.run(["bash", str(SHAREDFS), "down", str(where)], capture_output=True)


@pytest.mark.slow
def test_an_image_folder_on_the_nocache_mount_is_attributed_to_storage_reads(folder, mount):
    rank, advice = split_lines("data.name=imagefolder", f"data.root={mount}{folder}")
    shares = dict(re.findall(r"(read|decode|augment) [0-9.]+ ms \((\d+)%\)", rank))
    assert max(shares, key=lambda stage: int(shares[stage])) == "read", rank  # the largest stage: what advice follows
    # Whether input limits training depends on the model step's time beside it, which a loaded
    # machine stretches: the advice follows the line's own numbers.
    found = re.search(r"input ([0-9.]+) ms against a model step of ([0-9.]+) ms", rank)
    assert found, rank
    limits = float(found[1]) > BOUND * float(found[2])
    assert ("pack the dataset into shards (multicard pack)" in advice) == limits, (rank, advice)
    assert ("input is not the limit" in advice) == (not limits), (rank, advice)
