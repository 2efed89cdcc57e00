"""Loader throughput on shared storage: an image folder against its packed shards, through any mount.

Each case is a data source (data.* settings) read by the workers loader with the same
data.num_workers; `--samples` training samples are taken per repeat, with no model at all, so the
loader is the limit. Repeats alternate between the cases, each a fresh epoch (on a `nocache` mount
every epoch crosses the link). Prints one JSON line per measurement and a table (median, min, max),
and per case the shuffle quality of its order (`label_mix_tv`: how far a global batch's class mix is
from the training set's, on average; compare data.order=local with the full shuffle).

    # a real network filesystem on this machine (root): MOUNT/abs/path reads /abs/path over a 1 Gbit/s link
    /work/shared/tools/sharedfs.sh up /tmp/mnt 1gbit nocache
    multicard pack --out /tmp/c10-shards data.name=imagefolder data.root=/work/shared/data/cifar10
    python benchmarks/shared_storage.py --samples 20000 --repeats 3 data.image_size=32 \
        --case folder-mount:data.name=imagefolder,data.root=/tmp/mnt/work/shared/data/cifar10 \
        --case shards-mount:data.name=shards,data.root=/tmp/mnt/tmp/c10-shards

On your own cluster, point the cases at your shared storage (NFS, Lustre, a FUSE mount) and at a
local copy. `--split` also prints where each sample's time goes (storage read, decode, augment:
multicard/tools/input_split.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# The loader processes need both cores: OpenMP threads of this process spinning at their barriers
# (its batches' last step) took half of them (7,980 against 3,855 img/s from local shards). Set
# before torch loads OpenMP, as tests/conftest.py does.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from multicard.base.config import load_config, with_overrides  # noqa: E402
from multicard.data import build_data  # noqa: E402
from multicard.data.loading.sampling import BatchSplit  # noqa: E402
from multicard.runtime.process_group import ProcessContext  # noqa: E402


def parse_case(text: str) -> tuple[str, list[str]]:
    name, _, settings = text.partition(":")
    return name, [s for s in settings.split(",") if s]


def take(loader, epoch: int, samples: int) -> tuple[float, int]:
    """(seconds, samples) to take `samples` training samples of `epoch` from a fresh iterator."""
    loader.set_epoch(epoch)
    start, n = time.perf_counter(), 0
    for x, _ in loader:
        n += x.shape[0]
        if n >= samples:
            break
    return time.perf_counter() - start, n


def label_mix(data, batch: int, epochs: int = 2) -> float:
    """Shuffle quality of the case's order: the mean total-variation distance between each global
    batch's label histogram and the training set's (0: every batch has the set's class mix)."""
    sampler, source = data.train.sampler, data.train.loader.dataset.source
    labels = getattr(source, "labels", None)  # folders; packed shards keep theirs in the dataset
    labels = torch.as_tensor(labels if labels is not None else getattr(source.dataset, "labels", [0]))
    classes = int(labels.max()) + 1
    overall = torch.bincount(labels, minlength=classes) / len(labels)
    distances = []
    for epoch in range(epochs):
        perm = sampler.order(sampler.num_samples, sampler.seed, epoch)
        for start in range(0, len(perm) - batch + 1, batch):
            hist = torch.bincount(labels[perm[start : start + batch]], minlength=classes) / batch
            distances.append(0.5 * (hist - overall).abs().sum().item())
    return statistics.mean(distances)


def measure(cases: list[str], overrides: list[str], samples: int, repeats: int, batch: int) -> dict[str, list[float]]:
    """img/s of each case (NAME:KEY=VALUE,...) per repeat, the repeats alternating between the cases;
    one JSON line per measurement."""
    ctx = ProcessContext(0, 0, 1, 1, torch.device("cpu"), distributed=False)
    base = load_config(None, ["data.loader=workers", "data.num_workers=2", *overrides])
    loaders = {}
    for name, settings in map(parse_case, cases):
        cfg = with_overrides(base, settings)
        start = time.perf_counter()
        data = loaders[name] = build_data(cfg.data, cfg.seed, BatchSplit(batch, 1, 1), ctx)
        mix = round(label_mix(data, batch), 4)
        print(json.dumps({"case": name, "start_up_s": round(time.perf_counter() - start, 2),
                          "train": data.train.num_samples, "label_mix_tv": mix}))  # fmt: skip
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    try:
        for repeat in range(repeats):
            for name, data in loaders.items():
                seconds, n = take(data.train, repeat, samples)
                rates[name].append(n / seconds)
                print(json.dumps({"case": name, "repeat": repeat, "samples": n, "img_per_s": round(n / seconds)}))
    finally:
        for data in loaders.values():
            data.close()
    return rates


def print_table(rates: dict[str, list[float]]) -> None:
    print("| case | img/s median | min | max |\n|---|---|---|---|")
    for name, r in rates.items():
        print(f"| {name} | {statistics.median(r):,.0f} | {min(r):,.0f} | {max(r):,.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", required=True, metavar="NAME:KEY=VALUE[,KEY=VALUE]")
    p.add_argument("--samples", type=int, default=10000, help="training samples per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("overrides", nargs="*", help="settings of every case, e.g. data.num_workers=2")
    args = p.parse_args()
    print_table(measure(args.case, args.overrides, args.samples, args.repeats, args.batch))


if __name__ == "__main__":
    main()
