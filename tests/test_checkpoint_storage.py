"""Checkpoints on object storage (`checkpoint.dir=s3://…`), against a real S3-protocol server
on loopback (conftest.s3_server, moto's): a checkpoint exists only once its commit object, written last,
says so; uploads go on in the background and a stop waits for them; every failure of storage is one line.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import (
    S3_SECRET,
    TINY,
    assert_bitwise_equal,
    max_rel_diff,
    run_here,
    s3_environment,
    slowed,
    start,
    wait_for,
)
from multicard.base import store
from multicard.base.config import Config, load_config, to_dict
from multicard.base.errors import UserError
from multicard.base.store import ObjectStore, open_store
from multicard.checkpoint import Checkpointer, RunFacts, read_checkpoint
from multicard.checkpoint.folder import CheckpointFolder
from multicard.checkpoint.single_file import Upload
from multicard.cli.main import main

BUCKET = "checkpoints"
# Two epochs of 16 steps under a constant LR, in float64 without BatchNorm (so that a run resumed at
# another world size ends as the uninterrupted one, within 1e-10), a checkpoint every 5 steps.
EXACT = [*TINY, "data.train_size=256", "train.epochs=2", "sched.name=constant", "checkpoint.every_steps=3",
         "data.val_size=64", "precision=fp64", "model.kwargs={norm: none}"]  # fmt: skip
STEPS = 2 * 256 // 32


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("multicard: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def bucket(s3_server) -> str:
    """The server's bucket for checkpoints, made once."""
    import fsspec

    fs = fsspec.filesystem(
        "s3", key=s3_server["AWS_ACCESS_KEY_ID"], secret=S3_SECRET, skip_instance_cache=True,
        client_kwargs={"endpoint_url": s3_server["AWS_ENDPOINT_URL"]},
    )  # fmt: skip
    fs.mkdir(BUCKET)
    return BUCKET




def committed_steps(url: str) -> list[int]:
    return [step for step, _ in CheckpointFolder(open_store(url)).steps()]


def newest_readable(url: str):
    return CheckpointFolder(open_store(url)).newest_readable()


