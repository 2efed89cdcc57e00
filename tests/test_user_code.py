"""Users' own datasets against a run: refused runs, ranks that read other data, dataset modules that change
the process (threads, stop handlers, torch's default dtype), Hugging Face labels, bench's data, the data-bound
note. Real processes only where the process is what is checked (a hang across ranks, a process that must end)."""

from __future__ import annotations

import importlib.util
import io
import re
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from conftest import cli, final_params, one_line, run_here, start
from multicard.base.config import load_config
from multicard.base.errors import Stopped, UserError
from multicard.cli.main import main
from multicard.data import build_data, read_splits
from multicard.data.loading.sampling import BatchSplit
from multicard.data.sources.folders import Files, InMemory, Splits
from multicard.data.sources.ranks import check_same_across_ranks, summary
from multicard.data.sources.user import read_item
from multicard.observe.telemetry import DataBound, Reporter, TrainingLog
from multicard.observe.tracking import TRACKERS, MlflowRun
from multicard.recipes import ImageClassifier
from multicard.runtime.environment import ProcessEnv
from multicard.runtime.exits import EXIT_GRACE_S
from multicard.runtime.process_group import ProcessContext

# Two steps of 16 on 32 pictures of 8 px, 16 to validate.
RUN = ["model.name=smallcnn", "data.image_size=8", "data.crop_padding=1", "train.epochs=1",
       "train.global_batch_size=16", "log_every=1"]  # fmt: skip

# Dataset functions for the tests, in module own_data; the modules beside it change the process
# when imported, then offer the same data.
MODULES = {
    "own_data": '''
        import os
        import threading

        import numpy as np


        class Squares:
            def __init__(self, n, label=None):
                self.n, self.label = n, label

            def __len__(self):
                return self.n

            def __getitem__(self, i):
                label = i % 2 if self.label is None else self.label
                return np.full((8, 8, 3), 60 * (i % 2) + i % 50, np.uint8), label


        def squares(split):
            return Squares(32 if split == "train" else 16), ["even", "odd"]


        def bad_labels(split):
            return Squares(32, label=7), ["even", "odd"]


        def by_rank(split):  # rank 1 reads 32 more: 6 steps against rank 0's 4
            extra = 32 * int(os.environ.get("RANK", "0")) if split == "train" else 0
            return Squares(64 + extra if split == "train" else 16), ["even", "odd"]


        def leaves_a_thread(split):
            if split == "train":
                threading.Thread(target=threading.Event().wait, name="prefetcher").start()  # never ends
            return squares(split)
    ''',
    "sets_float64": '''
        import torch

        torch.set_default_dtype(torch.float64)
        from own_data import squares
    ''',
    "ignores_sigterm": '''
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        from own_data import squares
    ''',
}


@pytest.fixture(scope="module")
def modules(tmp_path_factory) -> Path:
    """The folder of the dataset modules, on this process's sys.path while the module's tests run."""
    folder = tmp_path_factory.mktemp("modules")
    for name, code in MODULES.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(code))
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))


@pytest.fixture
def default_dtype():
    """torch's default dtype is float32 again after the test, whatever the code it ran did."""
    yield
    torch.set_default_dtype(torch.float32)


# ------------------------------------------------------------------ a refused run writes nothing


def test_a_run_refused_before_its_first_step_leaves_out_dir_as_it_found_it(
    modules, tmp_path, capsys, monkeypatch
):  # fmt: skip
    # A bad item in the first batch (a loader in this process reads it during the first step).
    fresh = tmp_path / "fresh"
    bad = ["data.name=own_data:bad_labels", "data.loader=workers", "data.num_workers=0", "log.tensorboard=true"]
    assert main(["train", *RUN, *bad, f"out_dir={fresh}"]) == 2
    assert re.search(r"bad_labels \(train\) item \d+ has label 7, outside 0..1", one_line(capsys.readouterr().err))
    assert not fresh.exists()  # no config.yaml, metrics.jsonl, tensorboard/ or .multicard.lock
    # A tracker that cannot be reached, with log.on_tracker_error=fail, continuing a run: its files stay as they were.
    if importlib.util.find_spec("mlflow") is None:
        pytest.skip("pip install 'multicard[mlflow]'")
    run = tmp_path / "run"
    run_here("train", *RUN, "data.name=own_data:squares", "train.max_steps=1", f"out_dir={run}")
    before = {path.name: path.read_bytes() for path in run.iterdir() if path.is_file()}

    class Unreachable(MlflowRun):  # as a server that is down answers (without importing mlflow: seconds)
        def __init__(self, *args: object) -> None:
            raise ConnectionError("connection refused")

    monkeypatch.setitem(TRACKERS, "mlflow", Unreachable)
    more = ["log.mlflow=true", "log.on_tracker_error=fail", "train.max_steps=2"]
    assert main(["train", *RUN, "data.name=own_data:squares", *more, f"out_dir={run}"]) == 2
    assert "MLflow failed to start a run (connection refused)" in one_line(capsys.readouterr().err)
    assert {path.name: path.read_bytes() for path in run.iterdir() if path.is_file()} == before


