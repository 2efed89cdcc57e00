"""`multicard pack --out s3://…` against a real S3-protocol server on loopback (conftest.s3_server,
moto's): the objects are the bytes of the same pack on local disk, the index is uploaded last (the commit),
a pack killed (-9) anywhere among its uploads is refused by readers, and the same command run again
completes it without uploading again what is there whole.

The pack: 40 + 10 synthetic 16 px images in 13 shards of ~11 KiB (14 uploads with the index).
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import S3_SECRET
from multicard.base.config import load_config
from multicard.base.errors import UserError
from multicard.cli.main import main
from multicard.data import read_splits
from multicard.data.sources import shard_format
from multicard.data.sources.shard_format import INDEX
from multicard.tools.pack import PackOptions, pack, run_pack, staging_folder

BUCKET = "packed-out"
DATA = ["data.train_size=40", "data.val_size=10", "data.image_size=16"]
SHARD_MB = 0.01
KILL_POINTS = 10


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same pack on local disk."""
    d = load_config(None, DATA).data
    out = tmp_path_factory.mktemp("local") / "shards"
    pack(d, read_splits(d, 0), PackOptions(out, shard_mb=SHARD_MB, workers=1))
    return out


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    """This process's environment pointed at the server, the staging folders under tmp_path, and the
    server's bucket BUCKET as an s3fs filesystem to look at the objects."""
    import fsspec

    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fs = fsspec.filesystem(
        "s3", key=s3_server["AWS_ACCESS_KEY_ID"], secret=S3_SECRET, skip_instance_cache=True,
        client_kwargs={"endpoint_url": s3_server["AWS_ENDPOINT_URL"]},
    )  # fmt: skip
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    return fs


def objects(fs, url: str) -> dict[str, bytes]:
    prefix = url.removeprefix("s3://")
    fs.invalidate_cache()
    return {path.rsplit("/", 1)[-1]: fs.cat_file(path) for path in fs.ls(prefix, detail=False)} if fs.exists(
        prefix) else {}  # fmt: skip


def local_files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def pack_to(url: str) -> str:
    return run_pack(None, DATA, url, None, SHARD_MB, 1)


def shards_config(root: str | Path):
    return load_config(None, ["data.name=shards", f"data.root={root}"]).data


def md5s(fs, url: str) -> dict[str, str]:
    """name → MD5 of each object under the URL, as the server computed it (its ETag), in one listing."""
    prefix = url.removeprefix("s3://")
    fs.invalidate_cache()
    listing = fs.ls(prefix, detail=True) if fs.exists(prefix) else []
    return {entry["name"].rsplit("/", 1)[-1]: entry["ETag"].strip('"') for entry in listing}


def samples(root: str | Path) -> list[tuple[bytes, int]]:
    splits = read_splits(shards_config(root), 0)
    items = [source.dataset[i] for source in (splits.train, splits.val) for i in range(len(source))]
    return [(image.data, label) for image, label in items]


@pytest.mark.slow
def test_pack_out_s3_writes_the_bytes_of_the_local_pack_index_last(s3, reference, capsys, monkeypatch):
    url = f"s3://{BUCKET}/cifar"
    uploads = recorded_uploads(monkeypatch)
    assert main(["pack", "--out", url, *DATA, "--shard-mb", str(SHARD_MB), "--workers", "1"]) == 0
    assert "into 13 shard(s) in s3://packed-out/cifar (index.json uploaded last)" in capsys.readouterr().out
    assert uploads[-1] == INDEX and sorted(uploads) == sorted(local_files(reference))  # each once, the index last
    assert objects(s3, url) == local_files(reference)
    assert samples(url) == samples(reference)
    assert not staging_folder(url).exists()  # the staging folder goes once the index is up
    uploads.clear()
    assert pack_to(url) == (  # nothing packed or uploaded again
        f"{url} already holds this pack (50 samples); multicard pack --verify {url} checks it"
    )
    assert uploads == []
    capsys.readouterr()
    assert "into 4 shard(s)" in run_pack(None, DATA, url, None, 4 * SHARD_MB, 1)  # other options: replaced
    assert f"replacing the pack in {url}: it was made from another source or other options" in capsys.readouterr().err
    assert uploads[-1] == INDEX and sorted(objects(s3, url)) == sorted(uploads)  # the old shards removed


@pytest.mark.slow
def test_pack_verify_url_checks_the_objects_and_names_a_changed_shard(s3, reference, capsys):
    url = f"s3://{BUCKET}/verified"
    s3.put(f"{reference}/", f"{BUCKET}/verified/", recursive=True)
    assert main(["pack", "--verify", url]) == 0
    assert f"{url}: 50 samples in 13 shard(s) verified" in capsys.readouterr().out
    size = s3.size(f"{BUCKET}/verified/train-00001.tar")
    s3.pipe(f"{BUCKET}/verified/train-00001.tar", bytes(size))  # the same size, other bytes
    assert main(["pack", "--verify", url]) == 2
    assert capsys.readouterr().err.strip() == (
        f"multicard: error: shard {url}/train-00001.tar does not hold what was packed (its checksum differs); "
        f"pack again"
    )


