"""Your own data: `data.name=package.module:function` and Hugging Face datasets (`data.name=hf`).

The same small photos (PNG and JPEG files of a few sizes) as an image folder, through a dataset
function over a CSV of paths and labels, and as a Hugging Face dataset built from them: training
ends with the same parameters bit for bit, and every guarantee of folders holds (ddp parity,
resume under another world size, exact eval). Bad input is one line, exit 2.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import (
    assert_bitwise_equal,
    cli,
    final_params,
    load_checkpoint,
    max_rel_diff,
    run_here,
    slowed,
    stopped_after_first_checkpoint,
)
from multicard.base.config import load_config
from multicard.base.errors import UserError
from multicard.data import read_splits
from multicard.data.augmentation.transforms import FitSquare
from multicard.data.loading.workers import SourceImages
from multicard.data.sources.encoded import EncodedImage
from multicard.data.sources.user import read_item

CLASSES = ("cat", "dog", "owl")
TRAIN_PER_CLASS, VAL_PER_CLASS = (64, 64, 64), (17, 17, 16)  # 192 training images; 50 divides by neither 2 nor 3
# Six steps an epoch; 16 px images of other sizes and formats, so every image is decoded and resized.
COMMON = [
    "model.name=smallcnn", "data.image_size=16", "data.crop_padding=2", "train.epochs=1",
    "train.global_batch_size=32", "log_every=2", "data.num_workers=1",
]  # fmt: skip
STEPS = 192 // 32

# The dataset function of docs/datasets.md's "Your own data", with knobs for the tests: `form` chooses what an
# item's image is, `bad` breaks one item, `val_classes` renames the validation split's classes.
MODULE = """
import csv
from pathlib import Path

import numpy as np
from PIL import Image


