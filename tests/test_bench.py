"""multicard bench: the cell matrix, the row arithmetic, and a tiny real matrix end to end."""

from __future__ import annotations

import json

import matplotlib.image
import pytest

from conftest import cli
from multicard.base.errors import UserError
from multicard.runtime.clock import summary_ms
from multicard.tools.bench.cells import DEFAULT_VARIANT, Cell, Variant, choose_cells, parse_variant
from multicard.tools.bench.outputs import heartbeat_lines
from multicard.tools.bench.runner import make_rows

REQUIRED = {"runner", "strategy", "world_size", "precision", "img_per_s", "step_ms_median", "peak_mem_mb"}


def test_plan_skips_what_this_machine_cannot_run_with_reasons():
    matrix = choose_cells(
        ["multicard", "plain", "lightning"], ["single", "dp", "ddp"], [2, 4], ["fp32"], [], gpus=0, cpu_cores=2
    )
    reasons = {c.label: r for c, r in matrix.skipped}
    assert "DataParallel needs CUDA GPUs" in reasons["multicard/dp×2/fp32"]
    assert "only 2 CPU cores" in reasons["multicard/ddp×4/fp32"]
    runnable = {c.label for c in matrix.cells}
    assert {"multicard/single×1/fp32", "plain/single×1/fp32", "multicard/ddp×2/fp32", "plain/ddp×2/fp32"} <= runnable
    assert not any(c.strategy == "dp" for c in matrix.cells)


def test_plan_on_gpus_counts_gpus_not_cores():
    matrix = choose_cells(["multicard"], ["dp", "ddp"], [2, 4], ["bf16"], [], gpus=2, cpu_cores=64)
    assert {c.label for c in matrix.cells} == {"multicard/dp×2/bf16", "multicard/ddp×2/bf16"}
    assert all("2 present" in r or "only 2 GPU" in r for _, r in matrix.skipped)


def test_variants_add_multicard_cells_of_their_strategy_only():
    bf16 = parse_variant("bf16:ddp.comm_hook=bf16", "ddp")
    assert bf16 == Variant("bf16", ("ddp.comm_hook=bf16",), "ddp")
    zero2 = parse_variant("zero2:fsdp.reshard_after_forward=false", "fsdp")
    strategies = ["single", "ddp", "fsdp"]
    matrix = choose_cells(["multicard", "plain"], strategies, [2], ["fp32"], [bf16, zero2], gpus=0, cpu_cores=2)
    with_variant = [c.label for c in matrix.cells if c.variant != DEFAULT_VARIANT]
    assert with_variant == ["multicard/ddp×2/fp32+bf16", "multicard/fsdp×2/fp32+zero2"]
    assert [c.label for c, _ in matrix.skipped if c.strategy == "fsdp"] == ["plain/fsdp×2/fp32"]  # no fsdp yardstick


@pytest.mark.parametrize("text", ["bf16", "bf16:", ":ddp.comm_hook=bf16", "x:ddp.comm_hook"])
def test_bad_variant_is_a_user_error(text):
    with pytest.raises(UserError, match="NAME:KEY=VALUE"):
        parse_variant(text, "ddp")


def test_unknown_runner_is_a_user_error():
    with pytest.raises(UserError, match="--runners torch"):
        choose_cells(["torch"], ["single"], [1], ["fp32"], [], gpus=0, cpu_cores=2)


def _result(ms: float) -> dict:
    return {"step_ms": {"median": ms, "p10": ms * 0.9, "p90": ms * 1.1}, "peak_mem_mb_per_device": [100.0]}


def test_rows_take_ratios_within_each_repeat():
    single_mc = Cell("multicard", "single", 1, "fp32")
    single_plain = Cell("plain", "single", 1, "fp32")
    ddp_mc = Cell("multicard", "ddp", 2, "fp32")
    # The machine is 2× slower in repeat 2: ratios within a repeat are unaffected.
    results = {
        single_mc: [_result(102), _result(204)],
        single_plain: [_result(100), _result(200)],
        ddp_mc: [_result(120), _result(240)],
    }
    rows = {(r["runner"], r["strategy"]): r for r in make_rows(results, [], global_batch=64, gpus=0)}
    assert rows["multicard", "single"]["vs_plain"]["median"] == pytest.approx(1.02)
    assert rows["multicard", "single"]["vs_plain"]["max"] == pytest.approx(1.02)
    # On CPU the single process already uses every core: efficiency = speed ratio.
    assert rows["multicard", "ddp"]["efficiency"]["median"] == pytest.approx(102 / 120)
    assert rows["multicard", "single"]["step_ms_median"] == pytest.approx(153)
    assert rows["multicard", "single"]["img_per_s"] == pytest.approx(64 / 0.153)


