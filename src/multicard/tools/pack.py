"""`multicard pack`: any dataset multicard reads, packed into shards for shared storage (the format:
data/sources/shard_format.py; its reader: data/sources/shards.py).

    multicard pack --out /shared/cifar10-shards data.name=imagefolder data.root=/data/cifar10
    multicard pack --verify /shared/cifar10-shards
    multicard pack --out s3://bucket/cifar10-shards data.name=imagefolder data.root=/data/cifar10

The dataset is what `data.*` names (an image folder, CIFAR-10, a dataset function, a Hugging Face
dataset), split as training would split it. Image files keep their encoded bytes; images that come
as pixels are stored as PNG (lossless: the loaders decode the same pixels).

Samples are stored in a fixed shuffled order (`stored_order`), the index saying where each one is.
Every core packs: the stored order is cut into chunks that processes read (bytes and header only;
no image is decoded) into tar members in `.partial/`; then processes copy runs of chunks into
shards of about `--shard-mb`. Everything is written under a temporary name and renamed when whole, and the
index comes last, so an interrupted pack never looks complete; a rerun continues from the chunks
already packed, or starts over when the source or the options changed, and says which.

`--out` is a folder or a URL (any fsspec URL), one store either way (base/store.py): the pack is made in
the folder itself, or for a URL in a staging folder of the temporary directory (`staging_folder`), then
published (shard_format.upload_pack): its shards, and its index last, the commit; a rerun completes an
interrupted upload, leaving the shards that are there whole.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import signal
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from multicard.base.atomic import remove_temporaries, write_text_atomic
from multicard.base.config import READS_ROOT, DataConfig
from multicard.base.errors import UserError
from multicard.base.store import Store, open_store
from multicard.data import Files, Items, Splits, capped_to_cores, encoded_sample, image_header, shard_format
from multicard.runtime.exits import die_with_parent
from multicard.runtime.process_group import cpu_cores

if TYPE_CHECKING:
    from rich.console import Console

MAX_CHUNK = 1000  # samples per chunk: small enough for progress and balance, large enough to cost little
STORED_ORDER_SEED = 0
# what reading a chunk's samples tells, per sample
RECORDS = ("length", "label", "width", "height", *shard_format.HEADER)
# What a failed write of a pack (disk full, quota) advises: what was finished is kept, the rest removed.
RERUN = "free space or choose another --out, then run the same command: it continues from the chunks already packed"


# ---------------------------------------------------------------- the plan: chunks of each split


@dataclass(frozen=True)
class Chunk:
    split: str
    number: int
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"{self.split}-{self.number:05d}"


def chunk_size(n: int) -> int:
    return max(8, min(MAX_CHUNK, math.ceil(n / 64)))


def stored_order(n: int) -> list[int]:
    """The sample stored at each position of a split's shards: a fixed shuffle, so that neighbours in
    a shard are a mix of classes (a locality-aware order reads runs of them: data/sources/shards.py). The
    index gives each sample where it is, so the split's order stays the source's."""
    # numpy, not torch: packing processes are forked, and torch's thread pool can hang after a fork
    return np.random.default_rng(STORED_ORDER_SEED).permutation(n).tolist()


def plan_chunks(sizes: dict[str, int]) -> list[Chunk]:
    chunks = []
    for split, n in sizes.items():
        step = chunk_size(n)
        chunks += [Chunk(split, k, s, min(s + step, n)) for k, s in enumerate(range(0, n, step))]
    return chunks


def fingerprint(splits: Splits) -> str:
    """What the source is: files by path, label, size and time; pixels by content; a dataset's items
    by name and count (their contents are not read twice)."""
    h = hashlib.sha256(json.dumps(splits.classes).encode())
    for source in (splits.train, splits.val):
        if isinstance(source, Files):
            for path, label in zip(source.paths, source.labels.tolist(), strict=True):
                st = os.stat(source.root / path)
                h.update(f"{source.root / path}\t{label}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
        elif isinstance(source, Items):
            h.update(f"{source.name}\t{len(source.dataset)}\t{type(source.dataset).__name__}\n".encode())
            h.update(source.indices.numpy().tobytes())
        else:
            h.update(np.ascontiguousarray(source.images.numpy()).tobytes())
            h.update(source.labels.numpy().tobytes())
    return h.hexdigest()[:32]


# ---------------------------------------------------------------- work done by the packing processes

_SPLITS: Splits | None = None  # set before the processes fork: they inherit the sources


def _worker_signals(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the pool (and says so in one line)
    # A parent killed (SIGKILL) reads no more results: its workers end with it, quietly (SIGTERM),
    # not with tracebacks of broken pipes when they send the next one.
    die_with_parent(parent)


def _records_path(partial: Path, chunk: Chunk) -> Path:
    return partial / f"{chunk.name}.json"


def pack_chunk(partial: Path, chunk: Chunk) -> int:
    """Chunk's samples as tar members in `<chunk>.part`, and their records in `<chunk>.json`
    (written last: a chunk counts as packed when it has one)."""
    source = getattr(_SPLITS, chunk.split)
    records: dict[str, list] = {key: [] for key in (*RECORDS, "sha256")}
    tmp = partial / f".{chunk.name}.part.tmp"
    order = stored_order(len(source))
    try:
        with tmp.open("wb") as f:
            for i in order[chunk.start : chunk.stop]:
                data, ext, label, width, height, format, mode = encoded_sample(source, i)  # its errors: one line
                f.write(shard_format.sample_block(i, data, ext, label))
                for key, value in zip(RECORDS, (len(data), label, width, height, ext, format, mode), strict=True):
                    records[key].append(value)
                records["sha256"].append(hashlib.sha256(data).hexdigest())
        os.replace(tmp, partial / f"{chunk.name}.part")
    except OSError as exc:
        raise cannot_write(partial / f"{chunk.name}.part", exc) from None
    finally:
        tmp.unlink(missing_ok=True)  # only finished chunks stay
    write_text_atomic(_records_path(partial, chunk), json.dumps(records), RERUN)
    return chunk.stop - chunk.start


def cannot_write(path: Path, exc: OSError) -> UserError:
    """A write of the pack failed (disk full, quota, read-only): as atomic.write_atomic says it."""
    return UserError(f"cannot write {path} ({exc.strerror or type(exc).__name__}); {RERUN}")


def pack_shard(partial: Path, out: Path, shard: tuple[str, list[tuple[str, int, int]]]) -> dict[str, Any]:
    """Shard (its name, runs of the chunks' samples: part file, start, length): its entry of the index."""
    name, pieces = shard
    try:
        return shard_format.write_shard(out, name, [(partial / part, start, length) for part, start, length in pieces])
    except OSError as exc:
        raise cannot_write(out / name, exc) from None


# ---------------------------------------------------------------- the command


@dataclass(frozen=True)
class PackOptions:
    out: Path
    shard_mb: float = 256.0
    workers: int = 0  # 0: every core


def describe(d: DataConfig) -> str:
    settings = {"name": d.name, "root": d.root, "val_root": d.val_root, "kwargs": dict(d.kwargs) or None}
    return " ".join(f"data.{key}={value}" for key, value in settings.items() if value)


def _prepare_out(out: Path, plan: dict[str, Any], say: Callable[[str], None]) -> str:
    """'fresh', 'continuing', 'done' or 'starting over': what the folder holds, made ready for this plan."""
    index, partial = out / shard_format.INDEX, out / shard_format.PARTIAL
    if not (index.is_file() or partial.is_dir()):
        check_out(out)
        return "fresh"
    finished = index.is_file()  # a pack, its plan in its index; else an unfinished one, its plan in plan.json
    try:
        stored = json.loads((index if finished else partial / "plan.json").read_text())
        same = same_plan(stored, plan) if finished else stored == plan
    except (OSError, ValueError, AttributeError):
        same = False
    if same:
        return "done" if finished else "continuing"
    was = ("its pack was made from another source or with other options" if finished
           else "its unfinished pack was of another source or other options")  # fmt: skip
    say(f"multicard pack: starting over in {out}: {was}")
    if finished:
        index.unlink()  # first: from here on the folder no longer looks complete
    _clear(out)
    return "starting over"


def check_out(out: Path) -> None:
    """A new or empty folder, or one holding a pack (finished or not): never another's files."""
    store = open_store(str(out), "--out")
    if store.in_the_way():
        raise UserError(f"--out {out} is a file; give a folder (the pack is written inside it)")
    shard_format.check_pack_target(store)


def _clear(out: Path) -> None:
    shutil.rmtree(out / shard_format.PARTIAL, ignore_errors=True)
    for path in [*out.glob("*.tar"), *out.glob(".*.tmp")]:
        path.unlink()


def _shard_pieces(chunks: list[Chunk], records: dict[str, dict], shard_bytes: int) -> tuple[list, dict[str, dict]]:
    """Cut each split's chunks into shards of about shard_bytes (at sample boundaries).

    ([(shard name, [(part file, start, length)])], {split: index columns, and its shards' names})."""
    shards: list[tuple[str, list[tuple[str, int, int]]]] = []
    columns = {}
    for split in dict.fromkeys(c.split for c in chunks):
        cols: dict[str, list] = {key: [] for key in (*shard_format.COLUMNS, *shard_format.HEADER)}
        names: list[str] = []
        pieces: list[tuple[str, int, int]] = []
        filled = 0  # bytes of the shard being planned
        for chunk in (c for c in chunks if c.split == split):
            rec, part, at = records[chunk.name], f"{chunk.name}.part", 0
            for k, length in enumerate(rec["length"]):
                size = shard_format.block_size(length)
                if filled and filled + size > shard_bytes:
                    names.append(shard_format.shard_name(split, len(names)))
                    shards.append((names[-1], pieces))
                    pieces, filled = [], 0
                if pieces and pieces[-1][0] == part and pieces[-1][1] + pieces[-1][2] == at:
                    pieces[-1] = (part, pieces[-1][1], pieces[-1][2] + size)  # one copy per run of samples
                else:
                    pieces.append((part, at, size))
                cols["shard"].append(len(names))
                cols["offset"].append(filled + shard_format.BLOCK)
                for key in RECORDS:
                    cols[key].append(rec[key][k])
                filled, at = filled + size, at + size
        # every split has samples: the last shard is never empty
        names.append(shard_format.shard_name(split, len(names)))
        shards.append((names[-1], pieces))
        order = stored_order(len(cols["shard"]))  # stored position → sample: the index lists samples in order
        columns[split] = {**{key: [values[p] for p in np.argsort(order)] for key, values in cols.items()},
                          "names": names}  # fmt: skip
    return shards, columns


def samples_digest(stored: list[str], n: int) -> str | None:
    """A split's n samples as one checksum, whatever its shards: of each sample's sha256 (given in
    stored order) in the split's order. None where they are not all known (chunks packed by an
    earlier multicard)."""
    if len(stored) != n:
        return None
    by_sample = [b""] * n
    for position, sample in enumerate(stored_order(n)):
        by_sample[sample] = bytes.fromhex(stored[position])
    return hashlib.sha256(b"".join(by_sample)).hexdigest()


def _chunks_to_pack(
    out: Path, plan: dict[str, Any], sizes: dict[str, int], continuing: bool, console: Any
) -> tuple[Path, list[Any], list[Any]]:
    """The unfinished pack's folder (made, with the plan in it), every chunk, and those not packed yet."""
    partial = out / shard_format.PARTIAL
    try:
        partial.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise cannot_write(partial, exc) from None
    write_text_atomic(partial / "plan.json", json.dumps(plan), RERUN)
    chunks = plan_chunks(sizes)
    todo = [c for c in chunks if not _records_path(partial, c).is_file()]
    if continuing:
        console.print(
            f"multicard pack: continuing the unfinished pack in {out}: {len(chunks) - len(todo)} of {len(chunks)} "
            f"chunks already packed",
            highlight=False,
        )
    return partial, chunks, todo


def pack_plan(d: DataConfig, splits: Splits, shard_mb: float) -> dict[str, Any]:
    """What a pack is made of and how: the index keeps it, and a pack with another plan is made again."""
    sizes = {"train": len(splits.train), "val": len(splits.val)}
    return {
        "fingerprint": fingerprint(splits), "source": describe(d), "shard_bytes": int(shard_mb * 2**20),
        "sizes": sizes, "chunk": {s: chunk_size(n) for s, n in sizes.items()}, "version": shard_format.VERSION,
        "stored_order_seed": STORED_ORDER_SEED,
    }  # fmt: skip


def pack(d: DataConfig, splits: Splits, options: PackOptions, progress_console: Console | None = None) -> str:
    """Pack the splits into options.out; the one-line summary of what was done."""
    from rich.console import Console

    console = progress_console or Console(stderr=True)
    out = options.out
    plan = pack_plan(d, splits, options.shard_mb)
    sizes = plan["sizes"]
    state = _prepare_out(out, plan, lambda line: console.print(line, highlight=False))
    if state == "done":
        return f"{out} already holds this pack ({sum(sizes.values())} samples); multicard pack --verify {out} checks it"
    partial, chunks, todo = _chunks_to_pack(out, plan, sizes, state == "continuing", console)
    # The same cap as data.num_workers: more processes than cores only compete for them.
    workers = capped_to_cores(options.workers or cpu_cores(), f"--workers {options.workers}", 1, say=True)
    try:
        index_columns, written = _pack_in_processes(splits, out, chunks, todo, plan, workers, console)
    finally:  # a failed or stopped pack keeps its finished chunks and shards, and nothing half-written
        remove_temporaries(out)
        remove_temporaries(partial)
    shard_format.write_index(out, shard_format.index_document(splits.classes, plan, index_columns, written), RERUN)
    shutil.rmtree(partial, ignore_errors=True)
    total = sum(s["bytes"] for s in written.values())
    return (
        f"packed {sizes['train']} training and {sizes['val']} validation samples into {len(written)} shard(s), "
        f"{total / 2**20:.1f} MiB, in {out}"
    )


def _pack_in_processes(splits: Splits, out: Path, chunks: list[Chunk], todo: list[Chunk], plan: dict[str, Any],
                       workers: int, console: Any) -> tuple[dict[str, dict], dict[str, dict]]:  # fmt: skip
    """Pack the chunks still to do, then write the shards, in `workers` processes: (index columns, shards written)."""
    from rich import progress

    global _SPLITS
    partial = out / shard_format.PARTIAL
    columns = [progress.TextColumn("{task.description}"), progress.BarColumn(), progress.MofNCompleteColumn(),
               progress.TimeElapsedColumn(), progress.TextColumn("ETA"), progress.TimeRemainingColumn()]  # fmt: skip
    _SPLITS = splits
    context = multiprocessing.get_context("fork")  # the processes inherit the sources (no pickling)
    try:
        pool = context.Pool(workers, initializer=_worker_signals, initargs=(os.getpid(),))
        # Transient: the bar goes when done; the one line that follows says what was done, or what failed.
        with pool, progress.Progress(*columns, console=console, transient=True) as bar:  # leaving ends the processes
            done = sum(c.stop - c.start for c in chunks if c not in todo)
            reading = bar.add_task("reading samples", total=sum(plan["sizes"].values()), completed=done)
            for n in pool.imap_unordered(functools.partial(pack_chunk, partial), todo):
                bar.advance(reading, n)
            records = {c.name: json.loads(_records_path(partial, c).read_text()) for c in chunks}
            shards, index_columns = _shard_pieces(chunks, records, plan["shard_bytes"])
            for split, cols in index_columns.items():
                stored = [h for c in chunks if c.split == split for h in records[c.name].get("sha256", [])]
                cols["samples_sha256"] = samples_digest(stored, plan["sizes"][split])
            writing = bar.add_task("writing shards", total=len(shards))
            written = {}
            for entry in pool.imap_unordered(functools.partial(pack_shard, partial, out), shards):
                written[entry["name"]] = entry
                bar.advance(writing)
    finally:
        _SPLITS = None
    return index_columns, written


# ---------------------------------------------------------------- verify


def verify_pack(out: str) -> str:
    """Everything the index states: its entries (shard_format.read_index: inside their shards, labels of its
    classes), both splits with the counts the pack planned, every shard whole (size, sha256), its
    members where the index says with the index's labels, each image's size, format and mode as
    the index gives them, the checksum of each split's samples, and the index as pack wrote it
    (its digest: class names, source). `out`: a folder, or a URL (each shard read whole, one at a time)."""
    store = open_store(str(out), "--verify", DataConfig().read_retries)
    index, raw, _ = shard_format.read_index(store, f"--verify {store.url}")
    samples = sum(_verify_split(index, raw, name, store) for name in index.splits)
    if "digest" in raw and raw["digest"] != shard_format.index_digest(raw):  # packs of before the digest have none
        raise UserError(f"index {index.path} was changed after packing (its class names or source differ); pack again")
    shards = sum(len(s.shards) for s in index.splits.values())
    checked = "sizes, checksums, tar members, labels, images"
    return f"{store.url}: {samples} samples in {shards} shard(s) verified ({checked})"


def _verify_split(index: shard_format.Index, raw: dict[str, Any], name: str, store: Store) -> int:
    """verify_pack's checks of one split; its number of samples."""
    split = index.splits[name]
    planned = raw.get("plan", {}).get("sizes", {}).get(name, len(split))
    if planned != len(split):
        raise UserError(f"index {index.path} lists {len(split)} {name} samples, its pack {planned}; pack again")
    hashes = [b""] * len(split)  # each sample's sha256, filled by the members' check
    for number, path in enumerate(split.shards):
        mine = np.flatnonzero(split.columns["shard"] == number)
        mine = mine[np.argsort(split.columns["offset"][mine])]  # in the order they are stored
        with store.open_binary(path.rsplit("/", 1)[-1]) as f:
            if shard_format.stream_digest(f) != raw["splits"][name]["shards"][number]["sha256"]:
                raise UserError(f"shard {path} does not hold what was packed (its checksum differs); pack again")
            f.seek(0)
            _check_members(index, name, path, f, mine, hashes)
    if split.samples_sha256 is not None and hashlib.sha256(b"".join(hashes)).hexdigest() != split.samples_sha256:
        raise UserError(f"index {index.path}: the checksum of the {name} samples differs from its record; pack again")
    return len(split)


def _check_members(index: shard_format.Index, split_name: str, path: str, f: IO[bytes], mine: np.ndarray,
                   hashes: list[bytes]) -> None:  # fmt: skip
    """The shard's members are the samples `mine` (in stored order) where the index says, with its
    labels and headers; each one's sha256 into `hashes`."""
    cols, ext = index.splits[split_name].columns, index.splits[split_name].header["ext"]
    try:
        with tarfile.open(fileobj=f) as tar:
            members = tar.getmembers()
            images, labels = members[0::2], members[1::2]
            if len(images) != len(mine) or len(labels) != len(mine):
                raise UserError(f"shard {path} holds {len(members)} members, the index {2 * len(mine)}; pack again")
            for i, image, label in zip(mine.tolist(), images, labels, strict=True):
                member = f"{shard_format.sample_key(i)}.{ext[i]}"
                if (image.name, image.offset_data, image.size) != (member, cols["offset"][i], cols["length"][i]):
                    raise UserError(f"shard {path}: member {image.name} is not where the index says; pack again")
                if _member_bytes(tar, label, path) != str(int(cols["label"][i])).encode():
                    raise UserError(f"shard {path}: the label of {image.name} differs from the index; pack again")
                data = _member_bytes(tar, image, path)
                _check_header(index, split_name, i, data, path)
                hashes[i] = hashlib.sha256(data).digest()
    except tarfile.TarError as exc:
        raise UserError(f"shard {path} is not a readable tar file ({exc}); pack again") from None


def _member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo, path: str) -> bytes:
    """A member's bytes; one line for a member that holds none (a folder, a device: no file of a pack)."""
    f = tar.extractfile(member)
    if f is None:
        raise UserError(f"shard {path}: member {member.name} is not a file; pack again")
    return f.read()


