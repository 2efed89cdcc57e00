"""The packed-shard format, in one place: what `multicard pack` writes (multicard/tools/pack.py) and
publishes to a store (`upload_pack`), and what the reader (data/sources/shards.py) reads from one — a
local folder or a URL's prefix alike (base/store.py).

A pack is a folder (or a URL's prefix) of plain tar files in WebDataset's layout, `train-00000.tar`,
`val-00000.tar`, … (members `<key>.<ext>` with each image's encoded bytes unchanged, then `<key>.cls`
with its label; `<key>` the sample's number in its split, 8 digits) and one index, `index.json`, that
says for every sample which shard holds it, where its bytes start and how long they are, its label and
its size (width, height), and for every shard its size and sha256. The index is written last: it is
the commit of a pack, a folder or prefix without one is no pack (an unfinished one at most).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from multicard.base.atomic import write_text_atomic
from multicard.base.errors import UserError
from multicard.base.storage import etag
from multicard.base.store import Store
from multicard.base.version import __version__

FORMAT = "multicard-shards"
VERSION = 1
INDEX = "index.json"
PARTIAL = ".partial"  # chunks and the plan of an unfinished pack
BLOCK = 512  # tar's block: every member is a 512-byte header, then its data padded to blocks
COLUMNS = ("shard", "offset", "length", "label", "width", "height")  # per sample, in the index: integers
HEADER = ("ext", "format", "mode")  # per sample, in the index: the image member's extension, Pillow's format and mode
MD5 = re.compile(r"^[0-9a-f]{32}$")  # an object store's ETag that is its content's MD5
SHARD_NAME = re.compile(r"^(?P<split>[a-z]+)-(?P<number>\d{5})\.tar$")  # train-00000.tar
COPY_BYTES = 8 << 20


# ---------------------------------------------------------------- writing


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:05d}.tar"


def member_header(name: str, size: int) -> bytes:
    """A tar member's 512-byte ustar header (no time, owner or mode that differ between runs)."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")


def sample_key(sample: int) -> str:
    return f"{sample:08d}"


def sample_block(sample: int, data: bytes, ext: str, label: int) -> bytes:
    """`<key>.<ext>` with the image's bytes, then `<key>.cls` with its label: WebDataset's layout.
    The image's bytes start BLOCK bytes into the block."""
    key, cls = sample_key(sample), str(label).encode()
    parts = [member_header(f"{key}.{ext}", len(data)), data, bytes(padded(len(data)) - len(data))]
    parts += [member_header(f"{key}.cls", len(cls)), cls, bytes(BLOCK - len(cls))]
    return b"".join(parts)


def block_size(length: int) -> int:
    """The bytes sample_block takes for an image of `length` bytes."""
    return BLOCK + padded(length) + 2 * BLOCK


def write_shard(out: Path, name: str, pieces: Iterable[tuple[Path, int, int]]) -> dict[str, Any]:
    """Copy byte ranges (file, start, length) of sample blocks into shard `name` of folder `out`, end
    it as a tar and rename it whole; its entry of the index (name, bytes, sha256). OSErrors pass."""
    h = hashlib.sha256()
    tmp = out / f".{name}.tmp"
    try:
        with tmp.open("wb") as f:
            for part, start, length in pieces:
                _copy(part, start, length, f, h)
            end = bytes(2 * BLOCK)  # the end-of-archive marker
            h.update(end)
            f.write(end)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, out / name)
    finally:
        tmp.unlink(missing_ok=True)  # only whole shards stay
    return {"name": name, "bytes": size, "sha256": h.hexdigest()}


def _copy(part: Path, start: int, length: int, f: Any, h: Any) -> None:
    """`length` bytes of `part` from `start` into `f`, and into the hash `h`."""
    with part.open("rb") as src:
        src.seek(start)
        while length:
            buffer = src.read(min(COPY_BYTES, length))
            h.update(buffer)
            f.write(buffer)
            length -= len(buffer)


