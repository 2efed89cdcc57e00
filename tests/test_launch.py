"""How a multicard process ends, and what it leaves running once it has ended: nothing. Processes
a script or a worker starts end with the command (also those started in the background, whose
parent ended first), a process forked under multicard's stop handlers ends on a plain `kill`, and
the workers of a killed launcher end, in start-up or training, even where their script ignores
SIGTERM. A script under `multicard run` (in one process, or in each worker) runs as under `python
SCRIPT` and ends with its exit code, traceback and exit handlers, but without the interpreter's
teardown, where torch's gloo threads can abort a finished process. Real processes and signals."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import MULTICARD, RUNNING, alive, clean_env, cli, descendants, start, wait_for, worker_pid
from multicard.checkpoint import checkpoints_in
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
        # a worker's pipe closes a moment before the kernel marks it ended: wait for that, briefly
        wait_for(lambda: not alive(workers), timeout=10, what="the workers to end")
    finally:
        for pid in alive({int(mark.read_text()) for mark in marks if mark.exists()}):
            os.kill(pid, signal.SIGKILL)
    gone = f"multicard: error (rank {{}}): the launcher (pid {launcher.pid}) has gone and this worker "
    ending = "; ending it without a checkpoint (the last one written stays)"
    lines = set(err.splitlines())
    assert gone.format(0) + "ignores SIGTERM" + ending in lines, err
    assert gone.format(1) + "did not stop within 1 s of its SIGTERM" + ending in lines, err


@pytest.mark.distributed
@pytest.mark.parametrize("phase", ["start-up", "training"])
def test_workers_die_with_a_killed_launcher(tmp_path, phase):
    launcher = start("train", "--nproc-per-node", "2", *RUNNING, f"out_dir={tmp_path}")
    try:
        if phase == "start-up":  # both workers exist, neither has trained a step
            wait_for(lambda: worker_pid(launcher.pid, 1) is not None and worker_pid(launcher.pid, 0) is not None)
            assert not (tmp_path / "metrics.jsonl").exists()
        else:
            wait_for(lambda: bool(checkpoints_in(tmp_path / "checkpoints")), what="the first checkpoint")
        workers = descendants(launcher.pid)
        assert workers
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not alive(workers), timeout=10, what="the workers to end within 10 s")
    finally:
        launcher.kill()


# Leaves a thread issuing gloo all_reduces it never waits for, in a process group DDP keeps to the
# end, as the script ends: a gloo thread then frees a tensor while the process exits.
GLOO_AT_THE_END = """
    import os, sys, threading
    import torch, torch.distributed as dist

    if "RANK" in os.environ:  # a worker of `multicard run --nproc-per-node`
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    group = dist.new_group()  # the thread's own: its collectives pair up across ranks apart from the main thread's

    def busy():
        while True:
            dist.all_reduce(torch.ones(1000), group=group, async_op=True)

    threading.Thread(target=busy, daemon=True).start()
    dist.all_reduce(torch.ones(1))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "launch", [(), pytest.param(("--nproc-per-node", "2"), marks=pytest.mark.distributed)],
    ids=["one-process", "two-workers"],
)  # fmt: skip
def test_a_script_that_leaves_gloo_collectives_running_ends_with_0_not_an_abort(tmp_path, launch):
    """Before: exit 134 ("terminate called without an active exception") in every run."""
    result = cli("run", *launch, str(script(tmp_path, GLOO_AT_THE_END)), str(tmp_path / "store"), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "terminate called" not in result.stderr


# Imports a module beside it, registers an exit handler that writes what python gave the script,
# then leaves by sys.exit(3) or by an exception of its own.
AS_PYTHON_RUNS_IT = """
    import atexit, sys
    from pathlib import Path

    import sibling

    atexit.register(Path(sys.argv[2]).write_text, f"{sys.argv[0]} {__file__} {__name__} {sibling.NAME}")
    if sys.argv[1] == "exit":
        sys.exit(3)
    raise ValueError("the script's own error")
"""


@pytest.mark.slow
@pytest.mark.parametrize("how, code", [("exit", 3), ("raise", 1)])
def test_multicard_run_runs_a_script_and_ends_it_as_python_does(tmp_path, how, code):
    """From another folder, the script imports its sibling module and sees the same argv, __file__
    and __name__; its exit code, its traceback and its exit handler's file are python's. Before:
    `No module named 'sibling'` (the script's folder was not on sys.path)."""
    folder, elsewhere = tmp_path / "scripts", tmp_path / "elsewhere"
    folder.mkdir(), elsewhere.mkdir()
    (folder / "train.py").write_text(textwrap.dedent(AS_PYTHON_RUNS_IT))
    (folder / "sibling.py").write_text("NAME = 'sibling'\n")
    ran = {}
    for name, program in (("python", [sys.executable]), ("multicard", [MULTICARD, "run"])):
        result = subprocess.run([*program, "../scripts/train.py", how, str(tmp_path / name)], cwd=elsewhere,
                                capture_output=True, text=True, timeout=120, env=clean_env())  # fmt: skip
        handler = tmp_path / name
        ran[name] = (result.returncode, result.stderr, handler.read_text() if handler.exists() else None)
    assert ran["multicard"] == ran["python"]
    exit_code, stderr, seen = ran["python"]
    assert exit_code == code and seen == f"../scripts/train.py {elsewhere}/../scripts/train.py __main__ sibling"
    if how == "raise":
        assert stderr.startswith("Traceback") and "ValueError: the script's own error" in stderr
