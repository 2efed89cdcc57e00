"""Packed shards read from object storage (`data.name=shards data.root=s3://…`),
against a real S3-protocol server on loopback (conftest.s3_server, moto's): the same training as from
local disk, and every failure of storage one line, after bounded retries where another attempt may help.

The pack: 192 + 50 synthetic images in several shards, made here and uploaded as they are.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from conftest import (
    S3_SECRET,
    assert_bitwise_equal,
    cli,
    final_params,
    load_checkpoint,
    run_here,
    s3_environment,
    slowed,
    start,
    wait_for,
)
from multicard.base import storage, store
from multicard.base.config import load_config
from multicard.base.errors import UserError
from multicard.base.store import open_store
from multicard.checkpoint import checkpoints_in
from multicard.cli.main import main
from multicard.data import read_splits
from multicard.data.sources.shards import INDEX
from multicard.tools.pack import PackOptions, pack

BUCKET = "packs"
TRAIN = [
    "model.name=smallcnn", "data.image_size=16", "data.crop_padding=2", "train.epochs=1",
    "train.global_batch_size=32", "log_every=2", "data.loader=workers", "data.num_workers=1", "data.name=shards",
]  # fmt: skip


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("multicard: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    d = load_config(None, ["data.train_size=192", "data.val_size=50", "data.image_size=16"]).data
    out = tmp_path_factory.mktemp("pack") / "shards"
    pack(d, read_splits(d, 0), PackOptions(out, shard_mb=0.03, workers=1))
    assert len(list(out.glob("train-*.tar"))) > 2  # reads cross shard objects
    return out


@pytest.fixture(scope="module")
def bucket(s3_server):
    """The server's bucket BUCKET, as an s3fs filesystem to put objects in."""
    import fsspec

    fs = fsspec.filesystem(
        "s3", key=s3_server["AWS_ACCESS_KEY_ID"], secret=S3_SECRET, skip_instance_cache=True,
        client_kwargs={"endpoint_url": s3_server["AWS_ENDPOINT_URL"]},
    )  # fmt: skip
    fs.mkdir(BUCKET)
    return fs


@pytest.fixture(scope="module")
def uploaded(bucket, packed) -> str:
    """The pack's URL on the server, its files uploaded as they are."""
    bucket.put(f"{packed}/", f"{BUCKET}/pack/", recursive=True)
    return f"s3://{BUCKET}/pack"




class Server:
    """A second server on loopback, to stop and start: moto keeps its buckets per process, so it
    serves what the session's server holds."""

    def __init__(self, port: int = 0) -> None:
        from moto.server import ThreadedMotoServer

        self.running = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.running.start()
        self.port = self.running.get_host_and_port()[1]

    def stop(self) -> None:
        self.running.stop()


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp2_workers_training_from_the_s3_server_equals_training_from_local_disk(packed, uploaded, s3_server,
                                                                                        tmp_path):  # fmt: skip
    ddp2 = ["--nproc-per-node", "2"]
    run_here("train", *ddp2, *TRAIN, f"data.root={packed}", f"out_dir={tmp_path / 'local'}")
    console = run_here("train", *ddp2, *TRAIN, f"data.root={uploaded}", f"out_dir={tmp_path / 's3'}", env=s3_server)
    assert_bitwise_equal(final_params(tmp_path / "s3"), final_params(tmp_path / "local"))
    config = (tmp_path / "s3" / "config.yaml").read_text()
    assert f"root: {uploaded}" in config
    for text in (config, (tmp_path / "s3" / "metrics.jsonl").read_text(), console):
        assert S3_SECRET not in text and s3_server["AWS_ACCESS_KEY_ID"] not in text


