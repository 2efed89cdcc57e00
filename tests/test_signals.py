"""Stop signals and Ctrl-C. To multicard's launcher, with real processes and signals: a stop that needs
longer than torch's agent would give it still writes its checkpoint and resumes exactly; one line says
what happened, also before training started, when a stop runs out of time, and when a second Ctrl-C
quits at once. In one process: the first Ctrl-C asks for a stop, the second quits at once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from conftest import (
    FAULTS,
    RUNNING,
    TINY,
    assert_bitwise_equal,
    cli,
    descendants,
    final_params,
    load_checkpoint,
    one_line,
    parents,
    start,
    wait_for,
)
from multicard.checkpoint import checkpoints_in, load_file
from multicard.runtime.stopping import BeforeTraining, GracefulStop, StoppedBeforeTraining

DDP2 = ("--nproc-per-node", "2")
# As tests/test_resume.py: two epochs of 32 steps at a constant LR, checkpoints every 5 steps.
EXACT = [*TINY, "train.epochs=2", "sched.name=constant", "checkpoint.every_steps=5", "data.val_size=64"]
STEPS = 2 * 1024 // 32
TORCH_AGENT_WAIT_S = 30  # what torch's elastic agent alone gives workers to stop before it kills them
# A stop that needs longer than that (asleep: wall time, not CPU); MULTICARD_SLOW_STOP_S=60 tries a longer one.
SLOW_STOP_S = float(os.environ.get("MULTICARD_SLOW_STOP_S", TORCH_AGENT_WAIT_S + 5))


def faulty(kind: str, mark, rank: int, **values: float) -> dict[str, str]:
    """Environment for a run with tests/faults' `kind` on `rank`; it writes `mark` when it starts."""
    env = {"PYTHONPATH": str(FAULTS), "MULTICARD_FAULT": kind, "MULTICARD_FAULT_RANK": str(rank)}
    env["MULTICARD_FAULT_MARK"] = str(mark)
    return env | {f"MULTICARD_FAULT_{k.upper()}": str(v) for k, v in values.items()}


def slow_stop(mark, stop_s: float) -> dict[str, str]:
    """Rank 0 (the writer of file checkpoints) steps 150 ms slower and sleeps `stop_s` before its
    stop checkpoint: the job lasts long enough to be signalled, and its stop as long as asked."""
    return faulty("slow-stop", mark, rank=0, ms=150, stop_s=stop_s)


def run_ok(*args: str) -> subprocess.CompletedProcess:
    result = cli("train", *args)
    assert result.returncode == 0, result.stderr
    return result


def signalled_after_first_checkpoint(tmp_path, sig, env, *extra: str) -> tuple[subprocess.Popen, set[int]]:
    """A ddp×2 EXACT job, sent `sig` at its launcher once its first checkpoint is written; its workers."""
    proc = start("train", *DDP2, *EXACT, *extra, f"out_dir={tmp_path / 'out'}", env=env)
    folder = tmp_path / "out" / "checkpoints"
    wait_for(lambda: bool(checkpoints_in(folder)) or proc.poll() is not None, what="the first checkpoint")
    assert proc.poll() is None, proc.communicate()
    workers = descendants(proc.pid)
    assert len(workers) >= 2
    os.kill(proc.pid, sig)
    return proc, workers


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stop_longer_than_torchs_agent_allows_writes_its_checkpoint_and_resumes_exactly(tmp_path):
    mark = tmp_path / "stop-began"
    proc, workers = signalled_after_first_checkpoint(tmp_path, signal.SIGTERM, slow_stop(mark, SLOW_STOP_S))
    reference = start("train", *DDP2, *EXACT, f"out_dir={tmp_path / 'reference'}")  # uninterrupted, while it sleeps
    _, err = proc.communicate(timeout=SLOW_STOP_S + 120)
    ended = time.time()
    _, reference_err = reference.communicate(timeout=300)
    assert reference.returncode == 0, reference_err
    assert proc.returncode == 143, err
    said = one_line(err)  # rank 0's line; nothing from the launcher or torch's agent
    stopped = re.fullmatch(r"multicard: stopped by SIGTERM at step (\d+); checkpoint (\S+) written; .*", said)
    assert stopped, said
    assert ended - float(mark.read_text()) > TORCH_AGENT_WAIT_S  # the stop took longer than torch would wait
    out = tmp_path / "out"
    assert load_checkpoint(out / "checkpoints" / "last.pt")["step"] == int(stopped[1]) < STEPS
    assert not list((out / "checkpoints").glob("*incomplete*")) and not workers & set(parents())
    resumed = run_ok(*DDP2, *EXACT, f"out_dir={out}")
    assert f"step {stopped[1]} of {STEPS}" in resumed.stdout
    assert_bitwise_equal(final_params(out), final_params(tmp_path / "reference"))


