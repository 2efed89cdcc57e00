"""What a run says of itself: when a job stalls the report names the rank and the line; stragglers,
TensorBoard, `multicard report` (odd lines of metrics.jsonl skipped and counted), the estimated time.
Real processes (gloo), real faults: a blocked data loader, a skipped collective, SIGSTOP."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import (
    FAULTS,
    TINY,
    alive,
    cli,
    descendants,
    load_checkpoint,
    one_line,
    run_here,
    start,
    unwritable,
    wait_for,
    worker_pid,
)
from multicard.checkpoint import checkpoints_in
from multicard.cli.main import main
from multicard.observe.run_records import figure, load_run

STALL_S = 6
# Long enough that only a fault ends it early; stall detection after STALL_S seconds.
RUN = [*TINY, "data.train_size=4096", "train.epochs=50", "log_every=5", f"debug.stall_s={STALL_S}"]


def faulty(fault: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "PYTHONPATH": str(FAULTS), "MULTICARD_FAULT": fault, "MULTICARD_FAULT_RANK": "1",
        "MULTICARD_FAULT_MARK": str(tmp_path / "fault-fired"), **extra,
    }  # fmt: skip


def stalled(launcher, tmp_path: Path, since: float) -> tuple[str, float]:
    """The stall line of an aborting job and seconds from `since` to the report; no process left."""
    workers = descendants(launcher.pid)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 5, err
    lines = [line for line in err.splitlines() if "stall at step" in line]
    assert len(lines) == 1, err
    reported = (tmp_path / "out" / "stall" / "rank-0.txt").stat().st_mtime
    wait_for(lambda: not alive(workers), timeout=10, what="every process to end")
    return lines[0], reported - since


@pytest.mark.distributed
@pytest.mark.parametrize(
    "fault, expected",
    [
        # smallcnn has BatchNorm: DDP broadcasts its buffers at the start of each forward, a collective
        ("data", r"rank 1 in data loading \(run/loading\.py:\d+\); rank 0 wait in a collective during forward"),
        ("skip", r"rank 1 between steps \(run/logbook\.py:\d+\); rank 0 wait in the metrics \(or stop\) all-reduce"),
    ],
)
def test_a_blocked_rank_is_named_with_its_phase_and_line(tmp_path, fault, expected):
    launcher = start(
        "train", "--nproc-per-node", "2", *RUN, "debug.on_stall=abort", f"out_dir={tmp_path / 'out'}",
        env=faulty(fault, tmp_path),
    )  # fmt: skip
    wait_for(lambda: (tmp_path / "fault-fired").exists(), what="the fault")
    line, took = stalled(launcher, tmp_path, float((tmp_path / "fault-fired").read_text()))
    assert re.search(expected, line), line
    assert took <= STALL_S + 10
    for rank in (0, 1):  # every rank answered with its stacks, the blocked one included
        stacks = (tmp_path / "out" / "stall" / f"rank-{rank}.txt").read_text()
        assert "stall at step" in stacks and 'File "' in stacks and "Thread 0x" in stacks


@pytest.mark.distributed
def test_a_stopped_rank_is_named_silent(tmp_path):
    launcher = start("train", "--nproc-per-node", "2", *RUN, "debug.on_stall=abort", f"out_dir={tmp_path / 'out'}")
    wait_for(lambda: (tmp_path / "out" / "metrics.jsonl").exists(), what="training to start")
    wait_for(lambda: worker_pid(launcher.pid, 1) is not None, what="rank 1")
    os.kill(worker_pid(launcher.pid, 1), signal.SIGSTOP)
    since = time.time()
    line, took = stalled(launcher, tmp_path, since)
    assert re.search(r"rank 1 is silent \(no heartbeat for \d+\+ s: stopped or gone\?\)", line), line
    assert took <= STALL_S + 10
    # the stopped rank was ended with the job, not left to the launcher's 30 s termination grace
    assert time.time() - since <= STALL_S + 10
    assert not (tmp_path / "out" / "stall" / "rank-1.txt").exists()  # it could not answer


@pytest.mark.distributed
def test_no_stall_is_reported_in_a_healthy_run(tmp_path):
    result = cli("train", "--nproc-per-node", "2", *TINY, "train.epochs=2", "debug.stall_s=1", f"out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "stall" not in result.stderr and not (tmp_path / "stall").exists()
    assert "input pipeline holds training back" not in result.stdout  # nor a data-bound alarm


@pytest.mark.slow
def test_a_run_says_early_how_long_it_will_take(tmp_path):
    output = run_here("train", *TINY, "train.epochs=2", f"out_dir={tmp_path}")
    assert re.search(r"estimated time: \d+ (s|min \d+ s) for the \d+ steps left", output), output
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["step"] == 64


@pytest.mark.distributed
def test_a_straggler_is_named_once(tmp_path):
    result = cli(
        "train", "--nproc-per-node", "2", *TINY, "log_every=2", f"out_dir={tmp_path}",
        env=faulty("slow-data", tmp_path, MULTICARD_FAULT_MS="40"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("straggler: rank 1 waits") == 1, result.stdout
    assert "straggler: rank 0" not in result.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["rank"] for r in records if r["kind"] == "straggler"] == [1]
    # rank 1 waits 40 ms per batch for its (deliberately slow) loader: the input pipeline sets
    # the pace, said once, naming that rank
    bound = [r for r in records if r["kind"] == "data_bound"]
    assert len(bound) == 1 and "(rank 1," in bound[0]["message"], bound
    assert result.stdout.count("the input pipeline holds training back") == 1, result.stdout


def _scalars(folder: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0}).Reload()
    return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.distributed
def test_tensorboard_curves_continue_across_a_resume_without_duplicates(tmp_path):
    args = ["--nproc-per-node", "2", *TINY, "train.epochs=2", "log_every=4", "checkpoint.every_steps=8",
            "log.tensorboard=true", f"out_dir={tmp_path}"]  # fmt: skip
    launcher = start("train", *args, "data.train_size=2048", "train.epochs=20")
    wait_for(lambda: len(checkpoints_in(tmp_path / "checkpoints")) >= 2, what="two checkpoints")
    processes = {launcher.pid, *descendants(launcher.pid)}
    for pid in processes:  # a crash of everything at once: scalars were written after the last checkpoint
        os.kill(pid, signal.SIGKILL)
    launcher.wait()
    wait_for(lambda: not alive(processes), timeout=30, what="every process to end")
    result = cli("train", *args, "data.train_size=2048", "train.epochs=20", "train.max_steps=80")
    assert result.returncode == 0, result.stderr
    steps = _scalars(tmp_path / "tensorboard")
    assert steps["train/loss"] == list(range(4, 81, 4))  # each log step once, in order
    assert steps["val/top1"] == [64, 80] and steps["time/data_ms"] == steps["train/loss"]
    for tag in ("train/top1", "train/lr", "train/img_per_s", "time/compute_ms", "time/optimizer_ms",
                "rank_step_ms/rank_0", "rank_step_ms/rank_1", "val/loss", "memory/peak_mb/device_1"):  # fmt: skip
        assert tag in steps, tag


@pytest.mark.distributed
def test_report_overlays_two_runs(tmp_path, capsys):
    for name, lr in (("a", "0.1"), ("b", "0.01")):
        assert main(["train", *TINY, f"optim.lr={lr}", f"out_dir={tmp_path / name}"]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("a: best val top-1") and "\nb: best val top-1" in out and (tmp_path / "r.png").stat().st_size
    fig = figure([load_run(tmp_path / "a"), load_run(tmp_path / "b")])
    lr_panel = fig.axes[2]
    curves = {line.get_label(): list(line.get_ydata()) for line in lr_panel.lines}
    expected = {name: [r["lr"] for r in load_run(tmp_path / name).steps] for name in ("a", "b")}
    assert curves == expected and expected["a"][0] == pytest.approx(10 * expected["b"][0])


@pytest.mark.distributed
def test_report_and_tensorboard_bad_input_are_one_line(tmp_path, capsys, monkeypatch):
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no metrics.jsonl; give the out_dir of a multicard run" in capsys.readouterr().err
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.tensorboard", None)  # as if not installed
    assert main(["train", *TINY, "log.tensorboard=true", f"out_dir={tmp_path / 'o'}"]) == 2
    assert "pip install 'multicard[tensorboard]'" in capsys.readouterr().err
    assert main(["train", *TINY, "debug.stall_s=soon", f"out_dir={tmp_path / 'o'}"]) == 2
    assert "debug.stall_s=soon must be auto, 0 (off) or a number of seconds" in capsys.readouterr().err


def test_report_skips_odd_lines_saying_how_many_and_checks_out(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    step = {"kind": "step", "epoch": 0, "step": 4, "loss": 2.3, "top1": 10.0, "lr": 0.1, "img_per_s": 900.0}
    epoch = {"kind": "epoch", "epoch": 0, "step": 4, "train_loss": 2.3, "val_top1": 12.5, "val_loss": 2.2}
    lines = [json.dumps(step), "[1, 2]", json.dumps({**epoch, "val_top1": "NaN"}), json.dumps(epoch), '{"kind": "st',
             '{"kind": ["step"]}']  # fmt: skip
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["report", str(run), "--out", str(tmp_path / "r.png")]) == 0
    captured = capsys.readouterr()
    assert "skipped 4 unreadable line(s) of" in one_line(captured.err)
    assert "best val top-1 12.50% (epoch 0)" in captured.out and (tmp_path / "r.png").stat().st_size
    assert main(["report", str(run), "--out", str(tmp_path)]) == 2
    assert "is a directory; give a file name, e.g." in one_line(capsys.readouterr().err)
    assert main(["report", str(run), "--out", str(run / "metrics.jsonl" / "r.png")]) == 2
    assert "metrics.jsonl is a file, not a folder; choose another path" in one_line(capsys.readouterr().err)
    locked = tmp_path / "locked"
    locked.mkdir()
    with unwritable(locked):
        assert main(["report", str(run), "--out", str(locked / "r.png")]) == 2
    err = capsys.readouterr().err
    assert "r.png cannot be written (" in err.splitlines()[-1] and "Traceback" not in err


@pytest.mark.distributed
def test_heartbeats_count_what_they_cost(tmp_path):
    """The watchdog times its own beats (bench reports the share): here, one rank on an in-process
    store, each beat well under 1% of the second between beats."""
    import torch.distributed as tdist

    from multicard.observe.watchdog import BEAT_S, Watchdog

    dog = Watchdog(tdist.HashStore(), 0, 1, lambda: (0, 0, "idle"), tmp_path, None, abort=False, say=print)
    dog.start()
    try:
        wait_for(lambda: dog.cost.beats >= 2, timeout=10 * BEAT_S, what="two heartbeats")
    finally:
        dog.close()
    cost = dog.cost.summary()
    assert cost["beats"] >= 2 and 0 < cost["cpu_ms_per_beat"] and 0 < cost["wall_ms_per_beat"] < 10
    assert 0 < cost["wall_share"] < 0.01
