"""Packed shards: `data.name=shards data.root=DIR`, a folder (or a URL's prefix: any fsspec URL,
base/store.py) that `multicard pack` wrote (multicard/tools/pack.py), or such a folder uploaded as it is.

DIR holds plain tar files and one index, `index.json` (the format: data/sources/shard_format.py), that
says for every sample which shard holds it, where its bytes start and how long they are, its label and
its size (width, height: what a crop plan needs without opening the image). The index is read whole and
the shards' sizes checked against it with one listing; a folder without it holds no pack (the index is
written last), and one whose shards it lists are not all there whole is refused. Samples are read by
index and handed to the loaders as a dataset function's items are (encoded bytes, label:
data/sources/user.py), so decoding, augmentation and every guarantee of image folders are the same:
training from shards ends with the parameters training from the packed folder ends with, from local disk
or from a bucket.

Reads: on local disk one `pread` each; on object storage, where each read is a request (~4 ms of the
reading process's CPU: signing, HTTP; docs/benchmarks.md) and a globally shuffled batch holds no
neighbours, a split of at most WHOLE_SPLIT_BYTES (CIFAR-10's 45,000 training images: 116 MB) is read in
whole shards, each once per loader process and kept in its memory, a larger one by ranged requests; a
local cache of whole shards (`data.remote_cache_gb`, shard_cache.py) serves later readers. Either way a
loader process keeps `data.reads_in_flight` reads of its batch going at once, neighbours in one read
(`prefetch`); the batch's contents and order do not change. `data.order=local` (opt-in) orders an epoch
so that a batch holds runs of neighbours (`local_order`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np
import torch

from multicard.base.errors import UserError
from multicard.base.storage import etag
from multicard.base.store import Store
from multicard.data.sources.encoded import EncodedImage
from multicard.data.sources.folders import Items, Splits
from multicard.data.sources.shard_cache import ShardCache, shard_key
from multicard.data.sources.shard_format import INDEX as INDEX  # re-exported: where the readers' users look
from multicard.data.sources.shard_format import PARTIAL as PARTIAL
from multicard.data.sources.shard_format import PackedSplit, read_index

# data.order=local: runs of RUN samples stored next to each other, in a shuffled order, shuffled
# within windows of WINDOW runs (a batch of 256 then reads about 16 runs, each in one read).
RUN, WINDOW = 64, 16
MERGE_GAP = 64 << 10  # reads of a batch whose bytes lie at most this far apart become one read
WHOLE_SPLIT_BYTES = 256 << 20  # a split up to this size on object storage is read in whole shards, kept
PIECE_BYTES = 8 << 20  # a whole shard is read in requests of at most this size, reads_in_flight at once
Source = Callable[[int, int], bytes]  # read(start, length) of one shard


class Kept:
    """A shard's bytes, read whole and kept in this process's memory."""

    def __init__(self, data: bytes, what: str) -> None:
        self.data, self.what = data, what

    def __call__(self, start: int, length: int) -> bytes:
        return self.data[start : start + length]


class ShardSamples:
    """A packed split as a map-style dataset: item i → (the image's encoded bytes as an EncodedImage, its
    label). Its shards are read from the split's store; where each read is a round trip, whole (a split of
    at most WHOLE_SPLIT_BYTES) or through a local `cache` of whole shards (`keys`: each shard's name
    there) that can hold the split, else by ranged requests."""

    def __init__(self, split: PackedSplit, reads_in_flight: int = 1, cache: ShardCache | None = None,
                 keys: list[str] | None = None) -> None:  # fmt: skip
        self.split, self.store, self.names = split, split.store, split.names
        self.shard_of = split.columns["shard"]
        self.offset = split.columns["offset"]
        self.length = split.columns["length"]
        self.labels = split.columns["label"]
        self.width, self.height = split.columns["width"], split.columns["height"]
        self.reads_in_flight = reads_in_flight
        total = sum(split.shard_bytes)
        self.whole = self.store.round_trips and total <= WHOLE_SPLIT_BYTES
        # a split larger than the cache would evict each shard before its next read: a shard per sample
        fits = cache is not None and total <= cache.max_bytes
        self.cache = cache if self.store.round_trips and (self.whole or fits) else None
        self.keys = keys or []
        self._pid = -1  # files and threads belong to one process: a forked loader process opens its own

    def __len__(self) -> int:
        return len(self.labels)

    def _own(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._sources: dict[int, Source] = {}  # shard → how this process reads it
            self._pool: ThreadPoolExecutor | None = None
            self._ready: dict[int, bytes] = {}

    def _open(self, shards: set[int]) -> None:
        """How this process reads each of these shards not opened yet: from the cache or whole where those
        apply (downloaded now, several at once), else by the store's positional reads."""
        missing = sorted(shard for shard in shards if shard not in self._sources)
        if (self.whole or self.cache is not None) and missing:
            self.store.fs()  # the session, opened before the pool's threads share it
            for shard in missing:
                cached = self._cached(shard)
                if cached is not None:
                    self._sources[shard] = cached
            for shard, data in self._download([s for s in missing if s not in self._sources]).items():
                kept = self._keep(shard, data)
                if kept is not None:
                    self._sources[shard] = kept
        for shard in missing:
            if shard not in self._sources:
                self._sources[shard] = self.store.reader(self.names[shard])

    def _cached(self, shard: int) -> Source | None:
        """The shard from the cache, its bytes checked; None where the cache does not hold it."""
        if self.cache is None:
            return None
        key, size, what = self.keys[shard], self.split.shard_bytes[shard], self.split.shards[shard]
        if not self.whole:
            return self.cache.open(key, size, self.split.shard_sha256[shard], what)
        data = self.cache.read(key, size, self.split.shard_sha256[shard], what)
        return Kept(data, str(self.cache.path(key))) if data is not None else None

    def _keep(self, shard: int, data: bytes) -> Source | None:
        """A shard downloaded whole: stored in the cache, and read from memory (a whole split) or from the
        cached file; None where neither holds it (the cache could not store it: ranged requests)."""
        if self.cache is not None:
            self.cache.put(self.keys[shard], data)
        if self.whole:
            return Kept(data, self.split.shards[shard])
        assert self.cache is not None  # _open downloads whole shards only for a whole split or into a cache
        return self.cache.open(self.keys[shard], len(data), None, self.split.shards[shard])

    def _download(self, shards: list[int]) -> dict[int, bytes]:
        """These shards read whole, in requests of PIECE_BYTES, `reads_in_flight` at once; each checked
        against the index's checksum."""
        sizes = self.split.shard_bytes
        pieces = [(shard, start, min(start + PIECE_BYTES, sizes[shard]))
                  for shard in shards for start in range(0, sizes[shard], PIECE_BYTES)]  # fmt: skip
        if not pieces:
            return {}
        with ThreadPoolExecutor(max(1, self.reads_in_flight), thread_name_prefix="multicard-shard-read") as pool:
            data = list(pool.map(lambda piece: self.store.read(self.names[piece[0]], *piece[1:]), pieces))
        whole = {shard: b"".join(part for (s, *_), part in zip(pieces, data, strict=True) if s == shard)
                 for shard in shards}  # fmt: skip
        for shard, got in whole.items():
            expected = self.split.shard_sha256[shard]
            if expected is not None and hashlib.sha256(got).hexdigest() != expected:
                raise UserError(
                    f"shard {self.split.shards[shard]} does not hold what was packed (its checksum is not the one "
                    f"the index gives); restore it or upload the pack again (multicard pack --verify "
                    f"{self.store.url} checks it)"
                )
        return whole

    def read(self, i: int) -> bytes:
        """Sample i's encoded bytes: one positional read of its shard."""
        self._own()
        return self._read_run([i])

    def prefetch(self, indices: list[int]) -> None:
        """Read these samples' bytes now, `reads_in_flight` reads at a time, samples stored close
        together in one read; `__getitem__` then takes them. Results are kept by index, so the order
        in which reads finish changes nothing."""
        self._own()
        self._ready = {}  # the previous batch's, all taken by now (a repeated sample more than once)
        runs = self._runs(indices)
        if self.reads_in_flight <= 1 and len(runs) == len(indices):
            return  # one read per sample, one at a time: as __getitem__ does
        self._open({int(self.shard_of[i]) for i in indices})  # here: the pool's threads only read
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, self.reads_in_flight), thread_name_prefix="multicard-shard-read")
        for run, data in zip(runs, self._pool.map(self._read_run, runs), strict=True):
            start = int(self.offset[run[0]])
            for i in run:
                at = int(self.offset[i]) - start
                self._ready[i] = data[at : at + int(self.length[i])]

    def _runs(self, indices: list[int]) -> list[list[int]]:
        """The samples grouped into runs stored close together (in one shard, gaps ≤ MERGE_GAP)."""
        ordered = sorted(set(indices), key=lambda i: (int(self.shard_of[i]), int(self.offset[i])))
        runs: list[list[int]] = []
        for i in ordered:
            last = runs[-1][-1] if runs else None
            if (
                last is not None
                and self.shard_of[i] == self.shard_of[last]
                and self.offset[i] - (self.offset[last] + self.length[last]) <= MERGE_GAP
            ):
                runs[-1].append(i)
            else:
                runs.append([i])
        return runs

    def _read_run(self, run: list[int]) -> bytes:
        """The bytes from the first sample's start to the last one's end (samples of one shard, in stored order)."""
        first, last = run[0], run[-1]
        shard, start = int(self.shard_of[first]), int(self.offset[first])
        length = int(self.offset[last]) + int(self.length[last]) - start
        try:
            if shard not in self._sources:
                self._open({shard})  # a read outside prefetch (one sample at a time)
            source = self._sources[shard]
            data = source(start, length)
        except OSError as exc:
            raise UserError(
                f"cannot read shard {self.split.shards[shard]} ({exc.strerror or type(exc).__name__}); restore it "
                f"or pack the data again (multicard pack --verify DIR checks a pack)"
            ) from None
        if len(data) != length:  # the index was checked against the shard's size at start-up
            raise UserError(
                f"shard {getattr(source, 'what', self.split.shards[shard])} ends before sample {last}'s bytes: it was "
                f"truncated while in use; restore it or pack the data again (multicard pack)"
            )
        return data

    def sample_list(self, indices: np.ndarray) -> bytes:
        """What tells these samples apart, in order, whatever the pack's path or shard size
        (data.sample_list_fingerprint): the checksum of the split's bytes pack recorded, with the
        labels; else (an older pack, or a share of the split) each one's label, length and size."""
        whole = np.array_equal(indices, np.arange(len(self)))
        if whole and self.split.samples_sha256 is not None:
            return self.split.samples_sha256.encode() + self.labels.tobytes()
        columns = (self.labels, self.length, self.width, self.height)
        return np.stack([column[indices] for column in columns]).tobytes()

    def stored(self) -> torch.Tensor:
        """The samples in the order the shards store them."""
        return torch.from_numpy(np.lexsort((self.offset, self.shard_of)))

    def __getitem__(self, i: int) -> tuple[EncodedImage, int]:
        """The image undecoded, with the header the index holds: nothing is parsed twice."""
        self._own()
        data = self._ready.get(i)
        data = data if data is not None else self.read(i)
        where = f"{self.split.shards[int(self.shard_of[i])]} (sample {i})"  # a URL stays one (no Path)
        header = self.split.header
        size = (int(self.width[i]), int(self.height[i]))
        return EncodedImage(where, data, size, header["format"][i] or None, header["mode"][i]), int(self.labels[i])


