"""What multicard.Run costs a user's loop: seconds per step of the same training written as a plain
hand-written PyTorch loop (DDP, DistributedSampler, DataLoader, an fp32 step) and with
multicard.Run (run.setup, run.loader, run.backward, run.step, run.log), side by side.

Side by side means step by step: each process holds both loops (two copies of the same model on
the same in-memory data) and alternates them, one step of each in turn (which one goes first
alternates too), timing every step. This machine's step time wanders by ±20% within seconds (a
shared VM), so loops timed in separate runs minutes apart differ by more than what is measured here;
interleaved, both meet the same moments. What the Run adds outside the steps is counted too: its
stall watchdog thread's CPU time (read from /proc) is added to the library's CPU time. Both loops'
steps include fetching their batch; the Run's epoch-end checkpoint falls outside the window.

    python benchmarks/library_overhead.py [--repeats 5] [--world-sizes 1,2] [--steps 60] [--batch 64]

Prints each repeat (a process, or two under torchrun), then per world size the ratio
library / plain of wall time and of rank 0's CPU time per step (1.00 = free; the target is
<= 1.02) as the median over repeats with its spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


def dataset(count: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.rand(count, 3, 32, 32, generator=g), torch.randint(0, 10, (count,)))


def model() -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def plain(args: argparse.Namespace, world: int) -> Iterator[None]:
    """The loop as a user writes it by hand; yields after each step."""
    net = model()
    net = nn.parallel.DistributedDataParallel(net) if world > 1 else net
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    data = dataset(args.batch * (args.warmup + args.steps))
    sampler = torch.utils.data.DistributedSampler(data) if world > 1 else None
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch // world, sampler=sampler, drop_last=True)
    for x, y in loader:
        loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        yield


def library(run: object, args: argparse.Namespace) -> Iterator[None]:
    """The same loop with multicard.Run; yields after each step."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    net, optimizer = run.setup(net, optimizer)
    train = run.loader(dataset(args.batch * (args.warmup + args.steps)))
    for _ in run.epochs(1):
        for x, y in train:
            loss = F.cross_entropy(net(x), y)
            run.backward(loss)
            run.step(optimizer)
            run.log(loss=loss)
            yield


def thread_cpu_s(name: str) -> float:
    """CPU seconds the Python thread called `name` has used (0 if there is none)."""
    for thread in threading.enumerate():
        if thread.name == name and thread.native_id is not None:
            fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return 0.0


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import multicard

    world = int(os.environ.get("WORLD_SIZE", "1"))
    run = multicard.Run(args.out, global_batch_size=args.batch, resume="never", log_every=50)  # starts the group
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    loops = {"plain": plain(args, world), "library": library(run, args)}
    spent = {mode: [0.0, 0.0] for mode in loops}  # wall, CPU seconds of the timed steps
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            watchdog_before = thread_cpu_s("multicard-watchdog")
        for mode in ("plain", "library") if step % 2 == 0 else ("library", "plain"):
            wall, cpu = time.perf_counter(), time.process_time()
            next(loops[mode])
            if step >= args.warmup:
                spent[mode][0] += time.perf_counter() - wall
                spent[mode][1] += time.process_time() - cpu
    # The watchdog ran through both loops' steps; its CPU time is the library's alone.
    watchdog = thread_cpu_s("multicard-watchdog") - watchdog_before
    spent["library"][1] += watchdog / 2
    spent["plain"][1] -= watchdog / 2
    if int(os.environ.get("RANK", "0")) == 0:
        result = {f"{mode}_{key}": value / args.steps for mode, (wall, cpu) in spent.items()
                  for key, value in (("s_per_step", wall), ("cpu_s_per_step", cpu))}  # fmt: skip
        Path(args.result).write_text(json.dumps(result | {"watchdog_cpu_s": watchdog}))
    loops["library"].close()  # leave the Run's epoch without its checkpoint
    run.close()


def measure(world: int, args: argparse.Namespace, tmp: Path, repeat: int) -> dict[str, float]:
    result = tmp / f"{world}-{repeat}.json"
    own = [__file__, "--worker", "--result", str(result), "--out", str(tmp / f"run-{world}-{repeat}"),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]  # fmt: skip
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)] if world > 1 else []
    # Passive OpenMP waits: where processes share the cores, spinning threads would bill their
    # waits as CPU time (both loops alike).
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world)), "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run([sys.executable, *launch, *own], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"×{world} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(result.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world-sizes", default="1,2")
    p.add_argument("--steps", type=int, default=60, help="timed steps of each loop per repeat")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps of each loop per repeat")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    ratios: dict[tuple[int, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.repeats):
            for world in (int(w) for w in args.world_sizes.split(",")):
                t = measure(world, args, Path(folder), i)
                line = f"repeat {i} ×{world}:"
                for key in ("s_per_step", "cpu_s_per_step"):
                    ratios.setdefault((world, key), []).append(t[f"library_{key}"] / t[f"plain_{key}"])
                    line += (f" {key}: plain {1000 * t[f'plain_{key}']:.1f} ms, library "
                             f"{1000 * t[f'library_{key}']:.1f} ms, ratio {ratios[world, key][-1]:.3f};")  # fmt: skip
                print(f"{line} watchdog CPU {1000 * t['watchdog_cpu_s']:.0f} ms in all", flush=True)
    for (world, key), values in sorted(ratios.items()):
        print(f"×{world} {key}: library / plain = {statistics.median(values):.3f} (median of {len(values)}; "
              f"min {min(values):.3f}, max {max(values):.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