def committed_on_the_server(prefix: str) -> bool:
    """Whether a commit object is under `prefix` of BUCKET, asked of the server's memory (moto's, in this
    process) rather than over HTTP: polling by requests would take the server's time from the run."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    keys = s3_backends[DEFAULT_ACCOUNT_ID]["global"].buckets[BUCKET].keys
    return any(key.startswith(prefix) and key.endswith(".commit") for key in list(keys.keys()))


# ------------------------------------------------------------------ a stop, and resume at another world size


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_mid_epoch_with_checkpoints_on_s3_resumes_bitwise_and_at_another_world_size(
        bucket, s3_env, tmp_path):  # fmt: skip
    """One process stopped by SIGTERM mid-epoch with checkpoint.dir on the server; its checkpoint resumed
    by ddp×2 (within 1e-10 of the uninterrupted run) and by one process again (bitwise)."""
    url, other = f"s3://{bucket}/sigterm/checkpoints", f"s3://{bucket}/sigterm-ddp2/checkpoints"
    reference = tmp_path / "reference"
    run_here("train", *EXACT, f"out_dir={reference}")
    proc = start("train", *EXACT, f"checkpoint.dir={url}", f"out_dir={tmp_path / 'run'}",
                 env={**s3_env, **slowed(150, rank=0)})  # fmt: skip
    wait_for(lambda: committed_on_the_server("sigterm/"), what="the first committed checkpoint")
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    stopped = committed_steps(url)[0]
    assert 3 < stopped < STEPS  # written at the stop, mid-run
    said = [line for line in err.splitlines() if "stopped by SIGTERM" in line][0]
    assert f"checkpoint {url}/step-{stopped:09d}.pt written" in said and "(the save took " in said, said
    assert "a save (a stop's too) takes about" in out  # the start-up estimate
    expected = read_checkpoint(reference / "checkpoints" / "last.pt")["model"]

    ddp2 = run_here("train", "--nproc-per-node", "2", *EXACT, f"train.resume={url}/step-{stopped:09d}.pt",
                    f"checkpoint.dir={other}", f"out_dir={tmp_path / 'ddp2'}")  # fmt: skip
    assert f"resumed from {url}/step-{stopped:09d}.pt" in ddp2
    assert max_rel_diff(read_checkpoint(f"{other}/last")["model"], expected) < 1e-10

    resumed = run_here("train", *EXACT, f"checkpoint.dir={url}", f"out_dir={tmp_path / 'run'}")
    assert f"resumed from {url}/step-{stopped:09d}.pt" in resumed
    assert_bitwise_equal(read_checkpoint(f"{url}/last")["model"], expected)
    assert not (tmp_path / "run" / "checkpoints").exists()  # out_dir keeps the logs, the bucket the checkpoints
    for text in (
        out + err + resumed + ddp2,
        *((tmp_path / "run" / name).read_text() for name in ("config.yaml", "metrics.jsonl")),
    ):
        assert S3_SECRET not in text


# ------------------------------------------------------------------ kill -9 while uploading


def _checkpointer(url: str, said: list[str] | None = None) -> Checkpointer:
    """The Checkpointer of one process without a process group, keep_last 2, on checkpoint.dir=url."""
    ctx = SimpleNamespace(is_main=True, is_local_main=True, distributed=False, world_size=1, barrier=lambda: None)
    strategy = SimpleNamespace(ctx=ctx, checkpoint_format="file", barrier=lambda: None, broadcast_object=lambda o: o)
    options = load_config(None, ["checkpoint.keep_last=2", f"checkpoint.dir={url}"]).checkpoint
    say = said.append if said is not None else print
    return Checkpointer(Path("unused"), strategy, options, RunFacts(to_dict(Config()), [], 100, 1), say)


def _writer_process(url: str, kill_at: int | None, count: Path) -> None:
    """In a forked child: a Checkpointer on a tiny state saves steps 1..4 to `url` (keep_last 2, best at
    step 2), each upload in the background; with `kill_at`, SIGKILL at that request to the storage."""
    requests = [0]
    attempt = store.Store.attempt

    def counted(self, *args, **kwargs):
        requests[0] += 1
        if requests[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return attempt(self, *args, **kwargs)

    store.Store.attempt = counted
    checkpointer = _checkpointer(url)
    for step in range(1, 5):
        position = SimpleNamespace(global_step=step, epoch=0, step_in_epoch=step)
        state = {"model": {"w": torch.full((256,), float(step))}, "position": {"global_step": step}}
        loop = SimpleNamespace(set_phase=lambda phase: None, position=position, state_dict=lambda whole, s=state: s)
        checkpointer.save(loop, best=step == 2)
    checkpointer.finish_writing()
    count.write_text(str(requests[0]))


def _forked(url: str, kill_at: int | None, count: Path) -> int:
    """The pid of a forked child that runs _writer_process."""
    pid = os.fork()
    if pid == 0:
        code = 1  # a writer that fails ends 1 with its traceback, so the test says why
        try:
            _writer_process(url, kill_at, count)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _exit_code(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.slow
def test_killing_the_uploader_at_random_requests_leaves_the_newest_committed_checkpoint_whole(
        bucket, s3_env, tmp_path):  # fmt: skip
    count = tmp_path / "requests"
    whole = f"s3://{bucket}/kill/whole"
    assert _exit_code(_forked(whole, None, count)) == 0
    total = int(count.read_text())
    assert committed_steps(whole) == [4, 3, 2]  # keep_last 2, and best
    points = sorted(random.Random(35).sample(range(1, total + 1), 10))
    children = {kill_at: _forked(f"s3://{bucket}/kill/at-{kill_at}", kill_at, count) for kill_at in points}
    assert {kill_at: _exit_code(pid) for kill_at, pid in children.items()} == dict.fromkeys(points, -signal.SIGKILL)
    for kill_at in points:
        url = f"s3://{bucket}/kill/at-{kill_at}"
        newest, meta, skipped = newest_readable(url)  # what train.resume=auto takes
        if newest is None:
            assert kill_at <= 2, kill_at  # killed before the first commit object: nothing to resume
            continue
        step = meta["step"]
        assert newest == f"{url}/step-{step:09d}.pt" and committed_steps(url)[0] == step, kill_at
        assert torch.equal(meta["model"]["w"], torch.full((256,), float(step))), kill_at  # whole, never partial
        assert all(f"step-{step:09d}" not in line for line in skipped)
        said: list[str] = []
        assert _checkpointer(url, said).choose("auto") == newest  # a resumed run: leftovers removed, and said
        folder = CheckpointFolder(open_store(url))
        assert not folder.leftovers(folder.store.listing()) and all(" has no commit object" in line for line in said)


# ------------------------------------------------------------------ one-line errors


@pytest.mark.slow
def test_a_missing_bucket_or_an_unknown_scheme_for_checkpoint_dir_is_one_line(
        s3_env, waits, tmp_path, monkeypatch, capsys):  # fmt: skip
    assert main(["train", *TINY, "checkpoint.dir=s3://no-such-bucket/ck", f"out_dir={tmp_path / 'o'}"]) == 2
    said = "s3://no-such-bucket/ck does not exist (FileNotFoundError: The specified bucket does not exist); check"
    assert said in one_line(capsys.readouterr().err) and waits == []
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "checkpoint.dir=nosuch://b/ck"]) == 2
    said = "checkpoint.dir=nosuch://b/ck: nosuch:// is no storage protocol fsspec knows"
    assert said in one_line(capsys.readouterr().err)
    assert main(["train", *TINY, "out_dir=s3://b/run"]) == 2
    said = "out_dir=s3://b/run is a URL (s3://); out_dir holds the run's logs and stays local: give a local out_dir "
    assert said + "and put the checkpoints on object storage with checkpoint.dir=s3://b/run/checkpoints" in one_line(
        capsys.readouterr().err
    )
    assert main(["eval", "--checkpoint", "nosuch://b/ck/last"]) == 2
    assert "--checkpoint=nosuch://b/ck/last: nosuch:// is no storage protocol" in one_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []  # no folder named after a scheme; a refused run leaves none


@pytest.mark.slow
def test_the_server_stopping_mid_run_is_one_line_after_bounded_retries_and_keeps_the_last_commit(
        bucket, s3_env, waits, tmp_path, monkeypatch, capsys):  # fmt: skip
    from test_object_storage import Server

    server = Server()
    monkeypatch.setattr(store, "SESSIONS", {})  # sessions to the session's server
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_environment(server.port)["AWS_ENDPOINT_URL"])
    url = f"s3://{bucket}/stopping/checkpoints"
    upload = ObjectStore.write

    def stop_at_the_second_checkpoint(self, name, data):
        if name == "step-000000006.pt":
            server.stop()
        return upload(self, name, data)

    monkeypatch.setattr(ObjectStore, "write", stop_at_the_second_checkpoint)
    code = main(["train", *TINY, "data.train_size=256", "checkpoint.every_steps=3", f"checkpoint.dir={url}",
                 f"out_dir={tmp_path}"])  # fmt: skip
    assert code == 2
    line = one_line(capsys.readouterr().err)
    assert f"cannot write {url}/step-000000006.pt (" in line and "after 4 attempt(s) over 3.5 s" in line, line
    assert waits == [0.5, 1.0, 2.0]
    monkeypatch.setattr(store, "SESSIONS", {})  # sessions to the stopped server
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env["AWS_ENDPOINT_URL"])  # the session's server: the same buckets
    assert committed_steps(url) == [3] and read_checkpoint(f"{url}/last")["step"] == 3  # intact


@pytest.mark.slow
def test_eval_export_and_weights_read_committed_checkpoints_by_url(bucket, s3_env, tmp_path, capsys):
    url = f"s3://{bucket}/readers/checkpoints"
    run_here("train", *TINY, "data.train_size=128", "data.val_size=32", f"checkpoint.dir={url}", f"out_dir={tmp_path}")
    assert main(["eval", "--checkpoint", f"{url}/last", "--json"]) == 0
    assert main(["export", "--checkpoint", f"{url}/best.pt", "--out", str(tmp_path / "model.pt")]) == 0
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(exported[k], v) for k, v in read_checkpoint(f"{url}/step-000000004.pt")["model"].items())
    open_store(url).write("model.pt", (tmp_path / "model.pt").read_bytes())
    open_store(url).write("step-000000009.pt", (tmp_path / "model.pt").read_bytes())  # never committed
    capsys.readouterr()
    for reader in (["eval", "--checkpoint", f"{url}/step-000000009.pt"],
                   ["train", *TINY, f"train.resume={url}/step-000000009.pt", f"out_dir={tmp_path / 'x'}"]):  # fmt: skip
        assert main(reader) == 2
        said = f"{url}/step-000000009.pt is not a committed checkpoint (no step-000000009.commit: its upload did not"
        assert said in one_line(capsys.readouterr().err)
    assert main(["train", *TINY, "data.train_size=128", "data.val_size=32", f"model.weights={url}/model.pt",
                 "train.max_steps=1", f"out_dir={tmp_path / 'tuned'}"]) == 0  # fmt: skip
    assert re.search(rf"model.weights: loaded (\d+) of \1 tensors from {url}/model.pt", capsys.readouterr().out)
    with pytest.raises(UserError, match=f"--checkpoint={url} is a folder of checkpoints; give one of them"):
        read_checkpoint(url)


def test_an_upload_past_stop_timeout_s_is_one_line():
    """The next save, a stop and the run's end wait for the upload in progress at most checkpoint.stop_timeout_s."""
    release = threading.Event()
    upload = Upload(release.wait, "s3://b/run/step-000000006.pt", wait_s=0.05)
    try:
        with pytest.raises(UserError) as late:
            upload.wait()
    finally:
        release.set()
    assert str(late.value) == (
        "the upload of s3://b/run/step-000000006.pt took longer than checkpoint.stop_timeout_s=0.05 s; raise it, or "
        "check the link to the storage (the last committed checkpoint is intact)"
    )
    upload.wait()  # done once released: nothing raised