class Photos:
    def __init__(self, root, rows, classes, form, bad):
        self.root, self.rows, self.classes, self.form, self.bad = Path(root), rows, classes, form, bad

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, name = self.rows[i]
        data, label = (self.root / path).read_bytes(), self.classes.index(name)
        if i == 5 and self.bad == "label":
            label = len(self.classes) + 2
        if i == 5 and self.bad == "truncated":
            data = data[: len(data) // 2]
        if i == 5 and self.bad == "type":
            return "not an image", label
        if self.form == "bytes":
            return data, label
        image = Image.open(self.root / path).convert("RGB")
        if self.form == "pil":
            return image, label
        hwc = np.asarray(image)
        return (hwc if self.form == "hwc" else hwc.transpose(2, 0, 1).copy()), label


def read(root, split):
    with open(Path(root) / f"{split}.csv") as f:
        return list(csv.reader(f))


def photos(split, root, form="bytes", bad="", val_classes=None):
    classes = sorted({name for _, name in read(root, "train")})
    if split == "val" and val_classes:
        classes = list(val_classes)
    return Photos(root, read(root, split), classes, form, bad), classes


def no_val(split, root):
    return photos(split, root) if split == "train" else None


def broken(split, root):
    raise KeyError("no column 'file' in labels.csv")
"""


def _photo(rng: np.random.Generator, label: int, width: int, height: int) -> Image.Image:
    """A smooth random picture tinted by its class (so JPEG keeps it close)."""
    base = rng.integers(0, 256, (height // 4 + 1, width // 4 + 1, 3)).astype(np.float32)
    base[..., label] = base[..., label] * 0.5 + 127
    pixels = np.asarray(Image.fromarray(base.astype(np.uint8)).resize((width, height), Image.Resampling.BILINEAR))
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """root/{train,val}/<class>/*.png|jpg, root/{train,val}.csv (path, class), root/code/mcdata.py."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for split, counts in (("train", TRAIN_PER_CLASS), ("val", VAL_PER_CLASS)):
        rows = []
        for label, (name, count) in enumerate(zip(CLASSES, counts, strict=True)):
            (root / split / name).mkdir(parents=True)
            for k in range(count):
                ext = "jpg" if k % 3 else "png"
                rel = f"{split}/{name}/{k:03d}.{ext}"
                _photo(rng, label, 18 + k % 5, 16 + k % 7).save(root / rel, quality=90)
                rows.append(f"{rel},{name}\n")
        (root / f"{split}.csv").write_text("".join(rows))  # the folder's order: classes, then file names
    (root / "code").mkdir()
    (root / "code" / "mcdata.py").write_text(MODULE)
    sys.path.insert(0, str(root / "code"))  # for the in-process tests
    return root


def env(photos: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(photos / "code"), "HF_HOME": str(photos / "hf-home")}


def function(photos: Path, **kwargs: str) -> list[str]:
    extra = "".join(f", {k}: {v}" for k, v in kwargs.items())
    return ["data.name=mcdata:photos", f"data.kwargs={{root: {photos}{extra}}}"]


def folder(photos: Path) -> list[str]:
    return ["data.name=imagefolder", f"data.root={photos}"]


@pytest.fixture(scope="module")
def hf_saved(photos) -> Path:
    """The same photos as a Hugging Face DatasetDict (train, validation) written by save_to_disk,
    and as parquet files (train-*.parquet, validation-*.parquet)."""
    os.environ.setdefault("HF_HOME", str(photos / "hf-home"))  # the datasets cache (parquet), before its import
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES))})
    parts = {}
    for split, name in (("train", "train"), ("val", "validation")):
        rows = [line.split(",") for line in (photos / f"{split}.csv").read_text().splitlines()]
        parts[name] = datasets.Dataset.from_dict(
            {
                "image": [{"bytes": (photos / p).read_bytes(), "path": None} for p, _ in rows],
                "label": [CLASSES.index(c) for _, c in rows],
            },
            features=features,
        )
    saved = photos / "hf"
    datasets.DatasetDict(parts).save_to_disk(str(saved))
    (photos / "parquet").mkdir()
    for name, part in parts.items():
        part.to_parquet(str(photos / "parquet" / f"{name}-00000-of-00001.parquet"))
    return saved


def train(photos: Path, out: Path, *args: str, launch: tuple[str, ...] = ()) -> Path:
    """out, after `multicard train` there, run by this process (conftest.run_here; the photos
    fixture has put mcdata on its sys.path, env(photos) puts it on its workers')."""
    run_here("train", *launch, *COMMON, *args, f"out_dir={out}", env=env(photos))
    return out


def one_line_error(result) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("multicard: error: "), result.stderr
    return lines[0]


# ------------------------------------------------------------------ the same training from every source


@pytest.mark.slow
@pytest.mark.parametrize(
    "launch, loader, form",
    [
        pytest.param((), "workers", "bytes", id="single-workers"),
        pytest.param(("--nproc-per-node", "2"), "workers", "hwc", id="ddp2-workers", marks=pytest.mark.distributed),
        pytest.param((), "device", "pil", id="single-device"),
    ],
)
def test_function_hf_and_folder_train_to_bitwise_equal_parameters(photos, hf_saved, tmp_path, launch, loader, form):
    args = [f"data.loader={loader}"]
    reference = final_params(train(photos, tmp_path / "folder", *folder(photos), *args, launch=launch))
    through_function = train(photos, tmp_path / "function", *function(photos, form=form), *args, launch=launch)
    assert_bitwise_equal(final_params(through_function), reference)
    through_hf = train(photos, tmp_path / "hf", "data.name=hf", f"data.root={hf_saved}", *args, launch=launch)
    assert_bitwise_equal(final_params(through_hf), reference)
    assert load_checkpoint(tmp_path / "hf" / "checkpoints" / "last.pt")["classes"] == list(CLASSES)


# ------------------------------------------------------------------ ddp parity, resume, eval

# float64, no BatchNorm, two epochs under a constant LR with a checkpoint every 2 steps.
EXACT = ["precision=fp64", "model.kwargs={norm: none}", "train.epochs=2", "sched.name=constant",
         "checkpoint.every_steps=2", "data.loader=workers"]  # fmt: skip


@pytest.fixture(scope="module")
def single_fp64(photos, tmp_path_factory) -> Path:
    return train(photos, tmp_path_factory.mktemp("single"), *function(photos), *EXACT)


@pytest.mark.distributed
def test_ddp2_on_a_dataset_function_equals_one_process(photos, single_fp64, tmp_path):
    ddp = train(photos, tmp_path, *function(photos), *EXACT, launch=("--nproc-per-node", "2"))
    assert max_rel_diff(final_params(ddp), final_params(single_fp64)) < 1e-10


@pytest.mark.distributed
def test_sigterm_mid_epoch_then_resume_on_one_process_continues_the_epoch(photos, single_fp64, tmp_path):
    args = ["--nproc-per-node", "2", *COMMON, *function(photos), *EXACT]
    slow = {**slowed(300, path=photos / "code"), "HF_HOME": str(photos / "hf-home")}
    stopped = stopped_after_first_checkpoint(tmp_path, *args, env=slow)
    assert stopped % STEPS and stopped < 2 * STEPS  # inside an epoch
    output = run_here("train", *COMMON, *function(photos), *EXACT, f"out_dir={tmp_path}")
    assert f"step {stopped} of {2 * STEPS}" in output
    assert max_rel_diff(final_params(tmp_path), final_params(single_fp64)) < 1e-10


@pytest.mark.distributed
def test_eval_on_1_and_3_processes_gives_identical_sums(photos, single_fp64):
    ckpt = str(single_fp64 / "checkpoints" / "last.pt")
    on_3 = run_here("eval", "--checkpoint", ckpt, "--json", "--nproc-per-node", "3", "--oversubscribe", env=env(photos))
    on_1 = run_here("eval", "--checkpoint", ckpt, "--json")
    one, three = (json.loads(output.strip().splitlines()[-1]) for output in (on_1, on_3))
    assert one["samples"] == three["samples"] == sum(VAL_PER_CLASS)
    assert one["top1"] == three["top1"] and one["top5"] == three["top5"]
    assert one["loss"] == pytest.approx(three["loss"], rel=1e-12)


def test_plan_counts_a_dataset_functions_samples_and_classes(photos):
    from multicard.tools.plan.dataset import data_facts

    facts = data_facts(load_config(None, function(photos)).data, 0)
    assert (facts.num_classes, facts.train, facts.val) == (3, 192, 50)


# ------------------------------------------------------------------ what an item may be


def splits_of(photos: Path, *overrides: str):
    return read_splits(load_config(None, list(overrides)).data, 0)


@pytest.mark.parametrize("form", ["pil", "hwc", "chw"])
def test_every_item_form_gives_the_folders_pixels(photos, form):
    by_function = splits_of(photos, *function(photos, form=form)).train
    by_folder = splits_of(photos, *folder(photos)).train
    fit = FitSquare(16)
    for index in (0, 1, 100):
        picture, label = read_item(by_function, index)
        expected = fit(EncodedImage.read(by_folder.root / by_folder.paths[index]), 0, index)
        assert torch.equal(fit(picture, 0, index), expected) and label == by_folder.labels[index]


def test_jpeg_bytes_stay_encoded_for_reduced_scale_decoding(photos):
    picture, _ = read_item(splits_of(photos, *function(photos)).train, 1)  # 001.jpg
    assert isinstance(picture, EncodedImage) and picture.reducible


def test_a_function_without_val_holds_out_a_seeded_share(photos):
    splits = splits_of(photos, "data.name=mcdata:no_val", f"data.kwargs={{root: {photos}}}", "data.val_fraction=0.25")
    assert (len(splits.train), len(splits.val)) == (144, 48)
    assert set(splits.train.indices.tolist()).isdisjoint(splits.val.indices.tolist())


# ------------------------------------------------------------------ bad input: one line, exit 2


def test_an_unknown_data_name_lists_the_kinds_of_data():
    with pytest.raises(UserError, match="data.name=foo is not one of synthetic, .*, hf, or package.module:function"):
        load_config(None, ["data.name=foo"])


@pytest.mark.slow
def test_a_function_that_cannot_be_imported_is_one_line(photos):
    result = cli("train", *COMMON, "data.name=mcdata_nosuch:photos", "train.max_steps=1", env=env(photos))
    assert "data.name=mcdata_nosuch:photos: cannot import module mcdata_nosuch" in one_line_error(result)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.name=mcdata:nosuch", "data.kwargs={root: x}"], "module mcdata has no function nosuch"),
        (
            ["data.name=mcdata:photos", "data.kwargs={root: x, colour: red}"],
            "data.name=mcdata:photos cannot take data.kwargs={'root': 'x', 'colour': 'red'}: got an unexpected "
            "keyword argument 'colour'",
        ),
    ],
)
def test_a_function_that_is_missing_or_cannot_take_data_kwargs_is_one_line(photos, overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        splits_of(photos, *overrides)


@pytest.mark.parametrize(
    "overrides, raised, note",
    [
        (
            ["data.name=mcdata:broken", "data.kwargs={root: x}"],
            KeyError,
            "data.name=mcdata:broken for split train (data.kwargs={'root': 'x'})",
        ),
        (
            ["data.name=mcdata:photos", "data.kwargs={root: /nonexistent}"],
            FileNotFoundError,
            "data.name=mcdata:photos for split train (data.kwargs={'root': '/nonexistent'})",
        ),
    ],
)
def test_what_a_dataset_function_raises_keeps_its_traceback(photos, overrides, raised, note):
    """Before: one line (a UserError from None) in place of the function's own traceback."""
    with pytest.raises(raised) as info:
        splits_of(photos, *overrides)
    assert any(entry.path.name == "mcdata.py" for entry in info.traceback)  # the user's own frames are there
    if sys.version_info >= (3, 11):  # exception notes
        assert info.value.__notes__ == [f"multicard: raised by {note}"]


def test_class_names_that_differ_between_splits_are_refused(photos):
    with pytest.raises(UserError, match="the val split has 3 classes that differ from train's 3"):
        splits_of(photos, *function(photos, val_classes="[cat, dog, emu]"))


@pytest.mark.parametrize(
    "item, message",
    [
        (("just an image",), "item 0 is a tuple of 1; each item must be an \\(image, label\\) pair"),
        ((np.zeros((4, 4, 3), np.float32), 0), "item 0 has a float32 image \\(4, 4, 3\\); images are uint8"),
        ((np.zeros((4, 4, 4), np.uint8), 0), "item 0 has an image of shape \\(4, 4, 4\\); give H×W, H×W×C or C×H×W"),
        ((torch.zeros(2, 3, 4, 4, dtype=torch.uint8), 0), "item 0 has an image of shape \\(2, 3, 4, 4\\)"),
        (([1, 2, 3], 0), "item 0 has an image of type list"),
        ((b"not an image", 0), "item 0: cannot decode its image bytes"),
        ((np.zeros((4, 4), np.uint8), 3), "item 0 has label 3, outside 0..2 \\(3 classes\\)"),
        ((np.zeros((4, 4), np.uint8), 1.0), "item 0 has label 1.0 \\(float\\); labels are integers 0..2"),
    ],
)
def test_items_of_the_wrong_type_shape_or_label_name_the_item(photos, item, message):
    source = splits_of(photos, *function(photos)).train
    source.dataset = [item]
    with pytest.raises(UserError, match=message):
        read_item(source, 0)


@pytest.mark.slow
def test_a_bad_item_read_by_a_loader_worker_is_one_line(photos, tmp_path):
    result = cli("train", *COMMON, *function(photos, bad="label"), "data.loader=workers", f"out_dir={tmp_path}",
                 env=env(photos))  # fmt: skip
    assert "data.name=mcdata:photos (train) item 5 has label 5, outside 0..2 (3 classes)" in one_line_error(result)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("type", "data.name=mcdata:photos \\(train\\) item 5 has an image of type str"),
        ("truncated", "data.name=mcdata:photos \\(train\\) item 5.*cannot decode|cannot decode.*item 5"),
    ],
)
def test_a_bad_item_is_named_where_a_loader_reads_it(photos, bad, message):
    """What a loader worker runs for each sample (the worker's line reaches stderr as above)."""
    source = splits_of(photos, *function(photos, bad=bad)).train
    with pytest.raises(UserError, match=message):
        SourceImages(source, FitSquare(16))[(0, 5)]


# ------------------------------------------------------------------ Hugging Face datasets


def hf(root: Path, *overrides: str):
    return read_splits(load_config(None, ["data.name=hf", f"data.root={root}", *overrides]).data, 0)


def test_hf_parquet_files_give_the_saved_datasets_items(photos, hf_saved):
    saved, parquet = hf(hf_saved), hf(photos / "parquet")
    assert saved.classes == parquet.classes == list(CLASSES)
    assert (len(parquet.train), len(parquet.val)) == (192, 50)
    for index in (0, 2, 191):
        (a, la), (b, lb) = read_item(saved.train, index), read_item(parquet.train, index)
        assert a.data == b.data and la == lb


def test_hf_single_parquet_file_without_val_holds_out_a_share(photos, hf_saved):
    splits = hf(photos / "parquet" / "train-00000-of-00001.parquet", "data.val_fraction=0.25")
    assert (len(splits.train), len(splits.val)) == (144, 48)


def test_hf_path_without_a_dataset_is_one_line(photos):
    pytest.importorskip("datasets")
    with pytest.raises(UserError, match="data.root=.*/code holds no Hugging Face dataset; expected a folder"):
        hf(photos / "code")
    with pytest.raises(UserError, match="data.root=.*/nosuch does not exist"):
        hf(photos / "nosuch")


def test_hf_missing_column_lists_the_columns_there(hf_saved):
    with pytest.raises(UserError, match="has no column picture \\(its columns: image, label\\)"):
        hf(hf_saved, "data.hf_image=picture")


def test_hf_split_that_is_not_there_lists_the_splits(hf_saved):
    with pytest.raises(UserError, match="data.hf_val_split=dev: .* has no such split \\(it has train, validation\\)"):
        hf(hf_saved, "data.hf_val_split=dev")


def test_hf_label_column_that_is_not_integer_is_refused(tmp_path):
    datasets = pytest.importorskip("datasets")
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="PNG")
    rows = {"image": [{"bytes": buffer.getvalue(), "path": None}] * 4, "label": ["cat", "dog", "cat", "dog"]}
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("string")})
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "strings"))
    with pytest.raises(UserError, match="data.hf_label=label: .* holds Value\\('string'.*not integer labels"):
        hf(tmp_path / "strings")


