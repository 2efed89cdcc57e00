"""Issue 37, the checks: a check passes only on evidence. scripts/gpu_check.sh's budget, its Python,
its steps' result files and a machine without pytest; `multicard verify` when every chosen check
would be skipped. Each test is named after its case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from multicard.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "gpu_check"))  # the check's scripts import each other as siblings

import summary  # noqa: E402

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
USAGE, FAILED, MISSING, NOTHING_CHECKED = 2, 1, 3, 5  # gpu_check.sh's exit codes (its header; README "GPU check")
STEPS = ["preflight", "throughput", "proofs", "cuda_tests", "matrix", "gpu_decode", "plan_check"]
SMALL = ["model.name=smallcnn", "data.image_size=16", "train.global_batch_size=32"]


def gpu_check(out: Path, timeout: float = 30, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=timeout, env=env)


def one_line(err: str) -> str:
    """stderr holds exactly one line and no traceback; that line."""
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    return err.strip()


def write(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value if isinstance(value, str) else json.dumps(value))


def steps_file(work: Path, statuses: dict[str, str]) -> None:
    """steps.jsonl as gpu_check.sh records it: "ran" is an exit 0, whose outcome its result file says."""
    lines = [json.dumps({"name": name, "status": status, "seconds": 1, "limit_s": 60, "reason": ""})
             for name, status in statuses.items()]  # fmt: skip
    write(work / "steps.jsonl", "\n".join(lines) + "\n")


@pytest.mark.parametrize("budget", ["abc", "1e9", "12.5", "99999999999999999999", " 120"])
def test_37_17_a_gpu_check_budget_that_is_not_whole_seconds_is_one_usage_line(tmp_path, budget):
    out = tmp_path / "out"
    result = gpu_check(out, GPU_CHECK_BUDGET_S=budget)
    assert result.returncode == USAGE, result.stdout + result.stderr
    line = one_line(result.stderr)
    assert line == f"gpu_check: error: GPU_CHECK_BUDGET_S={budget} must be whole seconds from 60 to 3600 (default 480)"
    assert not out.exists() and result.stdout == ""  # refused before anything is made or run


@pytest.mark.parametrize("budget", ["0", "1", "-100", "59", "3601"])
def test_37_18_a_gpu_check_budget_too_small_to_run_anything_is_refused_even_with_require_cuda(tmp_path, budget):
    result = gpu_check(tmp_path / "out", GPU_CHECK_BUDGET_S=budget, REQUIRE_CUDA="1")
    assert result.returncode == USAGE, result.stdout + result.stderr
    assert one_line(result.stderr).startswith(f"gpu_check: error: GPU_CHECK_BUDGET_S={budget} must be whole seconds")


def test_37_18_a_gpu_check_whose_every_step_was_skipped_does_not_pass(tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "out"
    write(work / "preflight" / "preflight.json", {"python": "3.12.3", "gpus": []})
    steps_file(work, {"preflight": "ran", **{name: "skipped" for name in STEPS[1:]}})  # the time budget, say
    assert summary.main([str(work), str(out), "--print"]) == NOTHING_CHECKED
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith("gpu_check: NOTHING CHECKED: no step after the preflight passed")
    assert "**NOTHING CHECKED" in (out / "summary.md").read_text()
    # one step that proved something is enough, skips beside it stand
    write(work / "plan_check" / "plan_check.json", {"status": "passed"})
    steps_file(work, {"preflight": "ran", **{name: "skipped" for name in STEPS[1:-1]}, "plan_check": "ran"})
    assert summary.main([str(work), str(out)]) == 0


def test_37_19_an_interpreter_that_only_exits_0_is_refused_before_any_step(tmp_path):
    result = gpu_check(tmp_path / "out", PYTHON="/bin/true")
    assert result.returncode == USAGE, result.stdout + result.stderr
    assert one_line(result.stderr) == (
        "gpu_check: error: PYTHON=/bin/true is not a Python with torch installed (set PYTHON=/path/to/python)"
    )


def test_37_19_a_step_passes_only_on_its_result_file_and_the_summary_is_always_written(tmp_path):
    # A stand-in that answers the torch probe and exits 0 for everything else: no step wrote a result.
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\n[ "$1" = -c ] && echo "torch True"\nexit 0\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    result = gpu_check(out, PYTHON=str(fake), GPU_CHECK_BUDGET_S="60")
    assert result.returncode == MISSING, result.stdout + result.stderr
    assert one_line(result.stderr) == (
        f"gpu_check: error: the preflight exited 0 but wrote no preflight.json: it did not run (PYTHON={fake})"
    )
    assert "passed" not in result.stdout and "== throughput" not in result.stdout
    assert "summary.py failed (exit 0)" in (out / "summary.md").read_text()  # written by the script itself
    # steps that exited 0: each failed without its result file, passed or skipped as its file says
    work = tmp_path / "work"
    steps_file(work, dict.fromkeys(STEPS, "ran"))
    write(work / "matrix" / "matrix.json", {"runs": [{"name": "single-fp32", "status": "skipped", "reason": "x"}]})
    assert summary.main([str(work), str(out)]) == FAILED
    s = json.loads((out / "summary.json").read_text())
    outcome = {step["name"]: (step["status"], step["reason"]) for step in s["steps"]}
    assert outcome["preflight"] == ("failed", "exited 0 but wrote no preflight.json")
    assert outcome["cuda_tests"] == ("failed", "exited 0 but cuda_tests.xml was not written")
    assert outcome["plan_check"] == ("failed", "exited 0 but wrote no plan_check.json")
    assert outcome["matrix"] == ("skipped", "x")
    md = (out / "summary.md").read_text()
    assert "| throughput | failed | 1 | 60 | exited 0 but wrote no throughput.json |" in md


def test_37_20_verify_refuses_checks_that_would_all_be_skipped(capsys):
    assert main(["verify", "model.name=squeezenet1_1", "--checks", "parity"]) == USAGE  # dropout: no parity
    assert one_line(capsys.readouterr().err) == (
        "multicard: error: --checks parity would check nothing: parity cannot compare a model with dropout (its "
        "masks differ per rank): add eval, coverage or resume to --checks"
    )
    assert main(["verify", "--checks", "resume", "--steps", "1", *SMALL]) == USAGE
    assert one_line(capsys.readouterr().err) == (
        "multicard: error: --checks resume would check nothing: resume needs a step inside an epoch to stop the job "
        "at and none of its 1 steps but the last is: raise --steps (4 or more on synthetic data)"
    )


def test_37_20_verify_whose_runs_left_every_check_skipped_does_not_pass(monkeypatch, capsys):
    """What only the runs can tell (a dataset of one step per epoch: nowhere to stop inside one)."""
    import multicard.tools.verify as verify

    monkeypatch.setattr(verify, "_run_all", lambda options, runs, dropout: ({"cut": None}, {}))
    assert main(["verify", "--checks", "resume", *SMALL]) == USAGE
    captured = capsys.readouterr()
    assert "SKIP resume inside an epoch: no step of the 4 but the last is inside an epoch" in captured.out
    assert one_line(captured.err).startswith("multicard: error: nothing was checked: every selected check was skipped")


def test_37_21_unknown_steps_in_gpu_check_steps_are_one_usage_line(tmp_path):
    result = gpu_check(tmp_path / "out", GPU_CHECK_STEPS="matrix,cuda-tests")
    assert result.returncode == USAGE, result.stdout + result.stderr
    assert one_line(result.stderr) == (
        "gpu_check: error: GPU_CHECK_STEPS names cuda-tests: choose from throughput,proofs,cuda_tests,matrix,"
        "gpu_decode,plan_check (comma-separated)"
    )


@pytest.mark.slow
def test_37_21_gpu_check_without_pytest_skips_the_tests_step_alone(tmp_path):
    """A bare `make demo` environment: the preflight passes, the one step that needs pytest is skipped
    with the reason; with every selected step skipped, nothing was checked (exit 5), not a pass."""
    fake = tmp_path / "hide" / "pytest"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'pytest'\", name='pytest')\n")
    out = tmp_path / "out"
    result = gpu_check(out, 90, PYTHONPATH=str(fake.parent), GPU_CHECK_STEPS="cuda_tests", GPU_CHECK_BUDGET_S="60")
    assert result.returncode == NOTHING_CHECKED, result.stdout + result.stderr
    s = json.loads((out / "summary.json").read_text())
    outcome = {step["name"]: (step["status"], step["reason"]) for step in s["steps"]}
    assert outcome["preflight"] == ("passed", "")
    assert outcome["cuda_tests"][0] == "skipped"
    assert outcome["cuda_tests"][1].startswith("cannot import pytest, which it needs (ModuleNotFoundError")
    assert outcome["matrix"] == ("skipped", "not selected (GPU_CHECK_STEPS=cuda_tests)")
    assert s["environment"]["pytest"] is None and "cuda_tests" in s["environment"]["skipped_steps"]
    assert "gpu_check: NOTHING CHECKED" in result.stdout