@pytest.mark.slow
def test_sharded_checkpoints_go_through_dcps_fsspec_storage_and_commit_last(bucket, s3_env, tmp_path):
    url = f"s3://{bucket}/sharded/checkpoints"
    args = [*TINY, "data.train_size=64", "data.val_size=32", "checkpoint.format=sharded", "checkpoint.every_steps=1",
            "checkpoint.keep_last=1", f"checkpoint.dir={url}", f"out_dir={tmp_path}"]  # fmt: skip
    run_here("train", *args, "train.max_steps=1")
    resumed = run_here("train", *args)
    assert f"resumed from {url}/step-000000001: epoch 0, step 1 of 2" in resumed
    assert committed_steps(url) == [2]  # keep_last 1: step 1 pruned, its commit object first
    names = sorted(open_store(f"{url}/step-000000002").listing())
    assert names == [".metadata", "COMPLETE", "__0_0.distcp", "train_state.pt"], names
    assert read_checkpoint(f"{url}/last")["step"] == 2


# ------------------------------------------------------------------ one run per checkpoint folder


def _lock_object(url: str, holder: dict) -> str:
    """A lock object of another run in the folder at `url`, as its holder wrote it."""
    import json

    from multicard.base.store_lock import PREFIX

    name = f"{PREFIX}00000000000000000001-0ther000"
    open_store(url).write(name, json.dumps(holder).encode())
    return name