@pytest.mark.slow
def test_a_missing_bucket_or_pack_is_one_line_at_once(bucket, uploaded, s3_env, waits, tmp_path, capsys):
    assert main(["train", *TRAIN, "data.root=s3://no-such-bucket/pack", f"out_dir={tmp_path}"]) == 2
    said = "s3://no-such-bucket/pack does not exist (FileNotFoundError: The specified bucket does not exist); check"
    assert said in one_line(capsys.readouterr().err)
    assert not checkpoints_in(tmp_path / "checkpoints")
    bucket.pipe(f"{BUCKET}/broken/{INDEX}", b"{not json")
    for root, said in ((f"s3://{BUCKET}/elsewhere", f"data.root=s3://{BUCKET}/elsewhere has no index.json; make it "
                        f"with multicard pack --out s3://{BUCKET}/elsewhere"),
                       (f"s3://{BUCKET}", f"data.root=s3://{BUCKET} has no index.json: it is not a folder multicard "
                        "pack wrote"),
                       (f"s3://{BUCKET}/broken", f"index s3://{BUCKET}/broken/index.json cannot be read "
                        "(JSONDecodeError); pack the data again"),
                       ("s3://Bad_Bucket!/pack", "cannot read s3://Bad_Bucket!/pack (ParamValidationError: Parameter "
                        "validation failed: Invalid bucket name")):  # fmt: skip
        with pytest.raises(UserError) as refused:
            read_splits(load_config(None, ["data.name=shards", f"data.root={root}"]).data, 0)
        assert said in str(refused.value)
    assert waits == []  # no retry: another attempt would find no more


@pytest.mark.slow
def test_wrong_credentials_are_one_line_at_once(uploaded, s3_env, waits, monkeypatch):
    endpoint = s3_env["AWS_ENDPOINT_URL"]

    def authenticate(count: str) -> None:  # moto's switch: check signatures from now on ("0"), or never ("inf")
        request = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", count.encode(), method="POST",
                                         headers={"Content-Type": "text/plain"})  # fmt: skip
        urllib.request.urlopen(request, timeout=10).read()

    authenticate("0")
    try:
        with pytest.raises(UserError) as refused:
            read_splits(load_config(None, ["data.name=shards", f"data.root={uploaded}"]).data, 0)
    finally:
        authenticate("inf")
    message = str(refused.value)
    assert message.startswith(f"cannot read {uploaded}: access denied (PermissionError: ")
    assert "check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)" in message
    assert S3_SECRET not in message and waits == []


@pytest.mark.slow
def test_a_transient_failure_is_retried_with_backoff(uploaded, packed, s3_env, waits, monkeypatch):
    """The server down at the first attempt and up again during the first wait: the read succeeds.
    Down for good: one line after the bounded retries, 0.5 s, 1 s, 2 s apart."""
    server = Server()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_environment(server.port)["AWS_ENDPOINT_URL"])
    monkeypatch.setattr(store, "SESSIONS", {})  # sessions to this server
    server.stop()
    remote = open_store(uploaded, retries=3)
    restarted: list[Server] = []

    def wait_and_restart(seconds: float) -> None:
        waits.append(seconds)
        if not restarted:
            restarted.append(Server(server.port))

    monkeypatch.setattr(storage, "sleep", wait_and_restart)
    try:
        assert remote.read(INDEX) == (packed / INDEX).read_bytes()
    finally:
        for again in restarted:
            again.stop()
    assert waits == [storage.FIRST_WAIT_S] and len(restarted) == 1
    monkeypatch.setattr(storage, "sleep", waits.append)
    waits.clear()
    with pytest.raises(
        UserError,
        match=rf"cannot read {uploaded}/train-00000.tar \(EndpointConnectionError: .* "
        r"after 4 attempt\(s\) over 3.5 s; check that the storage endpoint is up",
    ):
        remote.read("train-00000.tar", 0, 512)
    assert waits == [0.5, 1.0, 2.0]
    # What s3fs raises for SlowDown / 503 and InternalError / 500 is transient too; absence and refusal are not.
    assert storage.transient(OSError(errno.EBUSY, "Please reduce your request rate"))
    assert storage.transient(OSError(errno.EREMOTEIO, "We encountered an internal error"))
    assert not storage.transient(FileNotFoundError("bucket/key")) and not storage.transient(PermissionError("denied"))