def stream_digest(f: Any, algorithm: str = "sha256") -> str:
    """The hexdigest of what is left to read of a binary file."""
    h = hashlib.new(algorithm, usedforsecurity=False)
    while buffer := f.read(COPY_BYTES):
        h.update(buffer)
    return h.hexdigest()


def index_document(classes: list[str], plan: dict[str, Any], columns: dict[str, dict],
                   written: dict[str, dict]) -> dict[str, Any]:  # fmt: skip
    """The index of a pack: `plan` (with the source's fingerprint and words), per split its columns
    (COLUMNS, HEADER, samples_sha256) and the names of its shards (`names`), `written` each shard's entry."""
    index = {
        "format": FORMAT, "version": VERSION, "multicard": __version__, "classes": classes,
        "fingerprint": plan["fingerprint"], "source": plan["source"], "plan": plan, "splits": {},
    }  # fmt: skip
    for split, cols in columns.items():
        rest = {key: value for key, value in cols.items() if key != "names"}
        index["splits"][split] = {"shards": [written[n] for n in cols["names"]], **rest}
    index["digest"] = index_digest(index)
    return index


def write_index(out: Path, index: dict[str, Any], advice: str) -> None:
    """index.json, written last: from then on the pack is complete. `advice`: what a failed write says."""
    write_text_atomic(out / INDEX, json.dumps(index), advice)
    (out / INDEX).chmod(0o644)  # readable by everyone, as the shards are (mkstemp makes it private)