def _check_header(index: shard_format.Index, split_name: str, i: int, data: bytes, shard: str) -> None:
    """Sample i's width, height, format, mode and extension in the index are its image's (a crop plan uses them)."""
    split = index.splits[split_name]
    header = [split.header[key][i] for key in ("format", "mode", "ext")]
    stated = (int(split.columns["width"][i]), int(split.columns["height"][i]), *header)
    try:
        found = image_header(data)
    except ValueError as exc:
        raise UserError(
            f"shard {shard}: sample {i} of split {split_name} is no readable image ({exc}); pack again"
        ) from None
    if found != stated:
        said, is_ = ("{}x{} {} {} (.{})".format(*values) for values in (stated, found))
        raise UserError(
            f"index {index.path} says sample {i} of split {split_name} is {said}, but its image in {shard} is {is_}; "
            f"pack again"
        )


def run_pack(config: str | None, overrides: list[str], out: str | None, verify: str | None, shard_mb: float,
             workers: int) -> str:  # fmt: skip
    """What `multicard pack` does; its one-line summary."""
    from multicard.base.config import load_config
    from multicard.data import read_splits

    if verify:
        return verify_pack(verify)
    if not out:
        raise UserError("multicard pack needs --out DIR (the folder to pack into), or --verify DIR")
    store = open_store(out, "--out")
    if not shard_mb > 0:
        raise UserError(f"--shard-mb {shard_mb} must be > 0 (the size of one shard in MiB, e.g. 256)")
    if workers < 0:
        raise UserError(f"--workers {workers} must be >= 0 (0: every core)")
    cfg = load_config(config, overrides)
    if cfg.data.name == "shards":
        raise UserError("data.name=shards is packed already; name the dataset to pack (e.g. data.name=imagefolder)")
    store.retries = cfg.data.read_retries
    check_apart(store, cfg.data)
    store.check_writable("--out")  # a file in its path, or a folder that cannot be written
    shard_format.check_pack_target(store)  # before reading the dataset
    return pack_into(cfg.data, read_splits(cfg.data, cfg.seed), store, shard_mb, workers)


