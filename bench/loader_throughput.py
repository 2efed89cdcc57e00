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
rates are reported: images per CPU-second of those processes (per core, and barely moved by
other jobs on a shared machine), and img/s of wall time on that core. Repeats alternate
(multicard, reference, multicard, ...) so that drifting load hits both alike; each repeat's
ratio compares adjacent runs.

    python bench/loader_throughput.py [--root DIR] [--repeats 5] [--passes 2] [--core N] [--function]

--function also times `multicard function`: the same photos through a dataset function of JPEG
bytes (data.name=loader_throughput:folder_bytes, README "Your own data"), against multicard's folder.

The small-image loaders (CIFAR-10) are measured by bench/small_loader_throughput.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import PIL
import torch
import torchvision
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision import transforms as T

from multicard.config import load_config
from multicard.data import build_data
from multicard.data import jpeg as fast_jpeg
from multicard.data.sampling import BatchSplit
from multicard.data.sources import scan_folder
from multicard.process_group import ProcessContext

DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "shared" / "data" / "imagenet-sample"
SIZE, RESIZE, SCALE = 224, 256, (0.08, 1.0)
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


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


def multicard_loaders(root: Path, link_dir: Path, batch: int, seed: int, function: bool = False):
    """(train, eval): epoch → the workers loader's DataLoader (one worker each); and the Data to close.

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
            *source, "data.loader=workers", "data.num_workers=1",
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="ImageFolder of photos (class folders)")
    p.add_argument("--repeats", type=int, default=5, help="alternating repeats (at least 3)")
    p.add_argument("--passes", type=int, default=2, help="passes over the photos per timing")
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--core", type=int, default=None, help="CPU to pin to (default: the last one allowed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--function", action="store_true", help="also time the photos through a dataset function")
    args = p.parse_args()
    if not args.root.is_dir():
        fail(f"no photos at {args.root}; pass --root DIR (an ImageFolder: DIR/<class>/<images>)")
    if args.repeats < 3:
        fail("--repeats must be at least 3 (ratios are medians of alternating repeats)")
    core = args.core if args.core is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})  # before any worker starts: workers inherit it
    torch.set_num_threads(1)

    decoder = "simplejpeg " + fast_jpeg.simplejpeg.__version__ if fast_jpeg.AVAILABLE else "Pillow"
    print(f"{datetime.date.today()} · {machine()} · pinned to CPU {core} · Python {platform.python_version()}, "
          f"torch {torch.__version__}, torchvision {torchvision.__version__}, Pillow {PIL.__version__}, "
          f"multicard JPEG decoder: {decoder}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="multicard-bench-") as links:
        ours_train, ours_eval, data = multicard_loaders(args.root, Path(links), args.batch, args.seed)
        ref_train, ref_eval = reference_loaders(args.root, args.batch, args.seed)
        pairs = {"train": (ours_train, ref_train), "eval": (ours_eval, ref_eval)}
        whos = ("multicard", "reference")
        if args.function:
            fn_train, fn_eval, fn_data = multicard_loaders(args.root, Path(links), args.batch, args.seed, True)
            pairs = {"train": (*pairs["train"], fn_train), "eval": (*pairs["eval"], fn_eval)}
            whos = (*whos, "function")
        for pipelines in pairs.values():  # start the workers and fill the page cache
            for batches in pipelines:
                timed(batches, 0, 1)
        runs = [f"{who} {kind}" for kind in pairs for who in whos]
        wall: dict[str, list[float]] = {name: [] for name in runs}
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(args.repeats):
            for kind, pipelines in pairs.items():
                for who, batches in zip(whos, pipelines, strict=True):
                    w, c = timed(batches, r + 1, args.passes)
                    wall[f"{who} {kind}"].append(w)
                    cpu[f"{who} {kind}"].append(c)
            line = ", ".join(f"{name} {values[-1]:.0f}" for name, values in cpu.items())
            print(f"repeat {r + 1}: {line} img/CPU-s", flush=True)
        data.close()
        if args.function:
            fn_data.close()

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
        for kind in pairs:
            ratios = [a / b for a, b in zip(rates[f"multicard {kind}"], rates[f"reference {kind}"], strict=True)]
            print(f"  {kind} multicard ÷ reference: {spread(ratios)}")
            result[f"{kind}_ratio_{unit}"] = [round(v, 3) for v in ratios]
            if args.function:
                ratios = [a / b for a, b in zip(rates[f"function {kind}"], rates[f"multicard {kind}"], strict=True)]
                print(f"  {kind} function ÷ multicard (folder): {spread(ratios)}")
                result[f"{kind}_function_ratio_{unit}"] = [round(v, 3) for v in ratios]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