@pytest.mark.distributed
def test_a_stop_past_checkpoint_stop_timeout_s_is_killed_and_says_so(tmp_path):
    env = slow_stop(tmp_path / "stop-began", 600)
    proc, workers = signalled_after_first_checkpoint(tmp_path, signal.SIGTERM, env, "checkpoint.stop_timeout_s=3")
    sent = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert 3 <= time.monotonic() - sent < 60  # given its 3 s, not 300 s nor the 600 s it wanted
    assert proc.returncode == 143, err
    assert one_line(err) == (
        "multicard: error: the stop on SIGTERM took longer than 3 s; workers killed before their checkpoint was "
        "complete (the last one written stays); raise checkpoint.stop_timeout_s"
    )
    assert not workers & set(parents())
    steps = [load_file(p)["step"] for p in checkpoints_in(tmp_path / "out" / "checkpoints")]
    assert steps and all(step % 5 == 0 for step in steps)  # the cadence's checkpoints only: none at the stop


@pytest.mark.distributed
def test_sigterm_before_training_started_says_nothing_was_saved(tmp_path):
    mark = tmp_path / "starting"
    env = faulty("slow-start", mark, rank=1, ms=600_000)  # rank 1 sleeps before it imports anything
    proc = start("train", *DDP2, *TINY, f"out_dir={tmp_path / 'out'}", env=env)
    wait_for(mark.exists, what="rank 1 starting")
    workers = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert one_line(err) == "multicard: stopped by SIGTERM before training started; nothing to save"
    assert not checkpoints_in(tmp_path / "out" / "checkpoints") and not workers & set(parents())


@pytest.mark.distributed
def test_a_second_sigint_to_the_launcher_quits_at_once_in_one_line(tmp_path):
    mark = tmp_path / "stop-began"
    proc, workers = signalled_after_first_checkpoint(tmp_path, signal.SIGINT, slow_stop(mark, 600))
    wait_for(mark.exists, what="the stop's checkpoint begun")
    os.kill(proc.pid, signal.SIGINT)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 30  # at once, not after the 600 s stop
    assert proc.returncode == 130, err
    assert one_line(err) == "multicard: quit by SIGINT without a checkpoint; the last checkpoint written stays"
    assert "Ctrl-C again to quit at once" in out and not workers & set(parents())


@pytest.mark.distributed
def test_a_stop_signal_in_start_up_ends_in_one_line_and_says_when():
    """Before a GracefulStop (or the launcher's relay) takes the signals, SIGTERM ends the command
    with its own line; after training handed them back, the line says training had ended."""
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(StoppedBeforeTraining) as early, BeforeTraining():
        os.kill(os.getpid(), signal.SIGTERM)
    assert str(early.value) == "stopped by SIGTERM before training started; nothing to save"
    assert early.value.exit_code == 143 and signal.getsignal(signal.SIGTERM) is previous
    with pytest.raises(StoppedBeforeTraining) as late, BeforeTraining():
        with GracefulStop(lambda v: lambda: v, announce=False):
            pass  # training ran and handed the signals back
        os.kill(os.getpid(), signal.SIGHUP)
    assert str(late.value) == "stopped by SIGHUP after training ended; its checkpoints are written"


def test_a_second_ctrl_c_while_stopping_quits_at_once(monkeypatch, capsys):
    """The handler's decision, in this process: the first Ctrl-C asks for a stop, the second
    quits at once (os._exit, so no exception can surface in whatever was running)."""
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    stop = GracefulStop(lambda value: lambda: value)
    stop._handle(signal.SIGINT, None)
    assert stop.poll() == 0 and stop.poll() == signal.SIGINT and not exits  # agreed one poll later
    assert "Ctrl-C again to quit at once" in capsys.readouterr().out
    stop._handle(signal.SIGINT, None)
    assert exits == [130]
    quit_line = "multicard: quit by SIGINT without a checkpoint; the last checkpoint written stays"
    assert capsys.readouterr().err.strip() == quit_line


@pytest.mark.slow
def test_ctrl_c_twice_ends_in_one_line_and_earlier_checkpoints_survive(tmp_path):
    proc = start("train", *RUNNING, f"out_dir={tmp_path}")
    wait_for(lambda: bool(checkpoints_in(tmp_path / "checkpoints")), what="the first checkpoint")
    os.kill(proc.pid, signal.SIGINT)
    for line in proc.stdout:  # the run acknowledges the first Ctrl-C before the second is sent
        if "Ctrl-C again to quit at once" in line:
            break
    os.kill(proc.pid, signal.SIGINT)  # lands while stopping or after the stop checkpoint: either is fine
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    said = one_line(err)
    assert re.fullmatch(r"multicard: (quit by SIGINT without a checkpoint|stopped by SIGINT at step \d+).*", said)
    assert all(load_file(p)["step"] > 0 for p in checkpoints_in(tmp_path / "checkpoints"))
