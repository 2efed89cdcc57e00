"""multicard verify: passes on a correct setup, fails with a clear difference on broken ones."""

from __future__ import annotations

import pytest
import torch

from conftest import cli, load_checkpoint, one_line
from multicard.base.errors import ExitCode, UserError
from multicard.cli.main import main
from multicard.tools.verify import VerifyOptions, verify
from multicard.tools.verify.checks import (
    RESUME_RTOL,
    check_coverage,
    compare_eval,
    compare_parameters,
    compare_resumed,
    resume_cut,
)

SMALL = ["model.name=smallcnn", "data.image_size=16", "data.val_size=203", "train.global_batch_size=32"]
PARITY = ("--checks", "parity,eval,coverage")  # the checks a broken run setup fails: no resume runs needed


def check_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]


@pytest.fixture(scope="module")
def passing(tmp_path_factory):
    """`multicard verify` with every check on a correct setup, its runs kept (shared by the tests below)."""
    keep = tmp_path_factory.mktemp("verify")
    result = cli("verify", "--keep", str(keep), *SMALL, timeout=240)
    return result, keep


@pytest.mark.distributed
def test_verify_passes_on_a_correct_setup(passing):
    result, _ = passing
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    lines = check_lines(result.stdout)
    assert len(lines) == 5 and all(line.startswith("PASS") for line in lines), result.stdout
    assert "sync_bn=true" in result.stdout  # smallcnn has BatchNorm: compared with global statistics


@pytest.mark.distributed
def test_verify_resume_check_passes_in_the_same_layout_and_in_one_process(passing):
    """The job is stopped inside an epoch (the checkpoint holds step 1 of 2) and resumed twice."""
    result, keep = passing
    stopped = "ddp×2 stopped at step 1 (step 1 of epoch 0)"
    parts = "model, optimizer, scheduler, RNG, data position"
    same = f"PASS {stopped}, resumed as ddp×2: continues bitwise: {parts} identical after resuming and after step 4"
    assert same in result.stdout
    assert f"PASS {stopped}, resumed as 1 process: continues (float64): {parts} within 1e-10" in result.stdout
    checkpoint = load_checkpoint(keep / "multi" / "checkpoints" / "step-000000001.pt")
    assert checkpoint["resume"]["position"]["step_in_epoch"] == 1 and checkpoint["resume"]["world_size"] == 2


@pytest.mark.distributed
def test_verify_resume_check_names_the_dropped_state(tmp_path):
    """--break drops the random streams and the step within the epoch from the job's checkpoint:
    both resumed runs fail, naming what differs right after resuming (and where)."""
    result = cli(
        "verify", "--checks", "resume", "--break", "rng", "--break", "data-position", "--keep", str(tmp_path), *SMALL,
        timeout=240,
    )  # fmt: skip
    assert result.returncode == 4, result.stdout + result.stderr[-2000:]
    lines = check_lines(result.stdout)
    assert len(lines) == 2 and all(line.startswith("FAIL") for line in lines), result.stdout
    for line in lines:
        assert "after resuming: RNG, data position differ (rng.0.torch: " in line
        assert "position.step_in_epoch: 0 vs 1" in line
    assert result.stderr.strip().splitlines()[-1].startswith("multicard: error: 2 check(s) failed: ddp×2 stopped at")


def test_verify_bad_checks_are_one_line():
    result = cli("verify", "--checks", "resum", *SMALL)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "multicard: error: --checks 'resum': choose from parity, eval, coverage, resume (comma-separated)"
    )
    with pytest.raises(UserError, match="^--break rng breaks what the resume check tests; add resume to --checks$"):
        verify(VerifyOptions(overrides=SMALL, faults=["rng"], checks=["parity"]))
    with pytest.raises(UserError, match="^--break data-position needs a step inside an epoch to stop the job at"):
        verify(VerifyOptions(overrides=SMALL, faults=["data-position"], steps=3))  # synthetic: 1 step per epoch


def test_verify_refuses_checks_that_would_all_be_skipped(capsys):
    assert main(["verify", "model.name=squeezenet1_1", "--checks", "parity"]) == ExitCode.BAD_INPUT  # dropout
    assert one_line(capsys.readouterr().err) == (
        "multicard: error: --checks parity would check nothing: parity cannot compare a model with dropout (its "
        "masks differ per rank): add eval, coverage or resume to --checks"
    )
    assert main(["verify", "--checks", "resume", "--steps", "1", *SMALL]) == ExitCode.BAD_INPUT
    assert one_line(capsys.readouterr().err) == (
        "multicard: error: --checks resume would check nothing: resume needs a step inside an epoch to stop the job "
        "at and none of its 1 steps but the last is: raise --steps (4 or more on synthetic data)"
    )


def test_verify_whose_runs_left_every_check_skipped_does_not_pass(monkeypatch, capsys):
    """What only the runs can tell (a dataset of one step per epoch: nowhere to stop inside one)."""
    monkeypatch.setattr("multicard.tools.verify._run_all", lambda options, runs, dropout: ({"cut": None}, {}))
    assert main(["verify", "--checks", "resume", *SMALL]) == ExitCode.BAD_INPUT
    captured = capsys.readouterr()
    assert "SKIP resume inside an epoch: no step of the 4 but the last is inside an epoch" in captured.out
    assert one_line(captured.err).startswith("multicard: error: nothing was checked: every selected check was skipped")


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
    result = cli("verify", *PARITY, "--break", fault, "--keep", str(tmp_path), *SMALL, timeout=240)
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