def shard_splits(store: Store, reads_in_flight: int = 1, cache: ShardCache | None = None) -> Splits:
    """The training and validation splits of the pack in a store's folder (its index read and its shards
    checked), read through a local `cache` of whole shards where one is given and reads are requests."""
    what = f"data.root={store.url}"
    index, _, listing = read_index(store, what)
    versions = {store.join(name): etag(entry) for name, entry in listing.items()}

    def items(name: str) -> Items:
        split = index.splits[name]
        keys = [shard_key(location, size, versions.get(location, ""))
                for location, size in zip(split.shards, split.shard_bytes, strict=True)]  # fmt: skip
        samples = ShardSamples(split, reads_in_flight, cache, keys)
        return Items(samples, torch.arange(len(split)), len(index.classes), f"data.name=shards {what} ({name})")

    return Splits(items("train"), items("val"), index.classes)


def local_order(stored: torch.Tensor, num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """data.order=local: an epoch's order that reads runs of neighbours. The stored order is cut
    into runs of RUN samples; the runs are shuffled, and the samples of each window of WINDOW runs
    shuffled among themselves. A function of (seed, epoch) over the whole dataset, like the full
    shuffle (sampling.epoch_permutation), so batches, resume and evaluation keep their guarantees."""
    assert len(stored) == num_samples
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    runs = torch.randperm(-(-num_samples // RUN), generator=g)
    parts = []
    for w in range(0, len(runs), WINDOW):
        positions = (runs[w : w + WINDOW, None] * RUN + torch.arange(RUN)).flatten()
        positions = positions[positions < num_samples]
        parts.append(stored[positions[torch.randperm(len(positions), generator=g)]])
    return torch.cat(parts)


def order_of(source: Any, name: str) -> Callable[[int, int, int], torch.Tensor] | None:
    """The sampler's epoch order for data.order=`name`: None for the full shuffle."""
    if name == "global":
        return None
    dataset = getattr(source, "dataset", None)
    if isinstance(dataset, ShardSamples) and torch.equal(source.indices, torch.arange(len(dataset))):
        return partial(local_order, dataset.stored())
    return partial(local_order, torch.arange(len(source)))


def prefetch_items(source: Any, indices: list[int]) -> None:
    """Let a source that reads packed shards fetch a batch's bytes at once (workers.SourceImages)."""
    dataset = getattr(source, "dataset", None)
    if isinstance(dataset, ShardSamples):
        dataset.prefetch([int(source.indices[i]) for i in indices])
