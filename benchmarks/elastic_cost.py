"""What an elastic job pays for losing a node: the step-time cost of its checkpoint cadence, and the
steps it trains again (and the seconds it stands still) each time a node is lost.

1. Cadence: the same `multicard train` job (configs/demo.yaml, one process) with no step checkpoint, with
   one every `--every` steps written in the training thread (the default), and with one every `--every`
   steps written in the background (checkpoint.async_save=true), the cells alternated over the repeats
   (A B C, C B A, ...) so a drifting machine favours none. Two measures: steady img/s over the step
   records after the first window (metrics.jsonl; its windows hold the saves' time), as a ratio to no
   checkpoint; and what a save costs the training thread (Checkpointer.save, timed in the run), over the
   training time of the steps between two saves (`--every` × the median step, from metrics.jsonl).
2. Losses: an elastic job of two nodes on this host (two launchers on loopback, one process each,
   `--nnodes 1:2`), a checkpoint every `--every` steps; at a random step one node is killed (SIGKILL to
   its launcher and workers), the other goes on alone. From the `membership` record of the re-formed
   job: the steps redone, and the seconds from the kill to the re-formed job's start.

    python benchmarks/elastic_cost.py [--repeats 3] [--every 10] [--losses 3] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = ["--config", "configs/demo.yaml", "data.train_size=12800", "data.val_size=1000", "train.epochs=1",
       "log_every=10", "train.resume=never"]  # fmt: skip
# The elastic job: the demo at 16 px for 2 epochs of 50 steps, every step logged (the kill is timed by it).
ELASTIC = ["--config", "configs/demo.yaml", "data.image_size=16", "data.train_size=6400", "data.val_size=500",
           "train.epochs=2", "log_every=1"]  # fmt: skip


def records(metrics: Path, kind: str) -> list[dict]:
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    found = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # being written
        if record.get("kind") == kind:
            found.append(record)
    return found


def steady_img_per_s(metrics: Path) -> float:
    """Images per second over the step windows after the first (weighted by steps: the batch cancels)."""
    windows, previous = [], None
    for r in records(metrics, "step"):
        if previous is not None:
            windows.append((r["step"] - previous, r["img_per_s"]))
        previous = r["step"]
    return sum(k for k, _ in windows) / sum(k / rate for k, rate in windows)


# Runs `multicard train ARGS` in this process with Checkpointer.save timed; writes the times to argv[1].
TIMED = """
import json, sys, time
from multicard.checkpoint import checkpointer
from multicard.cli.main import main
saves, save = [], checkpointer.Checkpointer.save
def timed(self, *args, **kwargs):
    began = time.perf_counter()
    try:
        return save(self, *args, **kwargs)
    finally:
        saves.append(time.perf_counter() - began)
