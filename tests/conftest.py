"""Shared helpers: small, fast training settings, runners for the real CLI, process-tree and
checkpoint helpers, and the hook that skips `cuda`-marked tests on machines without CUDA."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# `make test` runs two test processes on as many cores, so training processes often share a core.
# OpenMP's threads then spin at every barrier waiting for a thread that is not running: a
# two-thread training took twice as long beside another one (25 s against 12.6 s for the pair).
# Waiting passively costs a run alone about 5%. Set before torch loads OpenMP; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
# The installed `multicard` command, beside this interpreter: what users run (pyproject's console script).
MULTICARD = str(Path(sys.executable).with_name("multicard"))

# Tiny runs: 16×16 images, a few hundred steps at most; enough to exercise every path.
TINY = [
    "model.name=smallcnn",
    "data.image_size=16",
    "data.train_size=1024",
    "data.val_size=301",
    "data.crop_padding=2",
    "train.epochs=1",
    "train.global_batch_size=32",
    "log_every=4",
]

# A few hundred steps of a tiny model: seconds long, long enough to act while it runs.
RUNNING = [*TINY, "data.train_size=8192", "train.epochs=3", "checkpoint.every_steps=5", "data.val_size=64"]

# Learnable in tens of seconds on 2 CPU cores: reaches >90% validation top-1.
LEARN = [
    "model.name=smallcnn",
    "data.image_size=16",
    "data.train_size=8000",
    "data.val_size=2000",
    "data.crop_padding=2",
    "train.epochs=10",
    "train.global_batch_size=128",
    "sched.warmup_epochs=1",
    "log_every=20",
]

# tests/faults/sitecustomize.py injects a fault into one rank of a run whose PYTHONPATH holds it.
FAULTS = ROOT / "tests" / "faults"


def slowed(ms: int = 150, rank: int = 1, path: Path | None = None) -> dict[str, str]:
    """Environment for a run in which every optimizer step of `rank` (0: also the one process of a
    run without a launcher) takes `ms` longer, asleep: a short job that lasts long enough for a test
    to act on it while it runs. `path`: one more folder for PYTHONPATH (test models)."""
    folders = [str(FAULTS)] if path is None else [str(path), str(FAULTS)]
    return {
        "PYTHONPATH": os.pathsep.join(folders), "MULTICARD_FAULT": "slow-steps",
        "MULTICARD_FAULT_MS": str(ms), "MULTICARD_FAULT_RANK": str(rank),
    }  # fmt: skip


# Variables a launcher sets: a test process must not hand its own (if any) to the runs it starts.
LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`cuda`-marked tests skip themselves where CUDA is absent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


requires_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.fixture(scope="session", autouse=True)
def sigint_as_in_a_terminal() -> None:
    """A suite started as a background job (`make test &` in a script, nohup) inherits SIGINT ignored,
    and so would every process a test starts: a Ctrl-C test would then signal a command that cannot
    hear it. Python's own handler is put back, as a terminal gives it to a user's command."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without launcher or Slurm variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith(LAUNCHER_PREFIXES)}
    return {**env, **(extra or {})}


def cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the installed `multicard ARGS` in a fresh process; capture its output."""
    return subprocess.run([MULTICARD, *args], capture_output=True, text=True, timeout=timeout, env=clean_env(env))


def run_here(*args: str, env: dict[str, str] | None = None) -> str:
    """`multicard ARGS` run by this process through the command line's own entry point, for runs
    whose own process is not what a test checks (references, set-up runs, resumes and evaluations
    judged by their results); it must exit 0. Its stdout, with its workers' (they are real
    processes, started by torch's agent here, with `env` added to their environment). torch is
    loaded here already: one process runs in ~0.5 CPU-s instead of ~3.5, a launcher costs ~0.1
    instead of ~2.3."""
    from multicard.cli.main import main

    environ = dict(os.environ)  # a launcher tells its workers its pid through the environment
    os.environ.update(env or {})
    with tempfile.TemporaryFile("a+") as out, tempfile.TemporaryFile("a+") as err:
        sys.stdout.flush(), sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)  # where the workers write
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(list(args))
        finally:
            out.flush(), err.flush()
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)
            os.environ.clear()
            os.environ.update(environ)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert code == 0, stderr
    return stdout


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    """Start the installed `multicard ARGS` in a session of its own (for signals); do not wait."""
    return subprocess.Popen(
        [MULTICARD, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(env), start_new_session=True,
    )  # fmt: skip


def stopped_after_first_checkpoint(out: Path, *args: str, env: dict | None = None) -> int:
    """`multicard train ARGS out_dir=OUT` (a slowed run) stopped by SIGTERM once its first
    checkpoint is there: it exits 143 having written one more; the step that one holds."""
    from multicard.checkpoint import checkpoints_in

    proc = start("train", *args, f"out_dir={out}", env=env)
    wait_for(lambda: bool(checkpoints_in(out / "checkpoints")), what="the first checkpoint")
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    return load_checkpoint(out / "checkpoints" / "last.pt")["step"]


def srun_task(rank: int, port: int, argv: list[str]) -> subprocess.Popen:
    """One of the 2 tasks `srun --ntasks-per-node=2 python ARGV` would start on one node: the
    SLURM_* variables srun gives its tasks (srun is emulated)."""
    env = clean_env({
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "multicard", "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank), "MASTER_PORT": str(port),
    })  # fmt: skip
    return subprocess.Popen(
        [sys.executable, *argv], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args],
        capture_output=True, text=True, timeout=timeout, env=clean_env(),
    )  # fmt: skip


# ------------------------------------------------------------------ checkpoints and parameters


def train_on_two_nodes(*args: str, env: dict | None = None) -> list[tuple[str, str]]:
    """`multicard train ARGS` as two nodes of one process each, two launchers on this host over
    loopback; both must exit 0. Their (stdout, stderr)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [
        subprocess.Popen(
            [MULTICARD, "train", "--nnodes", "2", "--node-rank", str(rank),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(env),
        )
        for rank in (0, 1)
    ]  # fmt: skip
    try:
        outputs = [node.communicate(timeout=180) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    return outputs


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def final_params(out_dir: Path) -> dict[str, torch.Tensor]:
    """The model of a run's newest checkpoint, whatever its format (a file, or shards)."""
    from multicard.checkpoint import read_checkpoint

    folder = out_dir / "checkpoints"
    return read_checkpoint(folder / "last" if (folder / "last").is_dir() else folder / "last.pt")["model"]


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest ‖a − b‖ / ‖b‖ over floating tensors; integer tensors (counters) must be equal."""
    assert a.keys() == b.keys()
    floats = [k for k in b if b[k].is_floating_point()]
    assert all(torch.equal(a[k], b[k]) for k in b if k not in floats)  # counters such as num_batches_tracked
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30)).item() for k in floats)


def copy_of(run: Path, tmp_path: Path) -> Path:
    """A copy of a run's out_dir (its `last`/`best` links kept as links) for a test to change."""
    return Path(shutil.copytree(run, tmp_path / "out", symlinks=True))


def one_line(err: str) -> str:
    """stderr holds exactly one line and no traceback; that line."""
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    return err.strip()


def image_folder(root: Path, classes: list[str], per_class: int = 8) -> Path:
    """root/<class>/<n>.png: `per_class` 8×8 images of one grey level each, for every class named."""
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(np.full((8, 8, 3), 10 * c + i, dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


@contextlib.contextmanager
def unwritable(folder: Path):
    """`folder` refuses new files while inside, even to root (immutable: chattr +i), else by its mode."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not available here (root ignores permission bits)")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
    else:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)


# ------------------------------------------------------------------ processes


def wait_for(condition: Callable[[], bool], timeout: float = 120.0, what: str = "condition") -> None:
    """Poll a condition on the file system or process table (not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def parents() -> dict[int, int]:
    """pid → parent pid of every live (non-zombie) process, from /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                out[int(entry.name)] = int(fields[1])
    return out


def descendants(pid: int) -> set[int]:
    tree = parents()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in tree.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` that are still running (zombies count as gone)."""
    return pids & set(parents())


def worker_pid(launcher: int, rank: int) -> int | None:
    """The trainer process of `rank` under the launcher (not its data-loader children)."""
    tree = parents()
    for pid in descendants(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            parent_env = Path(f"/proc/{tree.get(pid, 1)}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and f"LOCAL_RANK={rank}".encode() in environ:
            if f"RANK={rank}".encode() not in parent_env:
                return pid
    return None


# ------------------------------------------------------------------ object storage

S3_SECRET = "multicard-test-secret-5c1e"  # the dummy secret key: a test looks for it where it must never be


def s3_environment(port: int) -> dict[str, str]:
    """What points s3fs at a server on loopback: dummy credentials and the endpoint, from the environment."""
    return {
        "AWS_ACCESS_KEY_ID": "multicard-test-key", "AWS_SECRET_ACCESS_KEY": S3_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }  # fmt: skip


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-protocol server on a free loopback port (moto's standalone server, which s3fs's own tests
    use): the bytes cross a socket as they would in production. Yields the environment that points
    s3fs at it (tests hand it to the runs they start; nothing of it goes into a config)."""
    pytest.importorskip("s3fs", reason="needs s3fs: pip install -e '.[dev]'")
    server = pytest.importorskip("moto.server", reason="needs moto[server]: pip install -e '.[dev]'")
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    running = server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # 0: a free port
    running.start()
    yield s3_environment(running.get_host_and_port()[1])
    running.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> dict[str, str]:
    """This process's environment pointed at the server, for in-process runs and reads."""
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The backoff waits of storage's retries (multicard.base.storage), recorded instead of slept."""
    from multicard.base import storage

    recorded: list[float] = []
    monkeypatch.setattr(storage, "sleep", recorded.append)
    return recorded