def _killed_at(url: str, point: int) -> int:
    """Run the pack in a child process that kills itself (SIGKILL) at `point`: before upload request
    point // 2 (even points) or after it (odd ones). The number of uploads it finished."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: count the uploads, die at the point
        os.close(read)
        torch.set_num_threads(1)  # the parent's thread pool does not survive a fork: the synthetic images need none
        done = [0]
        real = shard_format.upload_object

        def upload(remote, local, name):
            if done[0] == point // 2 and point % 2 == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            real(remote, local, name)
            done[0] += 1
            os.write(write, b".")
            if done[0] - 1 == point // 2:
                os.kill(os.getpid(), signal.SIGKILL)

        shard_format.upload_object = upload
        try:
            pack_to(url)
        finally:
            os._exit(3)  # never reached at a point among the uploads
    os.close(write)
    finished = b""
    while chunk := os.read(read, 64):
        finished += chunk
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    return len(finished)


@pytest.mark.slow
def test_pack_killed_at_random_uploads_is_refused_then_a_rerun_completes_it(s3, reference, monkeypatch):
    expected = {name: hashlib.md5(data).hexdigest() for name, data in local_files(reference).items()}
    uploads = len(expected)
    points = sorted(random.Random(35).sample(range(2 * uploads), KILL_POINTS))
    for n, point in enumerate(points):
        url = f"s3://{BUCKET}/killed-{n}"
        if n >= 2:  # the staging folder made already (packing itself is killed in tests/test_shards.py): uploads only
            shutil.copytree(reference, staging_folder(url))
        finished = _killed_at(url, point)
        assert finished == point // 2 + point % 2
        if finished == uploads:  # killed after the index: the pack is whole
            read_splits(shards_config(url), 0)
        else:
            with pytest.raises(UserError) as refused:
                read_splits(shards_config(url), 0)
            assert "\n" not in str(refused.value) and INDEX not in md5s(s3, url)
            if finished:
                assert str(refused.value) == (
                    f"data.root={url} holds an unfinished pack (shards, but no index.json yet: it is uploaded "
                    f"last); run the multicard pack --out {url} that wrote it again to finish it"
                )
        if n in (0, 5):  # the staging folder lost (another machine): made again, the same bytes
            shutil.rmtree(staging_folder(url), ignore_errors=True)
        there = md5s(s3, url)
        if n == len(points) - 1 and finished:  # a shard of the right size but other bytes is uploaded again
            name = sorted(there)[0]
            s3.pipe(f"{BUCKET}/killed-{n}/{name}", bytes(s3.size(f"{BUCKET}/killed-{n}/{name}")))
            there[name] = ""
        with monkeypatch.context() as patch:
            resumed = recorded_uploads(patch)
            pack_to(url)
        assert sorted(resumed) == sorted(name for name in expected if there.get(name) != expected[name]), point
        assert md5s(s3, url) == expected  # the objects are the local pack's bytes, the index among them
    read_splits(shards_config(url), 0)  # which a reader takes (the test of pack --out s3:// above reads the samples)


def recorded_uploads(monkeypatch) -> list[str]:
    """The names of the objects this process uploads from now on, in order."""
    uploads: list[str] = []
    real = shard_format.upload_object
    monkeypatch.setattr(shard_format, "upload_object", lambda remote, local, name: uploads.append(name)
                        or real(remote, local, name))  # fmt: skip
    return uploads


def test_pack_out_a_url_of_an_unknown_scheme_a_missing_bucket_or_other_objects_is_one_line(
        s3, tmp_path, monkeypatch):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"^--out=nosuch://b/p: nosuch:// is no storage protocol fsspec knows"):
        pack_to("nosuch://b/p")
    with pytest.raises(UserError, match=r"^s3://no-such-bucket/p does not exist \(FileNotFoundError: "):
        pack_to("s3://no-such-bucket/p")
    s3.pipe(f"{BUCKET}/other/notes.txt", b"not a pack")
    with pytest.raises(UserError) as refused:
        pack_to(f"s3://{BUCKET}/other")
    assert str(refused.value) == (
        f"--out s3://{BUCKET}/other holds files that are no pack's (notes.txt); choose a new or empty folder"
    )
    assert objects(s3, f"s3://{BUCKET}/other") == {"notes.txt": b"not a pack"}
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing staged, no folder named after a scheme