def test_a_missing_image_file_of_a_parquet_dataset_is_named(photos, tmp_path):
    os.environ.setdefault("HF_HOME", str(tmp_path / "hf-home"))  # the datasets cache, before its import
    datasets = pytest.importorskip("datasets")
    import pyarrow.parquet as pq

    files, gone = [str(f) for f in sorted((photos / "train").glob("*/*.png"))], tmp_path / "gone.png"
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES))})
    (tmp_path / "hf").mkdir()
    for split, images in (("train", [*files, str(gone)]), ("validation", files[:2])):
        rows = datasets.Dataset.from_dict({"image": images, "label": [0] * len(images)}, features=features)
        pq.write_table(rows.data.table, tmp_path / "hf" / f"{split}-00000-of-00001.parquet")  # paths, no bytes
    train = hf(tmp_path / "hf").train
    with pytest.raises(UserError, match=f"split train item {len(files)} names image file {gone}, which cannot be read"):
        read_item(train, len(files))


def test_hf_without_the_extra_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` then raises ImportError
    with pytest.raises(UserError, match=r"data.name=hf needs .*: pip install 'multicard\[hf\]'"):
        hf(tmp_path)


def test_readme_example_function_runs_as_printed(photos, tmp_path):
    """The 10-line function in docs/datasets.md's "Your own data" reads a CSV of paths and labels."""
    readme = (Path(__file__).resolve().parents[1] / "docs" / "datasets.md").read_text()
    block = readme.split("<!-- your-own-data -->", 2)[1].split("```python", 1)[1]
    code = block.split("\n", 1)[1].split("```", 1)[0]  # after the fence's line (its title="mydata.py")
    (tmp_path / "readme_data.py").write_text(textwrap.dedent(code))
    sys.path.insert(0, str(tmp_path))
    try:
        splits = splits_of(photos, "data.name=readme_data:photos", f"data.kwargs={{root: {photos}}}")
    finally:
        sys.path.remove(str(tmp_path))
    assert splits.classes == list(CLASSES) and (len(splits.train), len(splits.val)) == (192, 50)
    assert read_item(splits.train, 0)[1] == 0
