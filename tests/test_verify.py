"""multicard verify: passes on a correct setup, fails with a clear difference on broken ones."""

from __future__ import annotations

import pytest
import torch

from conftest import cli
from multicard.verify.checks import check_coverage, compare_eval, compare_parameters

SMALL = ["model.name=smallcnn", "data.image_size=16", "data.val_size=203", "train.global_batch_size=32"]


@pytest.mark.distributed
def test_verify_passes_on_a_correct_setup(tmp_path):
    result = cli("verify", "--keep", str(tmp_path), *SMALL, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]
    assert len(lines) == 3 and all(line.startswith("PASS") for line in lines), result.stdout
    assert "sync_bn=true" in result.stdout  # smallcnn has BatchNorm: compared with global statistics


@pytest.mark.distributed
def test_verify_checks_fsdp_zero2_too(tmp_path):
    result = cli("verify", "--keep", str(tmp_path), *SMALL, "strategy=fsdp", "fsdp.reshard_after_forward=false")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "PASS fsdp×2 (ZeRO-2) equals single after 4 steps (float64)" in result.stdout


@pytest.mark.distributed
@pytest.mark.parametrize(
    "fault, message",
    [
        ("no-set-epoch", "epoch 1 repeats epoch 0's order"),
        ("rank-seed", "used twice across ranks"),
    ],
)
def test_verify_fails_on_a_broken_setup(fault, message, tmp_path):
    result = cli("verify", "--break", fault, "--keep", str(tmp_path), *SMALL, timeout=240)
    assert result.returncode == 4, result.stdout + result.stderr[-2000:]
    assert message in result.stdout
    assert "FAIL ddp×2 equals single" in result.stdout  # the parameters drift too
    assert result.stderr.strip().splitlines()[-1].startswith("multicard: error: 2 check(s) failed")


def test_parameter_check_reports_the_largest_difference():
    ref = {"a.weight": torch.ones(3, dtype=torch.float64), "a.steps": torch.tensor(4)}
    same = {k: v.clone() for k, v in ref.items()}
    assert compare_parameters(same, ref, "ddp×2", 4).status == "pass"
    off = {**same, "a.weight": torch.tensor([1.0, 1.0 + 1e-6, 1.0], dtype=torch.float64)}
    outcome = compare_parameters(off, ref, "ddp×2", 4)
    assert outcome.status == "fail" and "1.00e-06" in outcome.detail and "a.weight" in outcome.detail


def test_eval_check_needs_identical_counts():
    single = {"samples": 100, "top1": 50.0, "top5": 90.0, "loss": 1.25}
    assert compare_eval(dict(single), single, 2).status == "pass"
    assert compare_eval({**single, "samples": 98}, single, 2).status == "fail"  # padded or dropped samples
    assert compare_eval({**single, "loss": 1.2500001}, single, 2).status == "fail"


def test_coverage_check():
    fine = [[[0, 1], [2, 3]], [[3, 0], [1, 2]]]
    assert check_coverage(fine, num_samples=5, global_batch=4).status == "pass"
    missing = [[[0, 1], [2]], [[3, 0], [1, 2]]]
    assert "3 samples used, expected 4" in check_coverage(missing, 5, 4).detail