checkpointer.Checkpointer.save = timed
code = main(sys.argv[2:])
open(sys.argv[1], "w").write(json.dumps(saves))
sys.exit(code)
"""
CELLS = {"none": ["checkpoint.every_steps=0"], "every": [], "background": ["checkpoint.async_save=true"]}


def cadence_run(out: Path, cell: str, every: int, extra: list[str]) -> tuple[float, float | None]:
    """(steady img/s, the training thread's cost of the step saves: median save over `every` median steps)."""
    flags = CELLS[cell] or [f"checkpoint.every_steps={every}"]
    if cell == "background":
        flags = [*flags, f"checkpoint.every_steps={every}"]
    cmd = [sys.executable, "-c", TIMED, str(out / "saves.json"), "train", *JOB, *flags, *extra, f"out_dir={out}"]
    out.mkdir(parents=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    metrics = out / "metrics.jsonl"
    saves = json.loads((out / "saves.json").read_text())[:-1]  # the epoch end's is not a step save
    step_s = statistics.median(r["step_ms"] for r in records(metrics, "step")) / 1000
    return steady_img_per_s(metrics), (statistics.median(saves) / (every * step_s) if saves else None)


def cadence(repeats: int, every: int, extra: list[str], tmp: Path) -> None:
    rates: dict[str, list[float]] = {cell: [] for cell in CELLS}
    costs: dict[str, list[float]] = {cell: [] for cell in CELLS}
    for i in range(repeats):
        for cell in (list(CELLS) if i % 2 == 0 else list(CELLS)[::-1]):
            rate, cost = cadence_run(tmp / f"cadence-{i}-{cell}", cell, every, extra)
            rates[cell].append(rate)
            costs[cell].append(cost if cost is not None else 0.0)
            share = f", saves {100 * cost:.2f}% of the steps' time" if cost is not None else ""
            print(f"repeat {i} {cell:<10} {rate:8.1f} img/s{share}", flush=True)
    for cell in ("every", "background"):
        pairs = [a / b for a, b in zip(rates[cell], rates["none"], strict=True)]
        print(f"cadence ({cell}): a checkpoint every {every} steps / none = {statistics.median(pairs):.3f} "
              f"[{min(pairs):.3f}-{max(pairs):.3f}] img/s; saves take {100 * statistics.median(costs[cell]):.2f}% "
              f"[{100 * min(costs[cell]):.2f}-{100 * max(costs[cell]):.2f}] of the training thread's step time "
              f"({repeats} repeats)", flush=True)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(rank: int, port: int, every: int, out: Path, extra: list[str]) -> subprocess.Popen:
    flags = ["--nnodes", "1:2", "--node-rank", str(rank), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--max-restarts", "1", "--rdzv-conf", "last_call_timeout=2"]  # fmt: skip
    cmd = [sys.executable, "-m", "multicard", "train", *flags, *ELASTIC, f"checkpoint.every_steps={every}",
           "threads=1", *extra, f"out_dir={out}"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(condition, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.02)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torch's agent starts each worker in a process group of its own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) if entry.name.isdigit() else None
        except OSError:
            continue
        if parent is not None:
            children.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for p in frontier for child in children.get(p, [])]
        found += frontier
    return found


def kill_node(launcher: subprocess.Popen) -> None:
    """SIGKILL to a node's launcher and its workers, workers first (they would stop gracefully)."""
    for pid in [*descendants(launcher.pid), launcher.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait()


def loss(every: int, extra: list[str], out: Path, rng: random.Random) -> tuple[int, float]:
    """(steps redone, seconds from the kill to the re-formed job's start) of one lost node."""
    port, metrics = free_port(), out / "metrics.jsonl"
    nodes = [node(0, port, every, out, extra), node(1, port, every, out, extra)]
    try:
        wait_for(lambda: any(r["world_size"] == 2 for r in records(metrics, "membership")))
        at = rng.randint(2 * every + 1, 3 * every)  # a uniformly random step between two checkpoints
        wait_for(lambda: any(r["step"] >= at for r in records(metrics, "step")))
        killed = time.time()
        kill_node(nodes[1])
        reformed = lambda: [r for r in records(metrics, "membership") if r["time"] > killed]  # noqa: E731
        wait_for(lambda: bool(reformed()))
        start = reformed()[0]
        return start["redone"], start["time"] - killed
    finally:
        for proc in nodes:
            kill_node(proc)


def losses(count: int, every: int, extra: list[str], tmp: Path) -> None:
    rng = random.Random(0)
    redone, still = [], []
    for i in range(count):
        steps, seconds = loss(every, extra, tmp / f"loss-{i}", rng)
        redone.append(steps)
        still.append(seconds)
        print(f"loss {i}: {steps} step(s) redone, re-formed {seconds:.1f} s after the kill", flush=True)
    print(f"losses: {statistics.mean(redone):.1f} step(s) redone on average [{min(redone)}-{max(redone)}], "
          f"re-formed after {statistics.median(still):.1f} s [{min(still):.1f}-{max(still):.1f}] "
          f"(a checkpoint every {every} steps, {count} losses)", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="pairs of cadence runs (default 3)")
    p.add_argument("--every", type=int, default=10, help="checkpoint.every_steps (default 10)")
    p.add_argument("--losses", type=int, default=3, help="nodes lost, each in a job of its own (default 3)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.repeats:
            cadence(args.repeats, args.every, args.overrides, Path(tmp))
        if args.losses:
            losses(args.losses, args.every, args.overrides, Path(tmp))


if __name__ == "__main__":
    main()
