"""What a multicard command leaves running once it has ended: nothing. Processes a script or a
worker starts end with the command (also those started in the background, whose parent ended
first), a process forked under multicard's stop handlers ends on a plain `kill`, and a worker
whose launcher was killed ends even where its script ignores SIGTERM. Real processes and signals."""

from __future__ import annotations

import multiprocessing
import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

from conftest import alive, start, wait_for
from multicard.runtime.stopping import BeforeTraining, GracefulStop

# Starts two processes that would run for ten minutes: one it leaves running, one in the
# background (its shell ends at once, so its parent is gone), then ends. They write their pids.
LEAVES_PROCESSES = """
    import os, shlex, subprocess, sys, time
    from pathlib import Path

    mine = Path(sys.argv[1]) / str(os.getpid())
    mine.touch()
    sleeper = [sys.executable, "-c", "import os, sys, time; print(os.getpid(), file=open(sys.argv[1], 'a')); "
               "time.sleep(600)", str(mine)]
    subprocess.Popen(sleeper)
    subprocess.Popen(shlex.join(sleeper) + " &", shell=True)
    while len(mine.read_text().split()) < 2:
        time.sleep(0.01)
"""

# A multicard.Run script that then ignores SIGTERM (rank 0) or handles it by doing nothing (rank 1).
IGNORES_SIGTERM = """
    import os, signal, sys, time
    from pathlib import Path

    import multicard

    run = multicard.Run(sys.argv[1], global_batch_size=2, devices="cpu")
    signal.signal(signal.SIGTERM, signal.SIG_IGN if run.rank == 0 else lambda signum, frame: None)
    Path(sys.argv[1], f"pid-{run.rank}").write_text(str(os.getpid()))
    while True:
        time.sleep(1)
"""


def script(folder: Path, code: str) -> Path:
    path = folder / "script.py"
    path.write_text(textwrap.dedent(code))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("launch", [(), ("--nproc-per-node", "2")], ids=["one-process", "two-workers"])
def test_processes_a_script_leaves_running_end_with_multicard_run(tmp_path, launch):
    """Before: `multicard run` exited 0 and the sleepers ran on under init."""
    pids = tmp_path / "pids"
    pids.mkdir()
    proc = start("run", *launch, str(script(tmp_path, LEAVES_PROCESSES)), str(pids))
    assert proc.wait(timeout=120) == 0
    left = {int(pid) for file in pids.iterdir() for pid in file.read_text().split()}
    try:
        assert len(left) == 2 * (len(launch) or 1)
        assert not alive(left)
    finally:
        for pid in alive(left):
            os.kill(pid, signal.SIGKILL)
    err = proc.stderr.read()  # once every process that held it has ended
    warnings = [line for line in err.splitlines() if "still running when the command ended" in line]
    assert warnings and all(line.startswith("multicard: warning: process(es) python") for line in warnings), err
    assert sum(line.count("(pid ") for line in warnings) == len(left)


def _ready_then_asleep(ready, seconds: float) -> None:
    ready.set()
    time.sleep(seconds)


def test_a_process_forked_under_multicards_stop_handlers_ends_on_a_plain_sigterm():
    """Before: the child kept multicard's handler, which only records a stop: `kill` did nothing."""
    fork = multiprocessing.get_context("fork")
    ready = fork.Event()
    with BeforeTraining(), GracefulStop(lambda value: lambda: value, announce=False):
        child = fork.Process(target=_ready_then_asleep, args=(ready, 60))
        child.start()
        assert ready.wait(30)
        os.kill(child.pid, signal.SIGTERM)
        child.join(30)
    assert child.exitcode == -signal.SIGTERM


@pytest.mark.distributed
def test_workers_of_a_killed_launcher_end_though_their_script_ignores_sigterm(tmp_path):
    """Before: both workers ran on without their launcher (the SIGTERM its death sends was ignored)."""
    run = tmp_path / "run"
    launcher = start("run", "--nproc-per-node", "2", "--stop-timeout", "1", str(script(tmp_path, IGNORES_SIGTERM)),
                     str(run))  # fmt: skip
    marks = [run / "pid-0", run / "pid-1"]
    try:
        wait_for(lambda: all(mark.exists() and mark.read_text() for mark in marks), what="both workers' scripts")
        workers = {int(mark.read_text()) for mark in marks}
        launcher.kill()
        _, err = launcher.communicate(timeout=60)  # the workers hold its stderr until they end
        assert not alive(workers)
    finally:
        for pid in alive({int(mark.read_text()) for mark in marks if mark.exists()}):
            os.kill(pid, signal.SIGKILL)
    gone = f"multicard: error (rank {{}}): the launcher (pid {launcher.pid}) has gone and this worker "
    ending = "; ending it without a checkpoint (the last one written stays)"
    lines = set(err.splitlines())
    assert gone.format(0) + "ignores SIGTERM" + ending in lines, err
    assert gone.format(1) + "did not stop within 1 s of its SIGTERM" + ending in lines, err
