"""Every rank reads its data itself (a folder or a pack on its node's storage, a dataset function
called in each process, a Hugging Face dataset), and all must read the same: ranks whose
datasets differ in length take different numbers of steps and wait for each other in a
collective until dist_timeout_s ends the job blaming no one; ranks with other samples of the same
length train on data nobody asked for.

`check_same_across_ranks` compares at start-up, across ranks, the class names and, per split, the
length and a fingerprint cheap enough not to read any image: the labels and file names a source
holds, a pack's labels and item sizes, a Hugging Face split's labels, the items a split takes of a
dataset function's, at up to SAMPLED positions. A difference is one line, exit 2.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from multicard.base.errors import UserError
from multicard.data.sources.folders import Files, InMemory, Source, Splits
from multicard.data.sources.hf import HFItems
from multicard.data.sources.shards import ShardSamples
from multicard.runtime.process_group import ProcessContext

SAMPLED = 4096  # positions of a split that its fingerprint covers, evenly spread
SPLITS = (("train", "training"), ("val", "validation"))


def fingerprint(source: Source) -> str:
    """A digest of what `source` holds without reading its images, at up to SAMPLED positions."""
    n = len(source)
    at = torch.linspace(0, max(n - 1, 0), min(n, SAMPLED), dtype=torch.float64).round().long()
    digest = hashlib.sha256()
    if isinstance(source, InMemory):
        digest.update(source.labels[at].numpy().tobytes())
    elif isinstance(source, Files):
        digest.update(source.labels[at].numpy().tobytes())
        digest.update("\0".join(source.paths[i] for i in at.tolist()).encode())
    else:  # Items: which items of the dataset, and what its index tells of them
        items = source.indices[at].numpy()
        digest.update(items.tobytes())
        digest.update(str(len(source.dataset)).encode())
        if isinstance(source.dataset, ShardSamples):
            digest.update(source.dataset.labels[items].tobytes() + source.dataset.length[items].tobytes())
        elif isinstance(source.dataset, HFItems):
            digest.update(np.ascontiguousarray(source.dataset.labels[items]).tobytes())
    return digest.hexdigest()[:16]


def summary(splits: Splits) -> dict[str, Any]:
    """What every rank must hold alike: the class names, and per split its length and fingerprint."""
    return {
        "classes": splits.classes,
        **{key: (len(getattr(splits, key)), fingerprint(getattr(splits, key))) for key, _ in SPLITS},
    }


def check_same_across_ranks(splits: Splits, ctx: ProcessContext) -> None:
    """Raise on every rank, in one line said by rank 0, if any rank's data differs from rank 0's
    (a collective: every rank calls it, once its data is read; nothing in one process)."""
    every = ctx.all_gather_object(summary(splits))
    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            error = UserError(
                f"the ranks read different data: {difference(rank, theirs, every[0])}; every rank must read the "
                f"same dataset (the same data.root contents on every node, a dataset function that does not depend "
                f"on the rank)"
            )
            error.every_rank = True  # every rank raises it: rank 0 says it (exits.report_error)
            raise error


def difference(rank: int, theirs: dict[str, Any], first: dict[str, Any]) -> str:
    """The first way rank `rank`'s summary differs from rank 0's, in words."""
    if theirs["classes"] != first["classes"]:
        differ = sorted(set(theirs["classes"]) ^ set(first["classes"]))[:3] or ["their order"]
        return (
            f"rank {rank} has {len(theirs['classes'])} classes, rank 0 {len(first['classes'])} "
            f"(they differ in {', '.join(differ)})"
        )
    for key, words in SPLITS:
        (n, digest), (n0, digest0) = theirs[key], first[key]
        if n != n0:
            return f"rank {rank} has {n} {words} samples, rank 0 {n0}"
        if digest != digest0:
            return f"rank {rank}'s {n} {words} samples are not rank 0's (other labels, files or items)"
    raise AssertionError("summaries that differ differ somewhere")
