"""The large-image loader benchmark (benchmarks/loader_throughput.py), decisive on a noisy machine: at
least 5 repeats in mirrored order, a ratio floor, and --against another source tree timed in a process
of its own."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import multicard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import loader_throughput as bench  # noqa: E402


def jpeg_folder(root: Path) -> Path:
    """root/<class>/<n>.jpg: two classes of two small photos of noise."""
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        for k in range(2):
            Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(root / name / f"{k}.jpg")
    return root


def test_loader_benchmark_times_pipelines_in_mirrored_order_after_a_warm_up():
    calls = []

    def timer(who: str, kind: str):
        def timed(epoch: int, passes: int) -> tuple[float, float]:
            calls.append((kind, who, epoch, passes))
            return 100.0 + epoch, 50.0 + epoch  # (wall, cpu) rates that name the repeat

        return timed

    whos = ("multicard", "reference", "before")
    timers = {kind: {who: timer(who, kind) for who in whos} for kind in ("train", "eval")}
    wall, cpu = bench.measure(timers, repeats=5, passes=2)
    warm_up, repeats = calls[:6], calls[6:]
    assert {(epoch, passes) for *_, epoch, passes in warm_up} == {(0, 1)}
    orders = [[who for kind, who, *_ in repeats[i : i + 3]] for i in range(0, len(repeats), 3)]
    forward, backward = ["multicard", "reference", "before"], ["before", "reference", "multicard"]
    assert orders == [forward, forward, backward, backward] * 2 + [forward, forward]  # train then eval, each repeat
    assert cpu["reference eval"] == [51.0, 52.0, 53.0, 54.0, 55.0] and wall["before train"][0] == 101.0


def test_loader_benchmark_refuses_fewer_than_5_repeats(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args([f"--root={tmp_path}", "--repeats=3"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: --repeats must be at least 5 (ratios are medians of alternating repeats)\n"


def test_loader_benchmark_floor_names_the_kind_whose_median_ratio_is_below():
    cpu = {
        "multicard train": [150.0, 130.0, 160.0, 120.0, 145.0],  # ratios 1.5 1.3 1.6 1.2 1.45: median 1.45
        "reference train": [100.0] * 5,
        "multicard eval": [200.0, 100.0, 210.0, 205.0, 90.0],  # median 2.0, despite two slow repeats
        "reference eval": [100.0] * 5,
    }
    assert bench.below_floor(cpu, 1.4) == []
    assert bench.below_floor(cpu, 1.5) == ["train"]
    assert bench.below_floor(cpu, 2.1) == ["train", "eval"]


def test_against_needs_the_src_folder_of_a_multicard_checkout(tmp_path, capsys):
    args = bench.parse_args([f"--root={tmp_path}"])
    with pytest.raises(SystemExit) as stop:
        bench.OtherTree(tmp_path, args)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --against {tmp_path}: no multicard package there") and err.count("\n") == 1


def test_against_process_answers_each_timing_request_in_one_json_line(tmp_path, monkeypatch):
    """The --serve end of --against, in process: it says which multicard it imported, then times
    the loader each request names, until `stop`."""
    args = bench.parse_args(["--serve", f"--root={jpeg_folder(tmp_path / 'photos')}", "--batch=2"])
    answers = io.StringIO()
    monkeypatch.setattr(sys, "stdin", io.StringIO("train 1 1\neval 1 2\nstop\ntrain 2 1\n"))
    monkeypatch.setattr(sys, "stdout", answers)
    bench.serve(args)
    lines = [json.loads(line) for line in answers.getvalue().splitlines()]
    assert lines[0] == {"multicard": multicard.__file__}
    assert len(lines) == 3 and all(line["wall"] > 0 and line["cpu"] > 0 for line in lines[1:])  # nothing after stop