def staging_folder(url: str) -> Path:
    """Where a pack for `url` is made before it is uploaded: one folder per URL in the temporary
    directory (TMPDIR), so that a rerun after an interruption continues from what was packed there."""
    return Path(tempfile.gettempdir()) / f"multicard-pack-{hashlib.sha256(url.encode()).hexdigest()[:16]}"


def pack_into(d: DataConfig, splits: Splits, store: Store, shard_mb: float, workers: int) -> str:
    """Pack into the store's folder: made there, or in a staging folder and published (shard_format.upload_pack:
    the shards, then the index last), the staging folder removed once the index is up. The one-line summary."""
    from rich.console import Console

    console = Console(stderr=True)
    plan = pack_plan(d, splits, shard_mb)
    n = sum(plan["sizes"].values())
    if same_plan(shard_format.stored_index(store), plan):
        return f"{store.url} already holds this pack ({n} samples); multicard pack --verify {store.url} checks it"
    with store.workspace(staging_folder(store.url)) as staging:
        pack(d, splits, PackOptions(staging, shard_mb, workers), console)
        say = lambda line: console.print(line, highlight=False, soft_wrap=True)  # noqa: E731
        written = shard_format.upload_pack(staging, store, say)
        packed = json.loads((staging / shard_format.INDEX).read_text())
    shards = [shard for split in packed["splits"].values() for shard in split["shards"]]
    there = len(shards) - (len(written) - 1)  # written: the shards uploaded, then the index
    published = (f" ({f'{there} of them there already, ' if there else ''}index.json uploaded last)"
                 if written else "")  # fmt: skip
    return (
        f"packed {len(splits.train)} training and {len(splits.val)} validation samples, "
        f"{sum(shard['bytes'] for shard in shards) / 2**20:.1f} MiB, into {len(shards)} shard(s) in {store.url}"
        f"{published}"
    )


def same_plan(index: dict[str, Any] | None, plan: dict[str, Any]) -> bool:
    """Whether a pack's index (None: no pack) is of this plan: the same source, packed the same way."""
    return index is not None and index.get("fingerprint") == plan["fingerprint"] and index.get("plan") == plan


def check_apart(store: Store, d: DataConfig) -> None:
    """The pack's folder and the dataset's apart: a pack inside the source becomes part of it (a class
    folder of shards), and a source inside the pack's folder would be cleared by a pack starting over."""
    roots = {"data.root": d.root if d.name in READS_ROOT else None, "data.val_root": d.val_root}
    for key, root in roots.items():
        where = store.overlaps(root) if root else None
        if where == "inside":
            raise UserError(
                f"--out {store.url} lies inside {key}={root}, the dataset being packed, and would become part of it; "
                f"choose a folder outside it"
            )
        if where == "holds":
            raise UserError(
                f"{key}={root} lies inside --out {store.url}, where the pack is written; choose a folder outside the "
                f"dataset"
            )
