"""scripts/gpu_check.sh and its bench scripts, checked without a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "gpu_check"))  # the check's scripts import each other as siblings

from throughput import peak_bf16  # noqa: E402
from train_run import steady_throughput  # noqa: E402


def test_peak_table_picks_the_specific_model_first():
    assert peak_bf16("NVIDIA H100 80GB HBM3") == 989e12  # SXM
    assert peak_bf16("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16("NVIDIA H200") == 989e12
    assert peak_bf16("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16("NVIDIA L40S") == 362e12 and peak_bf16("NVIDIA L4") == 121e12
    assert peak_bf16("NVIDIA A10G") is None and peak_bf16("Tesla V100-SXM2-16GB") is None


def test_steady_throughput_leaves_out_warm_up_windows_and_weights_by_steps():
    records = [
        {"kind": "step", "step": 10, "img_per_s": 100.0},  # warm-up: left out
        {"kind": "step", "step": 20, "img_per_s": 1000.0},
        {"kind": "epoch", "step": 20},
        {"kind": "step", "step": 30, "img_per_s": 1000.0},
        {"kind": "step", "step": 35, "img_per_s": 250.0},  # half a window at a quarter of the rate
    ]
    rate, windows, steps = steady_throughput(records, warmup_steps=10)
    assert steps == 25 and windows == [1000.0, 1000.0, 250.0]
    assert rate == pytest.approx(25 / (10 / 1000 + 10 / 1000 + 5 / 250))


@pytest.mark.slow
def test_gpu_check_without_cuda_skips_every_gpu_step_and_still_summarises(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    tests = summary["cuda_tests"]
    assert tests["status"] == "skipped" and tests["passed"] == 0 and not tests["failed"]
    # every CUDA test skips for want of a GPU (a few first for want of data the machine lacks)
    assert all(("needs" in s and "CUDA GPU" in s) or "not found" in s for s in tests["skipped"])
    assert sum("CUDA GPU" in s for s in tests["skipped"]) >= 8
    runs = summary["matrix"]["runs"]
    assert len(runs) == 12 and all(r["status"] == "skipped" and "no CUDA device" in r["reason"] for r in runs)
    assert summary["throughput"]["status"] == "skipped"
    assert [t["met"] for t in summary["targets"]] == [None, None, None]
    table = (tmp_path / "summary.md").read_text()
    assert "| single | skipped | skipped | skipped | skipped |" in table and table.strip() in result.stdout
