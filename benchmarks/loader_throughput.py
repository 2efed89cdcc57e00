"""Large-image input pipeline per core: the workers loader against a plain torchvision pipeline.

On real photos (default ../shared/data/imagenet-sample: one ImageNet photo per class, read in
place) it times, in img/s per core:
- multicard train: the workers loader as `multicard train` builds it (data.loader=workers,
  image_size 224, crop_scale [0.08, 1.0], flip), its DataLoader's uint8 batches;
- reference train: torchvision ImageFolder + RandomResizedCrop(224) + RandomHorizontalFlip +
  ToTensor + Normalize in DataLoader workers;
- multicard eval (eval_resize 256, centre crop 224) and reference eval (Resize(256) +
  CenterCrop(224) + ToTensor + Normalize).
Normalisation is in the reference's time but not in multicard's: multicard normalises on the
training device. Everything is pinned to one core (main process and its one worker), and two
rates are reported: images per CPU-second of those processes (per core, and less moved by other
jobs on a shared machine than wall time: about ±10% a timing), and img/s of wall time on that core.
Repeats (at least 5) alternate in mirrored order (multicard, reference; reference, multicard; ...)
so that load rising or falling through a pair of repeats weighs on both alike; each repeat's ratio
compares the runs of that repeat, and the summary gives the median ratio with its range (min, max).

    python benchmarks/loader_throughput.py [--root DIR] [--repeats 5] [--passes 2] [--core N] [--function]
        [--against OTHER/src] [--floor 1.4]

--function also times `multicard function`: the same photos through a dataset function of JPEG
bytes (data.name=loader_throughput:folder_bytes, README "Your own data"), against multicard's folder.
--against SRC also times the workers loader of another multicard source tree (`before`: e.g. an
older commit's: `git worktree add /tmp/old COMMIT`, then `--against /tmp/old/src`) in a process of
its own on the same core, in the same alternation: `multicard ÷ before` is today's speed per image
against that code's (`--against src`, today against itself, shows what this machine can resolve;
benchmarks/loader_instructions.py counts instructions, which load does not move). --floor R exits 1
unless the median multicard ÷ reference ratio of images per CPU-second is at least R, in training
and in evaluation (wall-time ratios are printed beside it: they hold other jobs' time slices).

The small-image loaders (CIFAR-10) are measured by benchmarks/small_loader_throughput.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from contextlib import ExitStack, suppress
from functools import partial
from pathlib import Path

import PIL
import torch
import torchvision
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision import transforms as T

import multicard
from multicard.base.config import load_config
from multicard.data import build_data
from multicard.data.decoding import jpeg as fast_jpeg
from multicard.data.sources.folders import scan_folder
from multicard.runtime.process_group import ProcessContext

try:
    from multicard.data.loading.sampling import BatchSplit
except ImportError:  # --against code from before issue 23 (2026-12-01), which called it BatchPlan
    from multicard.data.loading.sampling import BatchPlan as BatchSplit

DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "shared" / "data" / "imagenet-sample"
SIZE, RESIZE, SCALE = 224, 256, (0.08, 1.0)
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
MIN_REPEATS = 5
# (epoch, passes) → (img/s of wall time on the pinned core, images per CPU-second of the pipeline's processes)
Timer = Callable[[int, int], tuple[float, float]]


class FolderBytes:
    """An image folder's files as (JPEG bytes, label) items, in the folder's order."""

    def __init__(self, root: str) -> None:
        self.files, self.classes = scan_folder(Path(root), "root")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        return (self.files.root / self.files.paths[i]).read_bytes(), int(self.files.labels[i])


def folder_bytes(split: str, root: str) -> FolderBytes:
    """The dataset function --function times: both splits are the whole folder, as for the links."""
    return FolderBytes(root)


def multicard_loaders(root: Path, link_dir: Path, batch: int, seed: int, function: bool = False, workers: int = 1):
    """(train, eval): epoch → the workers loader's DataLoader (`workers` loader processes each: 0, in
    this process); and the Data to close.

    `multicard train` reads root/train and root/val: here both are links to `root`; with `function`,
    the dataset function `folder_bytes` reads root for both splits.
    """
    if function:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # workers are forked: they inherit the module
        source = ["data.name=loader_throughput:folder_bytes", f"data.kwargs={{root: {root.resolve()}}}"]
    else:
        for split in ("train", "val"):
            (link_dir / split).symlink_to(root.resolve(), target_is_directory=True)
        source = ["data.name=imagefolder", f"data.root={link_dir}"]
    cfg = load_config(
        None,
        [
            *source, "data.loader=workers", f"data.num_workers={workers}",
            f"data.image_size={SIZE}", f"data.eval_resize={RESIZE}", f"data.crop_scale=[{SCALE[0]},{SCALE[1]}]",
            f"data.eval_batch_size={batch}", f"train.global_batch_size={batch}", f"seed={seed}",
        ],
    )  # fmt: skip
    ctx = ProcessContext(0, 0, 1, 1, torch.device("cpu"), distributed=False)
    data = build_data(cfg.data, cfg.seed, BatchSplit(batch, 1, 1), ctx)

    def train(epoch: int) -> Iterable:
        data.train.set_epoch(epoch)
        return data.train.loader  # uint8 batches as they leave the workers (normalised on the device)

    return train, lambda epoch: data.val.loader, data


def reference_loaders(root: Path, batch: int, seed: int):
    normalize = [T.ToTensor(), T.Normalize(MEAN, STD)]
    train_tf = T.Compose([T.RandomResizedCrop(SIZE, scale=SCALE), T.RandomHorizontalFlip(), *normalize])
    eval_tf = T.Compose([T.Resize(RESIZE), T.CenterCrop(SIZE), *normalize])
    common = {"batch_size": batch, "num_workers": 1, "persistent_workers": True}
    generator = torch.Generator().manual_seed(seed)
    train = DataLoader(datasets.ImageFolder(str(root), train_tf), shuffle=True, generator=generator, **common)
    val = DataLoader(datasets.ImageFolder(str(root), eval_tf), shuffle=False, **common)
    return lambda epoch: train, lambda epoch: val


def cpu_seconds() -> float:
    """CPU time so far of this process and its live children (the loaders' workers)."""
    total = sum(os.times()[:2])
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == os.getpid():  # ppid; then utime, stime in clock ticks
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def timed(batches: Callable[[int], Iterable], epoch: int, passes: int) -> tuple[float, float]:
    """(img/s of wall time on the pinned core, images per CPU-second of all the loader's processes)."""
    wall, cpu, n = time.perf_counter(), cpu_seconds(), 0
    for p in range(passes):
        for x, *_ in batches(epoch * passes + p):
            n += x.shape[0]
    return n / (time.perf_counter() - wall), n / (cpu_seconds() - cpu)


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"


def machine() -> str:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class OtherTree:
    """--against SRC: the workers loader of another multicard source tree, in a process of its own.

    That process runs this script with --serve and multicard imported from SRC: it builds the same
    loaders, then times one (train or eval) whenever asked, and answers with one line of JSON.
    """

    def __init__(self, src: Path, args: argparse.Namespace) -> None:
        if not (src / "multicard" / "__init__.py").is_file():
            fail(f"--against {src}: no multicard package there; give the src folder of a checkout "
                 f"(git worktree add /tmp/old COMMIT, then --against /tmp/old/src)")  # fmt: skip
        self.src = src
        paths = [str(src.resolve()), *filter(None, [os.environ.get("PYTHONPATH")])]
        command = [sys.executable, __file__, "--serve", f"--root={args.root}", f"--batch={args.batch}",
                   f"--seed={args.seed}"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.imported = Path(self.answer()["multicard"])
        if not self.imported.resolve().is_relative_to(src.resolve()):
            self.close()
            fail(f"--against {src}: that process imported multicard from {self.imported} instead")

    def answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            fail(f"--against {self.src}: its loader process ended (exit {self.process.wait()}); its error is above")
        return json.loads(line)

    def timer(self, kind: str) -> Timer:
        def timed_there(epoch: int, passes: int) -> tuple[float, float]:
            print(kind, epoch, passes, file=self.process.stdin, flush=True)
            answer = self.answer()
            return answer["wall"], answer["cpu"]

        return timed_there

    def close(self) -> None:
        # Said, not left to the end of its input: loader processes forked here since hold that pipe open.
        with suppress(BrokenPipeError):  # it has ended already (answer() said so)
            print("stop", file=self.process.stdin, flush=True)
        self.process.wait()


def serve(args: argparse.Namespace) -> None:
    """--serve, the other end of OtherTree: requests `KIND EPOCH PASSES` (or `stop`) on stdin, answers on stdout."""
    answers, sys.stdout = sys.stdout, sys.stderr  # anything else printed goes to stderr
    with tempfile.TemporaryDirectory(prefix="multicard-bench-") as links:
        train, evaluate, data = multicard_loaders(args.root, Path(links), args.batch, args.seed)
        loaders = {"train": train, "eval": evaluate}
        print(json.dumps({"multicard": multicard.__file__}), file=answers, flush=True)
        while (request := sys.stdin.readline()) not in ("", "stop\n"):  # "": the parent is gone
            kind, epoch, passes = request.split()
            wall, cpu = timed(loaders[kind], int(epoch), int(passes))
            print(json.dumps({"wall": wall, "cpu": cpu}), file=answers, flush=True)
        data.close()


def pipelines(args: argparse.Namespace, links: Path, closing: ExitStack) -> dict[str, dict[str, Timer]]:
    """kind (train, eval) → who (multicard, reference, function, before) → its Timer."""
    ours_train, ours_eval, data = multicard_loaders(args.root, links, args.batch, args.seed)
    closing.callback(data.close)
    ref_train, ref_eval = reference_loaders(args.root, args.batch, args.seed)
    timers = {
        "train": {"multicard": partial(timed, ours_train), "reference": partial(timed, ref_train)},
        "eval": {"multicard": partial(timed, ours_eval), "reference": partial(timed, ref_eval)},
    }
    if args.function:
        fn_train, fn_eval, fn_data = multicard_loaders(args.root, links, args.batch, args.seed, True)
        closing.callback(fn_data.close)
        timers["train"]["function"], timers["eval"]["function"] = partial(timed, fn_train), partial(timed, fn_eval)
    if args.against:
        other = OtherTree(args.against, args)
        closing.callback(other.close)
        print(f"before: multicard from {other.imported.parent}", flush=True)
        timers["train"]["before"], timers["eval"]["before"] = other.timer("train"), other.timer("eval")
    return timers


def mirrored(names: list[str], repeat: int) -> list[str]:
    """The order of one repeat: as given on even repeats, reversed on odd ones (A B, B A, A B, ...)."""
    return names if repeat % 2 == 0 else names[::-1]


def measure(timers: dict[str, dict[str, Timer]], repeats: int, passes: int) -> tuple[dict, dict]:
    """(wall, cpu): "who kind" → one rate per repeat, the pipelines timed in mirrored order."""
    for by_who in timers.values():  # start the workers and fill the page cache
        for timer in by_who.values():
            timer(0, 1)
    runs = [f"{who} {kind}" for kind, by_who in timers.items() for who in by_who]
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(repeats):
        for kind, by_who in timers.items():
            for who in mirrored(list(by_who), r):
                w, c = by_who[who](r + 1, passes)
                wall[f"{who} {kind}"].append(w)
                cpu[f"{who} {kind}"].append(c)
        line = ", ".join(f"{name} {values[-1]:.0f}" for name, values in cpu.items())
        print(f"repeat {r + 1}: {line} img/CPU-s", flush=True)
    return wall, cpu


# (numerator, denominator) of each ratio reported, when both were timed
RATIOS = (("multicard", "reference"), ("function", "multicard"), ("multicard", "before"))


def ratios(rates: dict[str, list[float]], kind: str) -> dict[str, list[float]]:
    """Each ratio's name ("a ÷ b") → a's rate over b's, per repeat (both timed in that repeat)."""
    return {
        f"{a} ÷ {b}": [x / y for x, y in zip(rates[f"{a} {kind}"], rates[f"{b} {kind}"], strict=True)]
        for a, b in RATIOS
        if f"{a} {kind}" in rates and f"{b} {kind}" in rates
    }


def below_floor(cpu: dict[str, list[float]], floor: float) -> list[str]:
    """The kinds (train, eval) whose median multicard ÷ reference ratio of images per CPU-second is below `floor`."""
    kinds = [name.split()[1] for name in cpu if name.startswith("multicard ")]
    return [kind for kind in kinds if statistics.median(ratios(cpu, kind)["multicard ÷ reference"]) < floor]


def report(wall: dict, cpu: dict, args: argparse.Namespace, core: int, decoder: str) -> dict:
    """Prints the medians and spreads of rates and ratios; returns them (and the setting) for the JSON line."""
    result = {"date": str(datetime.date.today()), "machine": machine(), "decoder": decoder, "root": str(args.root)}
    print(f"\n{args.repeats} alternating repeats of {args.passes} passes over {args.root}, batch {args.batch}")
    for title, rates, unit in (
        ("images per CPU-second of the loader's processes (main + worker)", cpu, "img_per_cpu_s"),
        (f"img/s of wall time, all on CPU {core}", wall, "img_per_s"),
    ):
        print(f"{title}:")
        for name, values in rates.items():
            print(f"  {name:16s} {spread(values)}   [{', '.join(f'{v:.0f}' for v in values)}]")
            result[f"{name.replace(' ', '_')}_{unit}"] = [round(v, 1) for v in values]
        for kind in ("train", "eval"):
            for name, values in ratios(rates, kind).items():
                print(f"  {kind} {name}: {spread(values)}")
                key = name.replace(" ÷ ", "_over_")
                result[f"{kind}_{key}_{unit}"] = [round(v, 3) for v in values]
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="ImageFolder of photos (class folders)")
    p.add_argument("--repeats", type=int, default=MIN_REPEATS, help=f"alternating repeats (at least {MIN_REPEATS})")
    p.add_argument("--passes", type=int, default=2, help="passes over the photos per timing")
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--core", type=int, default=None, help="CPU to pin to (default: the last one allowed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--function", action="store_true", help="also time the photos through a dataset function")
    p.add_argument("--against", type=Path, help="also time the workers loader of another multicard src folder")
    p.add_argument("--floor", type=float, help="exit 1 unless median multicard ÷ reference (per CPU-s) ≥ this")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # OtherTree's process
    args = p.parse_args(argv)
    if not args.root.is_dir():
        fail(f"no photos at {args.root}; pass --root DIR (an ImageFolder: DIR/<class>/<images>)")
    if args.repeats < MIN_REPEATS:
        fail(f"--repeats must be at least {MIN_REPEATS} (ratios are medians of alternating repeats)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.serve:
        return serve(args)  # pinned to the parent's core, which it inherits
    core = args.core if args.core is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})  # before any worker starts: workers inherit it

    decoder = "simplejpeg " + fast_jpeg.simplejpeg.__version__ if fast_jpeg.AVAILABLE else "Pillow"
    print(f"{datetime.date.today()} · {machine()} · pinned to CPU {core} · Python {platform.python_version()}, "
          f"torch {torch.__version__}, torchvision {torchvision.__version__}, Pillow {PIL.__version__}, "
          f"multicard JPEG decoder: {decoder}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="multicard-bench-") as links, ExitStack() as closing:
        timers = pipelines(args, Path(links), closing)
        wall, cpu = measure(timers, args.repeats, args.passes)
    print(json.dumps(report(wall, cpu, args, core, decoder)))
    if args.floor is not None:
        low = below_floor(cpu, args.floor)
        verdict = f"below the floor {args.floor} in {', '.join(low)}" if low else f"at or above the floor {args.floor}"
        print(f"median multicard ÷ reference (images per CPU-second): {verdict}")
        if low:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