def test_rows_on_gpus_divide_by_the_device_count():
    single, ddp = Cell("multicard", "single", 1, "bf16"), Cell("multicard", "ddp", 4, "bf16")
    rows = make_rows({single: [_result(100)], ddp: [_result(110)]}, [], global_batch=512, gpus=4)
    eff = next(r for r in rows if r["strategy"] == "ddp")["efficiency"]["median"]
    assert eff == pytest.approx(100 / 110 / 4)


def test_failed_and_skipped_cells_become_rows_with_reasons():
    cell = Cell("multicard", "ddp", 2, "fp32")
    skipped = (Cell("plain", "dp", 2, "fp32", DEFAULT_VARIANT), "DataParallel needs CUDA GPUs")
    rows = make_rows({cell: [{"failed": "worker exited with code 1"}]}, [skipped], 64, gpus=0)
    assert [(r["status"], r["reason"]) for r in rows] == [
        ("failed", "worker exited with code 1"),
        ("skipped", "DataParallel needs CUDA GPUs"),
    ]


def test_rows_carry_the_costliest_ranks_heartbeat():
    cell = Cell("multicard", "ddp", 2, "fp32")
    beat = {"beats": 30, "wall_ms_per_beat": 0.5, "cpu_ms_per_beat": 0.3, "wall_share": 0.0005}
    dearer = {**beat, "wall_ms_per_beat": 2.0, "wall_share": 0.002}
    rows = make_rows({cell: [{**_result(100), "heartbeat_per_rank": [beat, dearer]}]}, [], 64, gpus=0)
    assert rows[0]["heartbeat"] == dearer
    assert heartbeat_lines(rows) == [
        "heartbeats of multicard/ddp×2/fp32: at most 0.200% of step time (2.00 ms per beat, 0.30 ms of it CPU; "
        "costliest rank)"
    ]
    assert heartbeat_lines(make_rows({cell: [_result(100)]}, [], 64, gpus=0)) == []  # debug.stall_s=0: none


def test_summary_of_step_times():
    s = summary_ms([0.010, 0.011, 0.012, 0.013, 0.100])
    assert s["median"] == pytest.approx(12.0)
    assert s["p10"] < s["median"] < s["p90"] < 100.0


@pytest.mark.distributed
def test_tiny_matrix_writes_json_and_png(tmp_path):
    out = tmp_path / "bench"
    result = cli(
        "bench", "--runners", "multicard,plain", "--strategies", "single,dp,ddp", "--world-sizes", "2",
        "--ddp-variant", "bf16:ddp.comm_hook=bf16", "--warmup", "1", "--steps", "3", "--out", str(out),
        "model.name=smallcnn", "data.image_size=16", "train.global_batch_size=32",
        timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((out / "bench.json").read_text())
    assert isinstance(rows, list)
    ok = {(r["runner"], r["strategy"], r["variant"]): r for r in rows if r["status"] == "ok"}
    assert set(ok) == {
        ("multicard", "single", "default"),
        ("plain", "single", "default"),
        ("multicard", "ddp", "default"),
        ("plain", "ddp", "default"),
        ("multicard", "ddp", "bf16"),
    }
    for row in ok.values():
        assert REQUIRED <= row.keys()
        assert row["img_per_s"] > 0 and row["step_ms_median"] > 0
    ddp = ok["multicard", "ddp", "default"]
    assert ddp["world_size"] == 2 and ddp["peak_mem_mb"] > 0 and len(ddp["peak_mem_mb_per_device"]) == 2
    assert set(ddp["breakdown"]) == {"data_ms", "compute_ms", "comm_exposed_ms", "optimizer_ms"}
    assert ddp["allreduce"]["raw_gb_per_s"] > 0 and ddp["allreduce"]["ddp_gb_per_s"] > 0
    assert ddp["vs_plain"]["n"] == 1 and ddp["efficiency"]["median"] > 0
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert {r["strategy"] for r in skipped} == {"dp"} and all("CUDA" in r["reason"] for r in skipped)
    image = matplotlib.image.imread(out / "bench.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert "multicard/ddp×2/fp32" in result.stdout


def test_bench_bad_flag_is_one_line(tmp_path):
    result = cli("bench", "--runners", "multicard,torch", "--out", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--runners torch" in result.stderr


@pytest.mark.distributed
def test_lightning_and_accelerate_rows_when_the_bench_extra_is_installed(tmp_path):
    pytest.importorskip("lightning", reason="the bench extra (lightning) is not installed")
    pytest.importorskip("accelerate", reason="the bench extra (accelerate) is not installed")
    out = tmp_path / "bench"
    result = cli(
        "bench", "--runners", "plain,lightning,accelerate", "--strategies", "single", "--warmup", "1",
        "--steps", "2", "--out", str(out), "model.name=smallcnn", "data.image_size=16", "train.global_batch_size=32",
        timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {r["runner"]: r for r in json.loads((out / "bench.json").read_text())}
    assert {rows[k]["status"] for k in ("lightning", "accelerate")} == {"ok"}
    assert rows["lightning"]["vs_plain"]["median"] > 0 and rows["accelerate"]["step_ms_median"] > 0
