"""Instructions per image of the workers loader's per-image path, counted by valgrind's callgrind.

On a shared machine CPU time per image moves by ±10–20% with other jobs' load; the instructions
an image takes do not. This runs IMAGES training images of the ImageNet sample (as
benchmarks/loader_throughput.py sets them up: random resized crop 224 + flip) through what one loader
process does to them — the Dataset's batch read (`__getitems__` where it has one), torch's collate —
and what the training process then does (the DeviceTransform), in this one process, in batches
of 50; callgrind counts only that part (it is switched on after the set-up and a first image).

    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/new.cg \\
        python benchmarks/loader_instructions.py [IMAGES]          # default 300; callgrind prints "Collected"
    PYTHONPATH=OTHER/src valgrind ... python benchmarks/loader_instructions.py   # another tree (e.g. an older commit)

Divide "Collected" by IMAGES; two runs with different IMAGES give the per-image slope without
the fixed cost of switching callgrind on and off (a few hundred thousand instructions).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from loader_throughput import DEFAULT_ROOT, multicard_loaders
from torch.utils.data import default_collate

import multicard

BATCH = 50


def callgrind(switch: str) -> None:
    """Instrumentation on or off; nothing outside valgrind (whose preloaded library says it is there)."""
    if "vgpreload" not in os.environ.get("LD_PRELOAD", ""):
        return
    command = ["callgrind_control", f"--instr={switch}", str(os.getpid())]
    answer = subprocess.run(command, capture_output=True, text=True, check=False).stdout
    if "OK." not in answer:  # it exits 0 either way
        raise SystemExit(f"error: {' '.join(command)} did not switch: {answer.strip()}; run again")


def main() -> None:
    images = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="multicard-bench-") as links:
        _, _, data = multicard_loaders(DEFAULT_ROOT, Path(links), BATCH, seed=0, workers=0)
        dataset, finish = data.train.loader.dataset, data.train.finish
        read = getattr(dataset, "__getitems__", None) or (lambda keys: [dataset[key] for key in keys])
        dataset[(0, 0)]  # first-use costs (imports, caches) stay out of the count
        callgrind("on")
        for start in range(0, images, BATCH):
            x, y, indices = default_collate(read([(1, i) for i in range(start, min(start + BATCH, images))]))
            finish(x, y, indices, 1)
        callgrind("off")
    print(f"{images} images through the workers loader's per-image path of {Path(multicard.__file__).parent}")


if __name__ == "__main__":
    main()