def test_past_1e9_parity_allows_the_rounding_one_process_makes_with_itself():
    """A model whose comparisons rounding decides (speednet on CIFAR-10) lands as far from itself at
    another thread count as ddp lands from one process: that floor, not a fixed number, is the bar;
    a real difference stays far above any floor allowed."""
    ref = {"w": torch.ones(4, dtype=torch.float64)}
    off = {"w": torch.tensor([1.0, 1.0 + 2.3e-9, 1.0, 1.0], dtype=torch.float64)}
    assert compare_parameters(off, ref, "ddp×2", 4).status == "fail"  # no floor measured: 1e-9
    rounding = compare_parameters(off, ref, "ddp×2", 4, floor=1.4e-9)
    assert rounding.status == "pass" and "1.40e-09" in rounding.detail
    assert compare_parameters(off, ref, "ddp×2", 4, floor=1e-11).status == "fail"  # 2.3e-9 > 100 × 1e-11 (1e-9)
    fault = {"w": torch.tensor([1.0, 1.41, 1.0, 1.0], dtype=torch.float64)}  # --break rank-seed's size
    assert compare_parameters(fault, ref, "ddp×2", 4, floor=0.5).status == "fail"  # capped at 1e-6


@pytest.mark.parametrize(
    "floor, rule",
    [
        (0.0, "differs from itself by 0.00e+00 at another thread count, so rounding does not explain more: "
              "the tolerance stays 1e-09"),
        (1e-12, "by 1.00e-12 at another thread count, so rounding does not explain more: the tolerance stays 1e-09"),
        (1.4e-9, "by 1.40e-09 at another thread count (rounding decides comparisons in this model), so the "
                 "tolerance is 100× that: 1.4e-07"),
        (0.5, "by 5.00e-01 at another thread count (rounding decides comparisons in this model), so the "
              "tolerance is 100× that, at most 1e-06: 1.0e-06"),
    ],
)  # fmt: skip
def test_the_parity_tolerance_line_states_the_rule_it_applied(floor, rule):
    """Before: a floor of 0 read "so the tolerance is 100× that: 1.0e-09"."""
    ref = {"w": torch.ones(4, dtype=torch.float64)}
    off = {"w": torch.tensor([1.0, 1.0 + 2e-3, 1.0, 1.0], dtype=torch.float64)}
    outcome = compare_parameters(off, ref, "ddp×2", 4, floor=floor)
    assert outcome.status == "fail" and outcome.detail.endswith(rule), outcome.detail


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


def _state() -> dict:
    """A recorded state as the verify runs save it, in small."""
    return {
        "model": {"w": torch.ones(3, dtype=torch.float64), "bn.num_batches_tracked": torch.tensor(4)},
        "optimizer": {"state": {"w": {"momentum_buffer": torch.ones(3, dtype=torch.float64)}},
                      "param_groups": [{"lr": 0.1, "fused": None, "params": ["w"]}]},
        "scheduler": {"last_epoch": 1, "_last_lr": [0.1]},
        "scaler": {},
        "position": {"epoch": 0, "step_in_epoch": 1, "global_step": 1, "epoch_totals": [1.5, 2.0, 32.0]},
        "rng": [{"torch": torch.arange(8, dtype=torch.uint8), "python": (3, (1, 2, 3), None)}],
        "next_batch": [1, 3, 4],
    }  # fmt: skip


def test_resume_comparison_names_the_part_that_differs():
    ref = _state()
    assert compare_resumed("r", [("after resuming", _state(), ref)], 0.0).status == "pass"
    cases = {part: _state() for part in ("RNG", "data position", "model", "scheduler")}
    cases["RNG"]["rng"][0]["torch"] = torch.zeros(8, dtype=torch.uint8)
    cases["data position"]["position"]["step_in_epoch"] = 0
    cases["model"]["model"]["w"][1] += 1e-6
    cases["scheduler"]["scheduler"]["last_epoch"] = 2
    for part, resumed in cases.items():
        outcome = compare_resumed("r", [("after resuming", resumed, ref), ("after step 4", ref, ref)], 0.0)
        assert outcome.status == "fail" and outcome.detail.startswith(f"after resuming: {part} differs ("), outcome
    assert "position.step_in_epoch: 0 vs 1" in compare_resumed("r", [("x", cases["data position"], ref)], 0.0).detail
    assert "rng.0.torch: 7 of 8 values differ" in compare_resumed("r", [("x", cases["RNG"], ref)], 0.0).detail
    assert "model.w: relative difference 1.0e-06" in compare_resumed("r", [("x", cases["model"], ref)], 0.0).detail


def test_resume_comparison_tolerates_rounding_only_across_world_sizes():
    ref, rounded = _state(), _state()
    rounded["model"]["w"][1] += 1e-13
    rounded["position"]["epoch_totals"][0] += 1e-15
    assert compare_resumed("r", [("end", rounded, ref)], 0.0).status == "fail"  # not bitwise
    assert compare_resumed("r", [("end", rounded, ref)], RESUME_RTOL).status == "pass"
    counter = _state()
    counter["model"]["bn.num_batches_tracked"] += 1  # integers: exact at any tolerance
    outcome = compare_resumed("r", [("end", counter, ref)], RESUME_RTOL)
    assert outcome.status == "fail" and "model.bn.num_batches_tracked: 5 vs 4" in outcome.detail
    kernels = _state()
    kernels["optimizer"]["param_groups"][0]["fused"] = True  # how an update is computed, not what it computes
    assert compare_resumed("r", [("end", kernels, ref)], 0.0).status == "pass"


def test_resume_stops_inside_an_epoch_near_the_middle_of_the_run():
    assert resume_cut(4, 2) == 1  # step 1 of 2 in epoch 0; the resumed run crosses into epoch 1
    assert resume_cut(4, 390) == 2
    assert resume_cut(6, 3) == 2
    assert resume_cut(3, 1) is None  # every step ends an epoch
