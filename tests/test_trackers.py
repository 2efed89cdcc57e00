"""Experiment trackers (log.mlflow, log.wandb) with a real MLflow tracking server on loopback and
W&B in offline mode: one tracker run per multicard run across a SIGTERM and a resume, the steps of
metrics.jsonl without duplicates, a server that goes away mid-run, and the missing extras."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest

from conftest import TINY, cli, slowed, start, wait_for
from multicard.base.config import load_config, to_dict
from multicard.checkpoint import checkpoints_in
from multicard.cli.main import main
from multicard.observe.tracking import TRACKERS_FILE, flat_params, wandb_mode


def installed(package: str) -> bool:
    try:
        return bool(metadata.version(package))
    except metadata.PackageNotFoundError:
        return False


pytestmark = [pytest.mark.distributed, pytest.mark.slow]
# The client extras, and full mlflow for its tracking server
needs_trackers = pytest.mark.skipif(
    not (installed("mlflow") and installed("wandb")), reason="pip install 'multicard[mlflow,mlflow-server,wandb]'"
)

# Two epochs of 8 steps, a record every 2 steps, checkpoints every 4.
RUN = [*TINY, "data.train_size=256", "data.val_size=64", "train.epochs=2", "log_every=2", "checkpoint.every_steps=4"]
STEPS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on loopback with a temporary SQLite store, in a session of its own."""

    def __init__(self, folder: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        command = [
            str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port",
            self.url.rsplit(":", 1)[1], "--workers", "1", "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
            "--artifacts-destination", str(folder / "artifacts"),
        ]  # fmt: skip
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job-runner processes
        with open(folder / "server.log", "w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=log, env=env, start_new_session=True)
        self.log = folder / "server.log"
        wait_for(self.healthy, timeout=240, what="the MLflow server's /health")

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"mlflow server exited: {self.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)  # its uvicorn worker too
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module (it takes seconds to start); the last test stops it."""
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def resumed_run(server, tmp_path_factory):
    """A ddp×2 run with both trackers (W&B's mode left to its default), stopped by SIGTERM after
    its first checkpoint and resumed to the end: its out_dir."""
    out = tmp_path_factory.mktemp("tracked")
    args = ("--nproc-per-node", "2", *RUN, "log.mlflow=true", f"log.mlflow_uri={server.url}", "log.wandb=true")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("WANDB_MODE", raising=False)  # offline by default: nothing leaves the machine
        proc = start("train", *args, f"out_dir={out}", env=slowed(300))
        wait_for(lambda: bool(checkpoints_in(out / "checkpoints")), what="the first checkpoint")
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 143, err
        assert "warning" not in err, err
        stopped = json.loads((out / TRACKERS_FILE).read_text())["mlflow"]["step"]
        assert stopped < STEPS
        resumed = cli("train", *args, f"out_dir={out}")
    assert resumed.returncode == 0, resumed.stderr
    assert "warning" not in resumed.stderr, resumed.stderr
    return out


def jsonl(out: Path, kind: str) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == kind]


@needs_trackers
def test_mlflow_server_holds_one_run_with_the_steps_of_metrics_jsonl_across_a_resume(server, resumed_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=server.url)
    experiment = client.get_experiment_by_name("multicard")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == resumed_run.name
    expected = {k: str(v) for k, v in flat_params(to_dict(load_config(None, [*RUN, "log.mlflow=true"])))}
    assert run.data.params.keys() == expected.keys()
    assert run.data.params["model.name"] == "smallcnn" and run.data.params["train.epochs"] == "2"
    steps, epochs = jsonl(resumed_run, "step"), jsonl(resumed_run, "epoch")
    assert len({r["step"] for r in steps}) == len(steps) and steps[-1]["step"] == STEPS
    for tag, records, field in (
        ("train/loss", steps, "loss"), ("train/lr", steps, "lr"), ("time/step_ms", steps, "step_ms"),
        ("val/top1", epochs, "val_top1"), ("train/epoch_loss", epochs, "train_loss"),
    ):  # fmt: skip
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag))
        assert history == [(r["step"], pytest.approx(r[field])) for r in records], tag
    for rank in (0, 1):
        assert len(client.get_metric_history(run.info.run_id, f"rank_step_ms/rank_{rank}")) == len(steps)
    assert run.data.metrics["best/val_top1"] == pytest.approx(max(e["val_top1"] for e in epochs))
    assert run.data.metrics["final/val_top1"] == pytest.approx(epochs[-1]["val_top1"])
    assert {"config.yaml", "report.png"} <= {a.path for a in client.list_artifacts(run.info.run_id)}


def wandb_records(path: Path):
    """The protobuf records of a .wandb file: W&B's transaction log, in LevelDB's log format
    (a 7-byte file header, then 32 KiB blocks of chunks, each with a 7-byte header: CRC, length,
    type FULL=1 FIRST=2 MIDDLE=3 LAST=4). wandb ships its reader in its Go core only."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@needs_trackers
def test_wandb_offline_run_holds_the_steps_of_metrics_jsonl_across_a_resume(resumed_run):
    run_id = json.loads((resumed_run / TRACKERS_FILE).read_text())["wandb"]["run_id"]
    parts = sorted((resumed_run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(parts) == 2  # the stopped process's and the resumed one's, for `wandb sync` to join
    rows: list[dict] = []
    for part in parts:
        for record in wandb_records(part):
            if record.WhichOneof("record_type") == "history":
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
            elif record.WhichOneof("record_type") == "run":
                assert record.run.run_id == run_id
    steps, epochs = jsonl(resumed_run, "step"), jsonl(resumed_run, "epoch")
    assert [row["_step"] for row in rows] == [r["step"] for r in steps]  # each step once, in order
    assert [row["train/loss"] for row in rows] == [pytest.approx(r["loss"]) for r in steps]
    val = [(row["_step"], row["val/top1"]) for row in rows if "val/top1" in row]
    assert val == [(e["step"], pytest.approx(e["val_top1"])) for e in epochs]
    files = {p.name for p in parts[-1].parent.glob("files/*")}
    assert {"config.yaml", "report.png"} <= files


def test_wandb_is_offline_unless_the_config_or_environment_says_online(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode("auto") == "offline" and wandb_mode("online") == "online"
    monkeypatch.setenv("WANDB_MODE", "online")
    assert wandb_mode("auto") == "online" and wandb_mode("offline") == "offline"


def test_missing_extras_are_one_line_before_training(tmp_path, capsys, monkeypatch):
    """Without the package, one line naming the extra, exit 2, nothing trained (find_spec is None
    for a module set to None in sys.modules, as for one not installed)."""
    for key in ("mlflow", "wandb"):
        monkeypatch.setitem(sys.modules, key, None)
        assert main(["train", *TINY, f"log.{key}=true", f"out_dir={tmp_path / key}"]) == 2
        assert capsys.readouterr().err == (
            f"multicard: error: log.{key}=true needs {key}: pip install 'multicard[{key}]' (or set log.{key}=false)\n"
        )
        assert not (tmp_path / key / "metrics.jsonl").exists()


@needs_trackers
def test_unreachable_tracker_ends_the_run_only_when_asked(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    args = ("train.max_steps=2", "log.mlflow=true", f"log.mlflow_uri={url}", "log.on_tracker_error=fail")
    result = cli("train", *TINY, *args, f"out_dir={tmp_path}", env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("multicard: error: MLflow failed to start a run (API request to ")
    assert "Max retries exceeded" in result.stderr and result.stderr.endswith(
        "make the tracker reachable, set log.mlflow=false, or set log.on_tracker_error=warn to train on without it\n"
    ), result.stderr


# Stops the module's server: keep it the file's last test.
@needs_trackers
def test_server_stopped_mid_run_warns_once_and_training_completes(server, tmp_path):
    proc = start("train", *RUN, "log.mlflow=true", f"log.mlflow_uri={server.url}", f"out_dir={tmp_path}",
                 env=slowed(300, rank=0))  # fmt: skip
    marks = tmp_path / TRACKERS_FILE
    wait_for(lambda: marks.is_file() and json.loads(marks.read_text())["mlflow"].get("step", 0) >= 2,
             what="the first records on the server")  # fmt: skip
    server.stop(signal.SIGKILL)  # gone at once, mid-run
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and warnings[0].startswith("multicard: warning: MLflow failed to "), err
    assert "training goes on without it (metrics.jsonl and TensorBoard keep every record)" in warnings[0]
    assert [r["step"] for r in jsonl(tmp_path, "step")] == list(range(2, STEPS + 1, 2))
    assert [r["step"] for r in jsonl(tmp_path, "epoch")] == [8, 16]


@needs_trackers
def test_bench_logging_times_the_loop_with_both_trackers_attached(tmp_path, monkeypatch):
    """`multicard bench --logging` attaches the run's logs as train does: the multicard cell's
    out_dir holds metrics.jsonl and both trackers' runs, with the same steps."""
    from mlflow.tracking import MlflowClient

    out = tmp_path / "bench"
    result = cli(
        "bench", "--runners", "multicard", "--strategies", "single", "--world-sizes", "1", "--warmup", "1",
        "--steps", "4", "--logging", "--out", str(out), "model.name=smallcnn", "log_every=2", "log.mlflow=true",
        "log.wandb=true",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (row,) = json.loads((out / "bench.json").read_text())
    assert row["status"] == "ok" and row["step_ms_median"] > 0
    (cell,) = (out / "work").glob("cell-*")
    steps = [r["step"] for r in jsonl(cell, "step")]
    assert steps == [2, 4, 5]  # as multicard train with train.max_steps=5 writes them: every log_every, and the last
    state = json.loads((cell / TRACKERS_FILE).read_text())
    assert state["mlflow"]["step"] == state["wandb"]["step"] == steps[-1]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the run's local store, read back
    client = MlflowClient(tracking_uri=state["mlflow"]["uri"])
    history = client.get_metric_history(state["mlflow"]["run_id"], "train/loss")
    assert sorted(m.step for m in history) == steps