def index_digest(index: dict[str, Any]) -> str:
    """What the index says, as one checksum: pack --verify tells an index changed after packing
    (class names, source) from the one pack wrote."""
    stated = {key: value for key, value in index.items() if key != "digest"}
    return hashlib.sha256(json.dumps(stated, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------- reading


def padded(size: int) -> int:
    """`size` rounded up to whole tar blocks."""
    return -(-size // BLOCK) * BLOCK


@dataclass
class PackedSplit:
    """One split of an index: its shards (in `store`) and, per sample, where its bytes are."""

    store: Store  # where the shards are: a local folder or a URL's prefix
    shards: list[str]  # each shard's location (a path or a URL: what messages name)
    shard_bytes: list[int]
    shard_sha256: list[str | None]  # each shard's checksum, as pack wrote it
    columns: dict[str, np.ndarray]  # COLUMNS → int64 arrays, one entry per sample
    header: dict[str, list[str]]  # HEADER → one entry per sample
    samples_sha256: str | None = None  # of the samples' bytes, in order (pack.samples_digest); older packs: None

    @property
    def names(self) -> list[str]:
        return [location.rsplit("/", 1)[-1] for location in self.shards]

    def __len__(self) -> int:
        return len(self.columns["label"])


@dataclass
class Index:
    path: str
    classes: list[str]
    fingerprint: str  # of the source the pack was made from
    source: str  # what was packed, in words (the data.* settings)
    splits: dict[str, PackedSplit]


def _bad_index(path: str, why: str) -> UserError:
    return UserError(
        f"index {path} {why}; pack the data again (multicard pack; multicard pack --verify DIR checks a pack)"
    )


def read_index(store: Store, what: str | None = None) -> tuple[Index, dict[str, Any], dict[str, Any]]:
    """The index of the pack in a store's folder, its format, version and entries checked, with both splits
    and every shard there with the size it gives (one listing); its JSON and the folder's listing. Else a
    one-line error naming the file. `what`: how the folder was given (default `data.root=DIR`)."""
    what = what or f"data.root={store.url}"
    listing = store.listing()
    if INDEX not in listing:
        raise _no_index(store, listing, what)
    path = store.join(INDEX)
    try:
        raw = json.loads(store.read(INDEX))
    except ValueError as exc:
        raise _bad_index(path, f"cannot be read ({type(exc).__name__})") from None
    index = parse_index(raw, path, store)
    for name in ("train", "val"):  # a pack holds a training and a validation split
        if name not in index.splits:
            raise _bad_index(index.path, f"has no {name} split")
    sizes = {store.join(name): int(entry["size"]) for name, entry in listing.items()}
    for split in index.splits.values():
        check_shards(split, sizes.get)
    return index, raw, listing


def parse_index(raw: Any, path: str, store: Store) -> Index:
    """An index's contents (`raw`: its JSON, read from `path`), checked; its shards are in `store`."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise _bad_index(path, f"is not a {FORMAT} index")
    if raw.get("version") != VERSION:
        raise UserError(
            f"index {path} is format version {raw.get('version')}; this multicard reads version {VERSION}: "
            f"pack the data again with this version (multicard pack)"
        )
    try:
        classes = [str(c) for c in raw["classes"]]
        splits = {str(name): _packed_split(store, part) for name, part in raw["splits"].items()}
        index = Index(path, classes, str(raw["fingerprint"]), str(raw["source"]), splits)
    except (AttributeError, KeyError, OverflowError, TypeError, ValueError) as exc:
        raise _bad_index(path, f"is damaged (bad entry {exc})") from None
    for name, split in splits.items():
        _check_entries(index, name, split)
    return index


def _no_index(store: Store, listing: dict[str, Any], what: str) -> UserError:
    """Why a folder without an index is no pack, and what to do: `multicard pack --out` it only where
    pack would write (a new or empty folder)."""
    if PARTIAL in listing:
        return UserError(f"{store.url} holds an unfinished pack (no {INDEX}); rerun multicard pack to finish it")
    if any(SHARD_NAME.match(name) for name in listing):
        return UserError(
            f"{what} holds an unfinished pack (shards, but no {INDEX} yet: it is uploaded last); run the "
            f"multicard pack --out {store.url} that wrote it again to finish it"
        )
    in_the_way = store.in_the_way()
    if in_the_way:
        return UserError(
            f"{what}: {in_the_way} is a file, not a folder multicard pack wrote (one with {INDEX} and the shards); "
            f"give such a folder"
        )
    if listing:
        return UserError(
            f"{what} has no {INDEX}: it is not a folder multicard pack wrote; pack the dataset into a new folder "
            f"(multicard pack --out NEW_DIR) and give that one"
        )
    return UserError(f"{what} has no {INDEX}; make it with multicard pack --out {store.url}")


def _packed_split(store: Store, part: dict[str, Any]) -> PackedSplit:
    shards = [store.join(str(s["name"])) for s in part["shards"]]
    columns = {c: np.asarray(part[c], dtype=np.int64) for c in COLUMNS}
    header = {c: [str(v) for v in part[c]] for c in HEADER}
    if len({len(v) for v in columns.values()} | {len(v) for v in header.values()}) != 1:
        raise ValueError("columns of different lengths")
    digest = part.get("samples_sha256")
    sizes, sums = [int(s["bytes"]) for s in part["shards"]], [s.get("sha256") for s in part["shards"]]
    return PackedSplit(store, shards, sizes, sums, columns, header, digest and str(digest))


def _check_entries(index: Index, name: str, split: PackedSplit) -> None:
    """Every sample lies inside its shard (as long as the index says the shard is) and has a label
    of the index's classes: a damaged index is said at start-up, naming the first bad sample."""
    cols, ends = split.columns, np.asarray(split.shard_bytes, dtype=np.int64)
    shard, offset, length, label = cols["shard"], cols["offset"], cols["length"], cols["label"]
    known = (shard >= 0) & (shard < len(ends))
    shard_end = np.append(ends, 0)[np.where(known, shard, len(ends))]  # 0 for a shard the index does not list
    inside = known & (offset >= 0) & (length >= 0) & (offset <= shard_end - length)
    if not inside.all():
        i = int(np.flatnonzero(~inside)[0])
        where = f"shard {shard[i]} of {len(ends)}" if not known[i] else f"bytes {offset[i]}..{offset[i] + length[i]}"
        raise _bad_index(index.path, f"is damaged: sample {i} of split {name} lies outside its shard ({where})")
    labelled = (label >= 0) & (label < len(index.classes))
    if not labelled.all():
        i = int(np.flatnonzero(~labelled)[0])
        why = f"sample {i} of split {name} has label {label[i]}, but the index names {len(index.classes)} classes"
        raise _bad_index(index.path, f"is damaged: {why}")
    sized = (cols["width"] > 0) & (cols["height"] > 0)
    if not sized.all():
        i = int(np.flatnonzero(~sized)[0])
        why = f"sample {i} of split {name} has size {cols['width'][i]}x{cols['height'][i]}"
        raise _bad_index(index.path, f"is damaged: {why}")


def check_shards(split: PackedSplit, size_of: Callable[[str], int | None]) -> None:
    """Every shard is there with the size the index gives (from one listing: cheap at start-up).
    `size_of`: a shard's size by its location, None where it is missing."""
    for path, expected in zip(split.shards, split.shard_bytes, strict=True):
        size = size_of(path)
        if size is None:
            raise UserError(f"shard {path} is missing; restore it or pack the data again (multicard pack)")
        if size != expected:
            raise UserError(
                f"shard {path} has {size} bytes where the index says {expected}: it is truncated or was changed; "
                f"restore it or pack the data again (multicard pack --verify DIR checks a pack)"
            )


# ---------------------------------------------------------------- publishing a pack made in a local folder


def check_pack_target(store: Store, listing: dict[str, Any] | None = None) -> None:
    """pack writes only where there is nothing, or a pack (whole or not): never over another's files."""
    listing = store.listing() if listing is None else listing
    if INDEX in listing or PARTIAL in listing:
        return
    foreign = sorted(name for name in listing if not SHARD_NAME.match(name) and not name.endswith(".tmp"))
    if foreign:
        raise UserError(
            f"--out {store.url} holds files that are no pack's ({', '.join(foreign[:3])}"
            f"{', …' if len(foreign) > 3 else ''}); choose a new or empty folder"
        )


def stored_index(store: Store) -> dict[str, Any] | None:
    """The index of the pack in the store's folder; None where there is none (or none readable: a pack
    replaces it)."""
    if INDEX not in store.listing():
        return None
    try:
        index = json.loads(store.read(INDEX))
    except ValueError:
        return None
    return index if isinstance(index, dict) else None


def upload_pack(folder: Path, store: Store, say: Callable[[str], None]) -> list[str]:
    """Publish the finished pack in the local `folder` to the store: its shards, then its index last (the
    index is the commit: readers take nothing without it). Shards the store holds already whole (their
    size, and their MD5 where the store's version of an object is one) are not written again, nor an index
    that is there already (a pack made in place); an index of another pack there is removed first, and
    shards no longer named after. The names written, in order (the index last; none: nothing to write)."""
    listing = store.listing()
    check_pack_target(store, listing)
    index_bytes = (folder / INDEX).read_bytes()
    entries = [shard for split in json.loads(index_bytes)["splits"].values() for shard in split["shards"]]
    if INDEX in listing:
        if store.read(INDEX) == index_bytes:
            return []
        say(f"multicard pack: replacing the pack in {store.url}: it was made from another source or other options")
        store.remove(INDEX)  # first: from here on the folder no longer holds a pack
    named = {shard["name"] for shard in entries}
    for stale in sorted(name for name in listing if SHARD_NAME.match(name) and name not in named):
        store.remove(stale)
    todo = [shard for shard in entries if not _uploaded(listing.get(shard["name"]), folder / shard["name"], shard)]
    for shard in todo:
        upload_object(store, folder / shard["name"], shard["name"])
    upload_object(store, folder / INDEX, INDEX)
    return [shard["name"] for shard in todo] + [INDEX]


def _uploaded(listed: dict[str, Any] | None, local: Path, shard: dict[str, Any]) -> bool:
    """Whether the object listed is the shard: its size, and its MD5 where the ETag is one (a single-part upload)."""
    if listed is None or int(listed.get("size", -1)) != int(shard["bytes"]):
        return False
    version = etag(listed)
    if not MD5.match(version):
        return True
    with local.open("rb") as f:
        return version == stream_digest(f, "md5")


def upload_object(store: Store, local: Path, name: str) -> None:
    """One file written whole to the store (object stores make an object visible only once complete)."""
    store.put(name, local)
