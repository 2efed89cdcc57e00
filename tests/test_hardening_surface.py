"""Issue 27, the surface: 16-bit images, TensorBoard's folder, report, the --out/--keep folders of
plan, bench and verify, plan's bounds and quiet --measure, model.kwargs.num_classes, fsdp options
under ddp, loader processes, and very large images. Each test is named after its case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from conftest import TINY, clean_env
from multicard.base.config import load_config, to_dict
from multicard.cli.main import main

CPU = torch.device("cpu")


def one_line(err: str) -> str:
    """stderr holds exactly one line and no traceback; that line."""
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    return err.strip()


@contextmanager
def unwritable(folder: Path):
    """`folder` refuses new files while inside, even to root (immutable: chattr +i), else by its mode."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not available here (root ignores permission bits)")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
    else:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)


# ------------------------------------------------------------------ case 3: 16-bit greyscale


# ------------------------------------------------------------------ case 10: TensorBoard's folder


# ------------------------------------------------------------------ case 11: report


# ------------------------------------------------------------------ case 12: --out and --keep folders


# ------------------------------------------------------------------ case 15: plan's bounds, quiet --measure


@pytest.mark.slow
def test_27_15_plan_bounds_say_the_truth_and_measure_prints_no_profiler_noise(tmp_path, capsys):
    assert main(["plan", "--memory-gb", "1e9", "--out", str(tmp_path)]) == 2
    assert "--memory-gb 1e+09 must be more than 0 and at most 100,000 GB" in one_line(capsys.readouterr().err)
    assert main(["plan", "--gpu", "h100", "--gpus", "100000000", "--out", str(tmp_path)]) == 2
    assert "--gpus 100000000 must be in 1..16 (devices, or CPU processes, of one node)" in one_line(
        capsys.readouterr().err
    )
    # What --measure runs in each process: the real steps under the profiler, straight in one.
    spec, result_file = tmp_path / "spec.json", tmp_path / "result.json"
    config = to_dict(load_config(None, [*TINY, "train.resume=never", f"out_dir={tmp_path / 'run'}"]))
    spec.write_text(json.dumps({"config": config, "memory_steps": 2, "warmup": 1, "steps": 1,
                                "profile_memory": True, "result": str(result_file)}))  # fmt: skip
    env = {k: v for k, v in clean_env().items() if k != "KINETO_LOG_LEVEL"}
    worker = [sys.executable, "-m", "multicard.tools.plan.worker", str(spec)]
    done = subprocess.run(worker, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(result_file.read_text())["ranks"][0]["peak_bytes"] > 0  # the profiler did run
    for noise in ("USDT", "profiler_start", "gpuGetDeviceCount"):
        assert noise not in done.stdout + done.stderr


# ------------------------------------------------------------------ case 16: model.kwargs.num_classes


# ------------------------------------------------------------------ case 17