# ------------------------------------------------------------------ ranks that read other data


@pytest.mark.slow
@pytest.mark.distributed
def test_datasets_that_differ_by_rank_are_named_at_start_up(modules, tmp_path):
    """Before: rank 1's two extra steps waited for rank 0 until dist_timeout_s, blaming "a rank is stuck"."""
    result = cli(
        "train", "--nproc-per-node", "2", *RUN, "data.name=own_data:by_rank", "dist_timeout_s=10",
        f"out_dir={tmp_path / 'out'}", env={"PYTHONPATH": str(modules)}, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert one_line(result.stderr) == (
        "multicard: error: the ranks read different data: rank 1 has 96 training samples, rank 0 64; every "
        "rank must read the same dataset (the same data.root contents on every node, a dataset function that does "
        "not depend on the rank)"
    )
    assert not (tmp_path / "out").exists()


class TwoRanks:
    """A process context's collective as rank 0 of two sees it, rank 1 holding `other`."""

    def __init__(self, other: Splits) -> None:
        self.other = other

    def all_gather_object(self, mine: dict) -> list[dict]:
        return [mine, summary(self.other)]


def test_ranks_with_other_samples_or_classes_of_the_same_length_are_named(tmp_path):
    labels = torch.tensor([0, 1, 0, 1])
    val = InMemory(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), labels[:2])
    files = Splits(Files(tmp_path, ["a.png", "b.png", "c.png", "d.png"], labels), val, ["x", "y"])
    check_same_across_ranks(files, TwoRanks(files))  # the same: nothing said
    renamed = Splits(Files(tmp_path, ["a.png", "b.png", "c.png", "e.png"], labels), files.val, files.classes)
    with pytest.raises(UserError, match=r"rank 1's 4 training samples are not rank 0's \(other labels, files"):
        check_same_across_ranks(files, TwoRanks(renamed))
    relabelled = Splits(files.train, InMemory(files.val.images, labels[:2].flip(0)), files.classes)
    with pytest.raises(UserError, match=r"rank 1's 2 validation samples are not rank 0's"):
        check_same_across_ranks(files, TwoRanks(relabelled))
    other_classes = Splits(files.train, files.val, ["x", "z"])
    with pytest.raises(UserError, match=r"rank 1 has 2 classes, rank 0 2 \(they differ in y, z\)"):
        check_same_across_ranks(files, TwoRanks(other_classes))


# ------------------------------------------------------------------ a thread that never ends


@pytest.mark.slow
def test_a_thread_a_dataset_function_leaves_running_does_not_keep_the_process_alive(modules, tmp_path):
    """Before: the process printed its final accuracy, then waited for the thread forever (the
    installed command did; `python -m multicard` alone ended)."""
    proc = start(
        "train", *RUN, "data.name=own_data:leaves_a_thread", f"out_dir={tmp_path}", env={"PYTHONPATH": str(modules)}
    )  # fmt: skip
    deadline = threading.Timer(120, proc.kill)  # a hang fails the test, not the suite
    deadline.start()
    try:
        lines = [(time.monotonic(), line) for line in proc.stdout]  # until the process ends
        code, err = proc.wait(), proc.stderr.read()
        ended_after_s = time.monotonic() - lines[-1][0]
    finally:
        deadline.cancel()
    assert code == 0, err
    assert "final validation accuracy" in "".join(line for _, line in lines)
    assert ended_after_s <= 10
    assert one_line(err) == (
        f"multicard: warning: thread(s) 'prefetcher' still running {EXIT_GRACE_S:g} s after the command ended "
        f"(started by the dataset's or model's code, not multicard's); ending the process without them"
    )


# ------------------------------------------------------------------ modules that change the process


def test_a_dataset_module_that_ignores_sigterm_keeps_the_graceful_stop(modules, tmp_path, capsys):
    cfg = load_config(None, [*RUN, "data.name=ignores_sigterm:squares", f"out_dir={tmp_path}"])
    with pytest.raises(Stopped) as stopped, ImageClassifier(cfg, env=ProcessEnv(source="none")) as recipe:
        assert recipe.data.train is not None  # the run is built (its data module imported) before the signal
        signal.raise_signal(signal.SIGTERM)  # ignored before: the run would have trained on
        recipe.train()
    assert stopped.value.signum == signal.SIGTERM and stopped.value.step <= 2  # it stopped, with a checkpoint
    assert (tmp_path / "checkpoints" / "last.pt").exists()
    err = capsys.readouterr().err
    assert one_line(err) == (
        "multicard: warning: data.name=ignores_sigterm:squares changed the handler of SIGTERM (multicard put back the "
        "previous handlers: a stop signal still stops a training run with a checkpoint)"
    )