@pytest.mark.slow
def test_two_runs_writing_the_same_checkpoint_dir_url_are_refused_until_its_lock_is_released_or_stale(
        bucket, s3_env, tmp_path, capsys):  # fmt: skip
    import socket
    import time

    from multicard.base.store_lock import STALE_S, StoreLock

    url = f"s3://{bucket}/locked/checkpoints"
    first = StoreLock(open_store(url), "checkpoint.dir")
    first.acquire(print)
    args = [*TINY, "data.train_size=64", "data.val_size=32", f"checkpoint.dir={url}"]
    try:
        assert main(["train", *args, f"out_dir={tmp_path / 'second'}"]) == 2  # another out_dir: its own lock is free
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"multicard: error: checkpoint.dir={url} is in use by another run (host "), line
        assert f"pid {os.getpid()}, since " in line and "wait for it to end, stop it, or choose another" in line
        assert committed_steps(url) == [] and not (tmp_path / "second").exists()  # a refused run leaves nothing
    finally:
        first.release()
    assert main(["train", *args, f"out_dir={tmp_path / 'second'}"]) == 0
    assert committed_steps(url) == [2]
    assert not [name for name in open_store(url).listing() if "lock" in name]  # released at the run's end
    now, host = time.time(), socket.gethostname()
    for holder in ({"host": "elsewhere", "pid": 1, "since": now - 999, "renewed": now - STALE_S - 1},  # not renewed
                   {"host": host, "pid": 2**22 + 1, "since": now, "renewed": now}):  # this host's, its process gone
        name = _lock_object(url, holder)
        said: list[str] = []
        taker = StoreLock(open_store(url), "checkpoint.dir")
        taker.acquire(said.append)
        taker.release()
        assert said == [f"checkpoint.dir={url}: taking over from a run that ended without releasing it (host "
                        f"{holder['host']}, pid {holder['pid']}, since " + said[0].split(", since ")[1]], said
        assert name not in open_store(url).listing()


def test_a_local_checkpoint_dir_shared_by_two_out_dirs_is_refused_too(tmp_path, capsys):
    from multicard.base.store_lock import StoreLock

    shared = tmp_path / "shared"
    holder = StoreLock(open_store(str(shared)), "checkpoint.dir")
    holder.acquire(print)
    try:
        assert main(["train", *TINY, f"checkpoint.dir={shared}", f"out_dir={tmp_path / 'other'}"]) == 2
        assert f"checkpoint.dir={shared} is in use by another run" in one_line(capsys.readouterr().err)
    finally:
        holder.release()
    assert [p.name for p in shared.iterdir()] == []


def test_checkpoint_dir_given_as_a_file_url_is_that_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_here("train", *TINY, "data.train_size=64", "data.val_size=32", f"checkpoint.dir=file://{tmp_path}/ck",
             "out_dir=run")  # fmt: skip
    assert read_checkpoint(tmp_path / "ck" / "last.pt")["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "run"]  # nothing joined onto the working directory
    assert read_checkpoint(f"FILE://{tmp_path}/ck/last")["step"] == 2  # `last` of a folder of files: the newest
