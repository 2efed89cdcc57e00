"""What the plan needs to know of the data: classes, sample counts, and the bytes each process
keeps resident for its loader.

The device loader keeps the decoded uint8 images (training and validation) on the training
device, in every process; on a CPU the embedded and CIFAR-10 sets are held in each process's
memory whichever loader runs. Images are not decoded here: folders are only listed, CIFAR-10's
layout is fixed, and a data.root that is not on this machine is planned without resident data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from multicard.base.config import DataConfig
from multicard.data import loader_for, read_splits

CIFAR10_SAMPLES = (50_000, 10_000)  # data_batch_1..5, test_batch


@dataclass(frozen=True)
class DataFacts:
    num_classes: int
    train: int
    val: int
    held_in_memory: bool  # decoded into each process's memory whatever the loader (synthetic, cifar10)
    note: str = ""

    def decoded_bytes(self, image_size: int) -> int:
        return (self.train + self.val) * 3 * image_size**2


def data_facts(d: DataConfig, seed: int) -> DataFacts:
    if d.name == "synthetic":
        return DataFacts(d.num_classes, d.train_size, d.val_size, True)
    if d.name == "cifar10":
        return DataFacts(10, *CIFAR10_SAMPLES, True)
    local = d.root and (Path(d.root).is_dir() or (d.name == "hf" and Path(d.root).is_file()))  # hf: a parquet file
    if ":" in d.name or local:  # a dataset function is read here: it knows its lengths and classes
        splits = read_splits(d, seed)
        return DataFacts(len(splits.classes), len(splits.train), len(splits.val), False)
    return DataFacts(d.num_classes, 0, 0, False, note=f"data.root={d.root} is not on this machine: "
                     f"planned with data.num_classes={d.num_classes} and no device-resident images")  # fmt: skip


def resident_bytes(d: DataConfig, facts: DataFacts, device_bytes: float, cuda: bool) -> tuple[int, str]:
    """(bytes of decoded images one process keeps on its device, the loader kind: data.loader=auto's
    choice, the data layer's own rule, for a device of `device_bytes`)."""
    kind = loader_for(d, facts.decoded_bytes(d.image_size), device_bytes)
    if kind == "device" or (not cuda and facts.held_in_memory):
        return facts.decoded_bytes(d.image_size), kind
    return 0, kind