@pytest.mark.slow
def test_the_server_stopping_mid_run_is_one_line_after_bounded_retries_and_keeps_the_checkpoint(
        uploaded, s3_server, tmp_path):  # fmt: skip
    server = Server()
    env = {**s3_environment(server.port), **slowed(200, rank=0)}
    run = start("train", *TRAIN, f"data.root={uploaded}", "train.epochs=3", "checkpoint.every_steps=2",
                "data.read_retries=1", f"out_dir={tmp_path}", env=env)  # fmt: skip
    try:
        wait_for(lambda: bool(checkpoints_in(tmp_path / "checkpoints")), what="the first checkpoint")
    finally:
        server.stop()
    stopped = time.monotonic()
    out, err = run.communicate(timeout=120)
    assert run.returncode == 2, err
    line = one_line(err)
    assert f"cannot read {uploaded}/" in line and "after 2 attempt(s) over 0.5 s" in line, line
    assert time.monotonic() - stopped < 30  # bounded: the retries' 0.5 s, then the run's end
    assert S3_SECRET not in out + err
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["step"] >= 2  # the last good one, intact


@pytest.mark.slow
def test_an_unknown_scheme_or_a_missing_package_is_one_line_naming_what_to_install(tmp_path, monkeypatch,
                                                                                         capsys):  # fmt: skip
    pytest.importorskip("fsspec")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "data.name=shards", "data.root=nosuch://b/pack"]) == 2
    said = "data.root=nosuch://b/pack: nosuch:// is no storage protocol fsspec knows"
    assert said in one_line(capsys.readouterr().err)
    assert main(["train", "data.name=shards", "data.root=s3://"]) == 2
    said = "data.root=s3:// names no location; give the bucket and prefix, e.g. s3://bucket/prefix"
    assert said in one_line(capsys.readouterr().err)
    if importlib.util.find_spec("gcsfs") is None:
        assert main(["train", "data.name=shards", "data.root=gs://b/pack"]) == 2
        said = "data.root=gs://b/pack needs gcsfs (fsspec's gs:// protocol): pip install fsspec gcsfs"
        assert said in one_line(capsys.readouterr().err)
    hidden = tmp_path / "hidden"  # an s3fs that cannot be imported, ahead of the real one
    (hidden / "s3fs").mkdir(parents=True)
    (hidden / "s3fs" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 's3fs'\")\n")
    result = cli("train", "data.name=shards", "data.root=s3://b/pack", env={"PYTHONPATH": str(hidden)})
    assert result.returncode == 2
    assert "needs s3fs (fsspec's s3:// protocol): pip install 'multicard[s3]'" in one_line(result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hidden"]  # no folder named after a scheme


def test_credentials_in_a_url_are_refused_without_being_repeated():
    with pytest.raises(UserError) as refused:
        load_config(None, ["data.name=shards", "data.root=s3://AKIAEXAMPLE:hunter2@bucket/pack"])
    message = str(refused.value)
    assert message.startswith("data.root=s3://…@bucket/pack holds credentials")
    assert "hunter2" not in message and "AKIAEXAMPLE" not in message


@pytest.mark.slow
def test_a_forked_loader_process_opens_its_own_session(uploaded, s3_env):
    samples = read_splits(load_config(None, ["data.name=shards", f"data.root={uploaded}"]).data, 0).train.dataset
    first = samples[0][0].data
    parent = samples.store.fs()[0]
    pid = os.fork()
    if pid == 0:
        same = samples[0][0].data == first
        os._exit(0 if same and samples.store.fs()[0] is not parent and samples.store._pid == os.getpid() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.slow
@pytest.mark.parametrize("whole", [True, False], ids=["whole-shards", "ranged"])
def test_a_split_that_fits_is_read_in_whole_shards_once_per_process(packed, uploaded, s3_env, monkeypatch,
                                                                          whole):  # fmt: skip
    """A request costs the loader ~4 ms of CPU, and a shuffled batch holds no neighbours: a split of at most
    WHOLE_SPLIT_BYTES is read in whole shards (pieces of PIECE_BYTES), once per process; a larger one by
    ranged reads, one per run of neighbours. The same bytes as from local disk either way."""
    from multicard.data.sources import shards

    monkeypatch.setattr(shards, "WHOLE_SPLIT_BYTES", shards.WHOLE_SPLIT_BYTES if whole else 0)
    monkeypatch.setattr(shards, "PIECE_BYTES", 4096)  # several pieces per shard
    shards = load_config(None, ["data.name=shards", f"data.root={uploaded}"]).data
    remote = read_splits(shards, 0).train.dataset
    local = read_splits(load_config(None, ["data.name=shards", f"data.root={packed}"]).data, 0).train.dataset
    requests: list[tuple] = []
    read = remote.store.read
    monkeypatch.setattr(remote.store, "read", lambda *args: requests.append(args) or read(*args))
    batch = [int(i) for i in np.random.default_rng(0).permutation(len(local))[:64]]
    for _ in range(2):  # a second batch of the same samples: whole shards are not read again
        remote.prefetch(batch)
        assert [remote[i][0].data for i in batch] == [local[i][0].data for i in batch]
    touched = {int(local.shard_of[i]) for i in batch}
    if whole:
        pieces = sum(-(-local.split.shard_bytes[s] // 4096) for s in touched)
        assert len(requests) == pieces and {name for name, *_ in requests} == {remote.names[s] for s in touched}
    else:
        assert len(requests) == 2 * len(remote._runs(batch))  # every batch read again


def _reader(root: str, *options: str):
    """A new reader of the training split (another loader process, or a later run), its shard requests counted."""
    source = read_splits(load_config(None, ["data.name=shards", f"data.root={root}", *options]).data, 0).train.dataset
    source.requests = []
    read = source.store.read
    source.store.read = lambda *args: source.requests.append(args[0]) or read(*args)
    return source


def _read_all(source, local) -> None:
    """Every sample prefetched and taken: the same bytes as the pack on local disk."""
    everything = [int(i) for i in np.random.default_rng(1).permutation(len(local))]
    source.prefetch(everything)
    assert [source[i][0].data for i in everything] == [local[i][0].data for i in everything]


@pytest.mark.parametrize("whole", [True, False], ids=["whole-shards", "ranged"])
def test_a_local_cache_serves_later_readers_without_a_request(packed, uploaded, s3_env, monkeypatch, tmp_path,
                                                                    whole):  # fmt: skip
    """data.remote_cache_gb: shards downloaded whole once on the node; a later reader (another loader process,
    a later run) reads them from local disk, with the same bytes; a split larger than WHOLE_SPLIT_BYTES is
    then read from the cached files rather than by ranged requests."""
    from multicard.data.sources import shards

    monkeypatch.setattr(shards, "WHOLE_SPLIT_BYTES", shards.WHOLE_SPLIT_BYTES if whole else 0)
    local = read_splits(load_config(None, ["data.name=shards", f"data.root={packed}"]).data, 0).train.dataset
    options = ("data.remote_cache_gb=1", f"data.cache_dir={tmp_path}")
    first = _reader(uploaded, *options)
    _read_all(first, local)
    assert sorted(set(first.requests)) == sorted(first.names)  # each shard downloaded whole
    assert len(first.requests) == len(first.names)  # once (in one piece: they are smaller than PIECE_BYTES)
    cached = sorted((tmp_path / "remote-shards").glob("*.tar"))
    assert sorted(path.stat().st_size for path in cached) == sorted(local.split.shard_bytes)
    later = _reader(uploaded, *options)
    _read_all(later, local)
    _read_all(later, local)  # and a second epoch
    assert later.requests == []


def test_the_local_cache_stays_within_its_bound_least_recently_used_evicted(packed, uploaded, s3_env,
                                                                                   tmp_path):  # fmt: skip
    """At most data.remote_cache_gb on disk: older shards are evicted as newer ones are stored, the evicted
    read again from the URL by a later reader, the cached ones not; a shard larger than the bound is not cached."""
    local = read_splits(load_config(None, ["data.name=shards", f"data.root={packed}"]).data, 0).train.dataset
    sizes = local.split.shard_bytes
    bound = sum(sorted(sizes)[-2:])  # room for any two shards, not for all
    options = (f"data.remote_cache_gb={bound / 2**30:.12f}", f"data.cache_dir={tmp_path}")
    first = _reader(uploaded, *options)
    assert first.cache.max_bytes == bound  # the GB given, to the byte
    for shard in range(len(sizes)):  # one shard after another: the order of use is the shards' order
        first[int(np.flatnonzero(local.shard_of == shard)[0])]
    folder = tmp_path / "remote-shards"
    kept = {path.name for path in folder.glob("*.tar")}
    assert sum(path.stat().st_size for path in folder.iterdir()) <= first.cache.max_bytes
    assert f"{first.keys[-1]}.tar" in kept and f"{first.keys[0]}.tar" not in kept  # the newest kept, the oldest not
    later = _reader(uploaded, *options)
    _read_all(later, local)
    evicted = {name for name, key in zip(later.names, later.keys, strict=True) if f"{key}.tar" not in kept}
    assert set(later.requests) == evicted and evicted
    tiny = _reader(uploaded, "data.remote_cache_gb=0.000000001", f"data.cache_dir={tmp_path / 'tiny'}")
    _read_all(tiny, local)
    assert not list((tmp_path / "tiny").rglob("*.tar"))  # every shard larger than 1 byte: none cached


def test_a_negative_remote_cache_size_is_refused():
    with pytest.raises(UserError, match=r"data.remote_cache_gb=-1.0 must be >= 0"):
        load_config(None, ["data.remote_cache_gb=-1.0"])


# ------------------------------------------------------------------ every form of a location, wherever one is given

ONE_SLASH = {  # every place a path or URL is given: the setting, given with one slash after the scheme
    "data.root": ["train", "data.name=shards", "data.root=s3:/b/pack"],
    "checkpoint.dir": ["train", "checkpoint.dir=s3:/b/ck"],
    "train.resume": ["train", "train.resume=S3:/b/ck/last"],
    "model.weights": ["train", "model.weights=gs:b/model.pt"],
    "out_dir": ["train", "out_dir=s3:/b/run"],
    "data.cache_dir": ["train", "data.cache_dir=file:/cache"],
    "eval --checkpoint": ["eval", "--checkpoint", "s3:/b/ck/last"],
    "export --checkpoint": ["export", "--checkpoint", "s3:/b/ck/last", "--out", "m.pt"],
    "pack --out": ["pack", "--out", "s3:/b/pack", "data.train_size=8", "data.val_size=4"],
    "pack --verify": ["pack", "--verify", "s3:/b/pack"],
}


@pytest.mark.parametrize("where", ONE_SLASH, ids=lambda where: where.replace(" ", ""))
def test_a_url_with_one_slash_is_one_line_naming_the_url_meant_never_a_local_folder(where, tmp_path, monkeypatch,
                                                                                    capsys):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert main(ONE_SLASH[where]) == 2
    line = one_line(capsys.readouterr().err)
    given = next(arg for arg in ONE_SLASH[where] if ":/" in arg or ":b/" in arg).split("=")[-1]
    meant = {"S3:/b/ck/last": "s3://b/ck/last", "gs:b/model.pt": "gs://b/model.pt", "file:/cache": "file:///cache"}
    assert f"{given} is neither a URL nor a local path" in line
    assert f"give {meant.get(given, given.replace(':/', '://'))}" in line and "pack --out s3:/" not in line, line
    assert list(tmp_path.iterdir()) == []  # no ./s3:/… folder, nor a run's


def test_an_upper_case_scheme_and_a_file_url_are_read_as_the_url_and_the_path_they_name(tmp_path):
    absolute = tmp_path / "abs"
    cfg = load_config(None, ["data.name=shards", "data.root=S3://Bucket/Pack/", "checkpoint.dir=S3A://b/ck",
                             "train.resume=s3://b/ck/last", f"model.weights=file://{absolute}/m.pt",
                             f"out_dir=file://{absolute}/run", f"data.cache_dir=FILE://{absolute}/cache"])  # fmt: skip
    assert (cfg.data.root, cfg.checkpoint.dir, cfg.train.resume) == ("s3://Bucket/Pack", "s3a://b/ck", "s3://b/ck/last")
    assert (cfg.model.weights, cfg.out_dir, cfg.data.cache_dir) == (f"{absolute}/m.pt", f"{absolute}/run",
                                                                   f"{absolute}/cache")  # fmt: skip
    with pytest.raises(UserError, match=r"^checkpoint.dir=file://ck: a file:// URL names an absolute path after its "
                                        r"two slashes \(file:///abs/path\); give file:///ck or the path itself$"):
        load_config(None, ["checkpoint.dir=file://ck"])


@pytest.mark.slow
def test_pack_verify_and_data_root_read_a_pack_by_an_upper_case_scheme(uploaded, s3_env, capsys):
    upper = uploaded.replace("s3://", "S3://")
    assert main(["pack", "--verify", upper]) == 0
    assert f"{uploaded}: 242 samples in" in capsys.readouterr().out
    splits = read_splits(load_config(None, ["data.name=shards", f"data.root={upper}"]).data, 0)
    assert len(splits.train) == 192 and splits.train.dataset.store.url == uploaded


def test_an_hdfs_url_without_a_jvm_is_one_line_naming_what_to_install(tmp_path, monkeypatch, capsys):
    """pyarrow's HDFS loads the JVM when its filesystem is made: without one, every place that reads or
    writes the URL says so in one line (or, without pyarrow, names the package to install)."""
    monkeypatch.chdir(tmp_path)
    for command in (["pack", "--verify", "hdfs://namenode/pack"],
                    ["train", "data.name=shards", "data.root=hdfs://namenode/pack"],
                    ["train", "checkpoint.dir=hdfs://namenode/ck", f"out_dir={tmp_path / 'run'}"],
                    ["eval", "--checkpoint", "hdfs://namenode/ck/last"]):  # fmt: skip
        assert main(command) == 2
        line = one_line(capsys.readouterr().err)
        assert "hdfs://namenode/" in line and "install" in line, line
        assert "Java runtime" in line or "pip install fsspec pyarrow" in line, line


@pytest.mark.parametrize("whole", [True, False], ids=["whole-shards", "cached-files"])
def test_a_cached_shard_changed_on_disk_is_named_and_read_again_never_used(packed, uploaded, s3_env, monkeypatch,
                                                                           tmp_path, capsys, whole):  # fmt: skip
    """data.remote_cache_gb checks every cached byte it uses against the index's sha256 of the shard: a
    cache file changed on disk (the same size, two bytes changed) is named, as the cache's file and not
    the bucket's object, removed and read from the URL again; the samples are the pack's."""
    from multicard.data.sources import shards

    monkeypatch.setattr(shards, "WHOLE_SPLIT_BYTES", shards.WHOLE_SPLIT_BYTES if whole else 0)
    local = read_splits(load_config(None, ["data.name=shards", f"data.root={packed}"]).data, 0).train.dataset
    options = ("data.remote_cache_gb=1", f"data.cache_dir={tmp_path}")
    _read_all(_reader(uploaded, *options), local)
    later = _reader(uploaded, *options)
    changed = tmp_path / "remote-shards" / f"{later.keys[1]}.tar"
    data = bytearray(changed.read_bytes())
    data[600:602] = bytes([data[600] ^ 0xFF, data[601] ^ 0xFF])  # inside the first image's bytes
    changed.write_bytes(bytes(data))
    capsys.readouterr()
    _read_all(later, local)
    assert later.requests == [later.names[1]]  # that shard alone read again
    warned = capsys.readouterr().err.strip().splitlines()
    assert warned == [f"multicard: warning: cached shard {changed} (of {uploaded}/{later.names[1]}) was changed on "
                      f"disk: its checksum is not the one the pack's index gives; removed, and {uploaded}/"
                      f"{later.names[1]} read again"]  # fmt: skip
    assert changed.read_bytes() == (packed / later.names[1]).read_bytes()  # cached again, as packed


def test_a_bucket_object_that_is_not_what_was_packed_is_refused_naming_it(packed, bucket, s3_env, tmp_path):
    """Whole shards downloaded are checked against the index too: an object of the right size but other
    bytes is the bucket's to blame, in one line, before any of it is used or cached."""
    bucket.put(f"{packed}/", f"{BUCKET}/altered/", recursive=True)
    name = sorted(p.name for p in packed.glob("train-*.tar"))[0]
    bucket.pipe(f"{BUCKET}/altered/{name}", bytes(bucket.size(f"{BUCKET}/altered/{name}")))
    reader = _reader(f"s3://{BUCKET}/altered", "data.remote_cache_gb=1", f"data.cache_dir={tmp_path}")
    with pytest.raises(UserError) as refused:
        reader[int(np.flatnonzero(reader.shard_of == 0)[0])]
    assert str(refused.value) == (
        f"shard s3://{BUCKET}/altered/{name} does not hold what was packed (its checksum is not the one the index "
        f"gives); restore it or upload the pack again (multicard pack --verify s3://{BUCKET}/altered checks it)"
    )
    assert not list((tmp_path / "remote-shards").glob("*.tar"))
