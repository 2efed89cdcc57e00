"""Where sharding matters: under a per-process memory cap that ddp×2 cannot train in, fsdp×2 trains
the same config to its end.

Each rank runs in a cgroup (v1) of its own, started as torchrun would start it (RANK, WORLD_SIZE,
MASTER_ADDR...), so the cap is per process and the kernel's out-of-memory killer enforces it.
First both strategies run uncapped and each cgroup's peak is read (fsdp with
fsdp.cpu_release_memory=true, what its default `auto` picks under a cap); then both run again under a
cap between fsdp's peak and ddp's (or --cap-mib). Needs root and cgroup v1's memory controller.

    python benchmarks/sharded_memory.py [--cap-mib N] [--out runs/bench-sharded-memory] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

CGROUPS = Path("/sys/fs/cgroup/memory")
# vit_b_16 (86 M parameters) with AdamW at 224 px: 16 bytes of state per parameter, ~1.4 GB per ddp rank.
WORKLOAD = [
    "model.name=vit_b_16", "data.image_size=224", "optim.name=adamw", "train.global_batch_size=2",
    "data.train_size=4", "data.val_size=2", "data.eval_batch_size=2", "train.epochs=1", "log_every=1",
    "threads=1", "devices=cpu", "train.resume=never",
]  # fmt: skip


class MemoryCap:
    """A memory cgroup with a limit (None: unlimited) that one process is started in."""

    def __init__(self, name: str, limit: int | None) -> None:
        self.path = CGROUPS / f"multicard-{name}-{os.getpid()}"
        self.limit = limit

    def __enter__(self) -> MemoryCap:
        self.path.mkdir()
        (self.path / "memory.swappiness").write_text("0")
        if self.limit is not None:
            (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
            memsw = self.path / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(self.limit))
        return self

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """Start argv inside the group: a shell joins it, then execs the command."""
        joined = ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh", *argv]
        return subprocess.Popen(joined, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def peak_mib(self) -> float:
        return int((self.path / "memory.max_usage_in_bytes").read_text()) / 2**20

    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return int((self.path / "memory.failcnt").read_text()) and -1  # older kernels: failures only

    def __exit__(self, *exc: object) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while (self.path / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)  # the kernel empties the group as the killed processes exit
        self.path.rmdir()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(strategy: str, cap: int | None, out: Path, extra: list[str]) -> dict:
    """ddp×2 or fsdp×2, each rank in its own cgroup; exit codes, peaks and out-of-memory kills."""
    port, world = free_port(), 2
    run_dir = out / f"{strategy}-{'capped' if cap else 'free'}"
    if strategy == "fsdp" and cap is None:  # what fsdp.cpu_release_memory=auto picks under the cap
        extra = [*extra, "fsdp.cpu_release_memory=true"]
    argv = [sys.executable, "-m", "multicard", "train", *WORKLOAD, f"strategy={strategy}", f"out_dir={run_dir}", *extra]
    caps = [MemoryCap(f"{strategy}-r{rank}", cap) for rank in range(world)]
    for c in caps:
        c.__enter__()
    try:
        ranks = []
        for rank, c in enumerate(caps):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
            ranks.append(c.start(argv, env, out / f"{run_dir.name}-rank{rank}.log"))
        codes = []
        for proc in ranks:
            try:
                codes.append(proc.wait(timeout=900))
            except subprocess.TimeoutExpired:
                codes.append("timeout")
        return {
            "strategy": strategy,
            "cap_mib": cap / 2**20 if cap else None,
            "exit_codes": codes,
            "peak_mib": [round(c.peak_mib()) for c in caps],
            "oom_kills": [c.oom_kills() for c in caps],
            "finished": (run_dir / "checkpoints").exists() and all(code == 0 for code in codes),
        }
    finally:
        for c in caps:
            c.__exit__()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap-mib", type=int, help="per-process cap (default: halfway between fsdp's and ddp's peaks)")
    p.add_argument("--out", type=Path, default=Path("runs/bench-sharded-memory"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if not (CGROUPS / "cgroup.procs").exists() or os.geteuid() != 0:
        sys.exit("needs root and cgroup v1's memory controller at /sys/fs/cgroup/memory")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    if args.cap_mib is None:
        free = {s: run(s, None, args.out, args.overrides) for s in ("ddp", "fsdp")}
        results += free.values()
        print(json.dumps(list(free.values())), flush=True)
        cap = int((max(free["fsdp"]["peak_mib"]) + min(free["ddp"]["peak_mib"])) / 2 * 2**20)
    else:
        cap = args.cap_mib * 2**20
    capped = [run(s, cap, args.out, args.overrides) for s in ("ddp", "fsdp")]
    results += capped
    summary = {
        "cap_mib": round(cap / 2**20),
        "ddp_killed_for_memory": any(k > 0 for k in capped[0]["oom_kills"]) and not capped[0]["finished"],
        "fsdp_trained_to_its_end": capped[1]["finished"],
        "runs": results,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