def test_a_dataset_module_that_sets_float64_as_default_trains_as_without_it(
    modules, tmp_path, default_dtype, capsys
):  # fmt: skip
    """Before: a traceback (a float64 batch into float32 weights)."""
    run_here("train", *RUN, "data.name=own_data:squares", f"out_dir={tmp_path / 'plain'}")
    assert main(["train", *RUN, "data.name=sets_float64:squares", f"out_dir={tmp_path / 'float64'}"]) == 0
    assert torch.get_default_dtype() == torch.float32
    assert one_line(capsys.readouterr().err) == (
        "multicard: warning: data.name=sets_float64:squares set torch's default dtype to torch.float64 (multicard put "
        "back torch.float32: the run's precision comes from the config)"
    )
    reference, changed = final_params(tmp_path / "plain"), final_params(tmp_path / "float64")
    assert all(torch.equal(changed[k], reference[k]) for k in reference)
    assert changed["0.0.weight"].dtype == torch.float32  # precision=fp32, the config's


# ------------------------------------------------------------------ Hugging Face integer labels


def test_hf_plain_integer_labels_are_classes_and_out_of_range_ones_one_line(tmp_path):
    datasets = pytest.importorskip("datasets")
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})

    def saved(name: str, **splits: list[int]) -> list[str]:
        parts = {
            split: datasets.Dataset.from_dict({"image": [{"bytes": png.getvalue(), "path": None}] * len(labels),
                                               "label": labels}, features=features)
            for split, labels in splits.items()
        }  # fmt: skip
        datasets.DatasetDict(parts).save_to_disk(str(tmp_path / name))
        return ["data.name=hf", f"data.root={tmp_path / name}"]

    # validation lacks the largest label: both splits still have classes 0..2
    splits = read_splits(load_config(None, saved("plain", train=[0, 2, 1, 2], validation=[1, 0])).data, 0)
    assert splits.classes == ["0", "1", "2"] and (len(splits.train), len(splits.val)) == (4, 2)
    assert [int(read_item(splits.train, i)[1]) for i in range(4)] == [0, 2, 1, 2]
    negative = load_config(None, saved("negative", train=[0, 1, -1, 1])).data
    with pytest.raises(UserError, match=r"data.hf_label=label: split train of .* holds label -1, outside 0..1 "):
        read_splits(negative, 0)


# ------------------------------------------------------------------ bench checks its data first


def test_bench_on_a_folder_that_is_no_pack_is_one_line_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")  # a training run's folder, not a pack
    out = tmp_path / "bench"
    args = ["--runners", "multicard", "--strategies", "single", "--world-sizes", "1", "--out", str(out)]
    assert main(["bench", "data.name=shards", f"data.root={tmp_path / 'run'}", *args]) == 2
    run = tmp_path / "run"
    assert one_line(capsys.readouterr().err) == (
        f"multicard: error: data.root={run} has no index.json: it is not a folder multicard pack wrote; pack the "
        f"dataset into a new folder (multicard pack --out NEW_DIR) and give that one"
    )
    assert not out.exists()


# ------------------------------------------------------------------ the data-bound note


def test_the_data_bound_note_fits_the_loader_that_runs(capsys):
    """The note a training log gives when each step waits half its time for data, with either loader."""

    def note(*overrides: str) -> str:
        cfg = load_config(None, ["data.train_size=32", "data.val_size=16", "data.num_workers=0", *overrides])
        data = build_data(cfg.data, 0, BatchSplit(16, 1, 1), ProcessContext(0, 0, 1, 1, torch.device("cpu"), False))
        log = TrainingLog(Reporter(is_main=True), cfg.data, data.loader)
        trainer = SimpleNamespace(schedule=SimpleNamespace(log_every=1))
        for step in range(2, 2 + DataBound.WINDOW):
            ranks = [{"step_ms": 10.0, "data_ms": 5.0, "busy_ms": 5.0}]
            log.on_log(trainer, {"step": step, "loss": 1.0, "ranks": ranks})
        data.close()
        return " ".join(capsys.readouterr().out.split())  # one line, whatever the console's width

    on_device = note("data.loader=device", "data.image_size=32")
    assert "data.loader=device makes the batches in the training process: data.loader=workers" in on_device
    assert "makes them in loader processes, beside training" in on_device and "data.num_workers" not in on_device
    small = note("data.loader=workers", "data.image_size=32")
    assert "more loader processes (data.num_workers, now 0)" in small and "or data.loader=device for" in small
    assert "data.loader=device" not in note("data.loader=workers", "data.image_size=72")  # it keeps up to 64 px
    per_sample = DataBound(load_config(None, ["data.policy=trivialaugment"]).data, "device").advice()
    assert "in the training process (data.policy, data.color_jitter and data.random_erasing one image" in per_sample
