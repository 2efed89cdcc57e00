"""What multicard.Run costs a user's loop: seconds per step of the same training written as a plain
hand-written PyTorch loop (DDP, DistributedSampler, DataLoader, GradScaler-free fp32 step) and with
multicard.Run (run.setup, run.loader, run.backward, run.step, run.log), side by side.

Both run the same model on the same in-memory data, in one process or as ddp×2 under torchrun, in
alternating order (plain, library, library, plain, ...) so that a drifting machine favours neither;
each times its steps after a warm-up, inside the process, with nothing else in the window (the
Run's checkpoints fall outside it).

    python bench/library_overhead.py [--repeats 5] [--world-sizes 1,2] [--steps 40] [--batch 64]

Prints each run, then per world size the ratio library / plain (1.00 = free; the target is <= 1.02)
as the median over repeats with its spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
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


def plain(args: argparse.Namespace) -> list[float]:
    """The loop as a user writes it by hand."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    net = model()
    net = nn.parallel.DistributedDataParallel(net) if world > 1 else net
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    data = dataset(args.batch * (args.warmup + args.steps))
    sampler = torch.utils.data.DistributedSampler(data) if world > 1 else None
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch // world, sampler=sampler, drop_last=True)
    marks = []
    for x, y in loader:
        marks.append((time.perf_counter(), time.process_time()))
        loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    marks.append((time.perf_counter(), time.process_time()))
    return marks


def library(args: argparse.Namespace) -> list[float]:
    """The same loop with multicard.Run."""
    import multicard

    run = multicard.Run(args.out, global_batch_size=args.batch, resume="never", log_every=50)
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    net, optimizer = run.setup(net, optimizer)
    train = run.loader(dataset(args.batch * (args.warmup + args.steps)))
    marks = []
    for _ in run.epochs(1):
        for x, y in train:
            marks.append((time.perf_counter(), time.process_time()))
            loss = F.cross_entropy(net(x), y)
            run.backward(loss)
            run.step(optimizer)
            run.log(loss=loss)
        marks.append((time.perf_counter(), time.process_time()))
        break  # the epoch's end (its checkpoint) is not part of the loop's cost
    return marks


def worker(args: argparse.Namespace) -> None:
    marks = {"plain": plain, "library": library}[args.mode](args)
    if int(os.environ.get("RANK", "0")) == 0:
        timed, steps = marks[args.warmup :], len(marks) - args.warmup - 1
        wall, cpu = ((timed[-1][k] - timed[0][k]) / steps for k in (0, 1))
        Path(args.result).write_text(json.dumps({"s_per_step": wall, "cpu_s_per_step": cpu}))


def measure(mode: str, world: int, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    result = tmp / f"{mode}-{world}.json"
    own = [__file__, "--worker", mode, "--result", str(result), "--out", str(tmp / f"run-{mode}-{world}"),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]  # fmt: skip
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)] if world > 1 else []
    cmd = [sys.executable, *launch, *own]
    # Passive OpenMP waits: where other processes share the cores, spinning threads would bill their
    # waits as CPU time (both loops alike).
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world)), "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{mode} ×{world} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(result.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world-sizes", default="1,2")
    p.add_argument("--steps", type=int, default=40, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per run")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--worker", dest="mode", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        return worker(args)
    ratios: dict[tuple[int, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.repeats):
            for world in (int(w) for w in args.world_sizes.split(",")):
                order = ("plain", "library") if i % 2 == 0 else ("library", "plain")
                times = {mode: measure(mode, world, args, Path(folder)) for mode in order}
                line = f"repeat {i} ×{world}:"
                for key in ("s_per_step", "cpu_s_per_step"):
                    ratios.setdefault((world, key), []).append(times["library"][key] / times["plain"][key])
                    line += (f" {key}: plain {1000 * times['plain'][key]:.1f} ms, library "
                             f"{1000 * times['library'][key]:.1f} ms, ratio {ratios[world, key][-1]:.3f};")  # fmt: skip
                print(line, flush=True)
    # Wall time is what a user pays; rank 0's CPU time per step says the same where other processes
    # share the cores (a loaded machine stretches wall time, hardly the CPU time of the work itself).
    for (world, key), values in ratios.items():
        print(f"×{world} {key}: library / plain = {statistics.median(values):.3f} (median of {len(values)}; "
              f"min {min(values):.3f}, max {max(values):.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
