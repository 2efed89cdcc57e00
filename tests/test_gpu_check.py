"""scripts/gpu_check.sh and its bench scripts, checked without a GPU: a check passes only on evidence (a
step passes on its result file alone, every step skipped is no pass), and its budget, Python and step
names are checked before anything runs."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import one_line

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "gpu_check"))  # the check's scripts import each other as siblings

import summary  # noqa: E402
from throughput import peak_bf16  # noqa: E402
from train_run import steady_throughput  # noqa: E402

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
# gpu_check.sh's exit codes (its header; README "GPU check")
USAGE, FAILED, MISSING, NO_CUDA, NOTHING_CHECKED = 2, 1, 3, 4, 5


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


JUNIT = """<testsuites><testsuite>
<testcase classname="tests.test_gpu_paths" name="test_a"/>
<testcase classname="tests.test_gpu_paths" name="test_b"><failure message="assert 1 == 2&#10;more"/></testcase>
<testcase classname="tests.test_imagenet" name="test_c"><skipped message="needs a CUDA GPU"/></testcase>
<testcase time="0.000"/>
</testsuite></testsuites>"""


def write(path: Path, value) -> None:  # noqa: ANN001
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value if isinstance(value, str) else json.dumps(value))


def test_summary_reports_passed_failed_skipped_and_none_values(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    write(work / "preflight" / "preflight.json", {"torch": "2.11.0", "gpus": ["NVIDIA H200"], "python": "3.12.3"})
    steps = [{"name": "preflight", "status": "passed", "seconds": 9, "limit_s": 60, "reason": ""},
             {"name": "proofs", "status": "failed", "seconds": 80, "limit_s": 170, "reason": "exit 1: x"}]  # fmt: skip
    write(work / "steps.jsonl", "\n".join(json.dumps(s) for s in steps) + '\n{"name": "matrix", "sta')  # cut short
    write(work / "throughput" / "throughput.json", {"status": "passed", "img_per_s": None, "mfu": None})
    rows = [{"name": "fsdp1_bf16_sharded", "status": "passed", "wall_s": None, "eval_top1": None},
            {"name": "sigterm_resume_fp32", "status": "failed", "reason": "AssertionError: differs", "wall_s": 3.0},
            {"name": "eval", "status": "skipped", "reason": "time budget spent"}]  # fmt: skip
    write(work / "proofs" / "proofs.json", {"rows": rows})
    write(work / "cuda_tests.xml", JUNIT)
    write(work / "gpu_decode" / "gpu_decode.json", {"status": "passed", "cpu": {"img_per_s": None}, "gpu": None})
    write(work / "plan_check" / "plan_check.json", {"status": "passed", "predicted": {"tensor_bytes": None},
                                                    "measured": {}, "memory_ratio": None})  # fmt: skip
    assert summary.main([str(work), str(out)]) == 1  # a step and a row failed
    s = json.loads((out / "summary.json").read_text())
    assert [step["name"] for step in s["steps"]] == ["preflight", "proofs"]
    assert s["cuda_tests"]["passed"] == 1 and s["cuda_tests"]["failed"] == ["test_gpu_paths::test_b: assert 1 == 2"]
    assert [t["met"] for t in s["targets"]] == [None, None, None]
    md = (out / "summary.md").read_text()
    assert "NVIDIA H200" in md and "| proofs | failed | 80 | 170 | exit 1: x |" in md
    assert "n/a img/s" in md and "MFU n/a (not measured)" in md and "CPU decode n/a img/s, GPU decode n/a" in md
    assert "- sigterm_resume_fp32: FAILED (3.0 s) AssertionError: differs" in md
    assert "- eval: SKIPPED time budget spent" in md and "- fsdp1_bf16_sharded: PASSED {" in md
    assert "1 passed, 1 failed, 1 skipped (interrupted at the step's time limit" in md  # SIGINT's unnamed case
    assert "skipped: needs a CUDA GPU" in md


def test_summary_of_an_empty_folder_still_writes_both_files(tmp_path):
    assert summary.main([str(tmp_path / "nothing"), str(tmp_path / "out")]) == NOTHING_CHECKED  # no pass: nothing ran
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "no CUDA device" in md and "not run (proofs.json missing)" in md and "not run (matrix.json missing)" in md
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == []


STEPS = ["preflight", "throughput", "proofs", "cuda_tests", "matrix", "gpu_decode", "plan_check"]


def steps_file(work: Path, statuses: dict[str, str]) -> None:
    """steps.jsonl as gpu_check.sh records it: "ran" is an exit 0, whose outcome its result file says."""
    lines = [json.dumps({"name": name, "status": status, "seconds": 1, "limit_s": 60, "reason": ""})
             for name, status in statuses.items()]  # fmt: skip
    write(work / "steps.jsonl", "\n".join(lines) + "\n")


def test_a_gpu_check_whose_every_step_was_skipped_does_not_pass(tmp_path, capsys):
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


def test_a_step_passes_only_on_its_result_file_and_the_summary_is_always_written(tmp_path):
    # A stand-in that answers the torch probe and exits 0 for everything else: no step wrote a result.
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\n[ "$1" = -c ] && echo "torch True"\nexit 0\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    result, _ = gpu_check(out, 30, PYTHON=str(fake), GPU_CHECK_BUDGET_S="60")
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


def omegaconf_hidden(tmp_path: Path) -> str:
    """A PYTHONPATH folder whose omegaconf cannot be imported, as on a machine without it."""
    fake = tmp_path / "hide" / "omegaconf"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'omegaconf'\", name='omegaconf')\n")
    return str(fake.parent)


def gpu_check(out: Path, timeout: float, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, **env}
    start = time.monotonic()
    result = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=timeout, env=env)
    return result, time.monotonic() - start


@pytest.mark.slow
def test_gpu_check_stops_in_its_preflight_naming_a_missing_module(tmp_path):
    (tmp_path / "no-wheels").mkdir()
    result, seconds = gpu_check(tmp_path / "out", 60, PYTHONPATH=omegaconf_hidden(tmp_path),
                                GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"))  # fmt: skip
    assert result.returncode == MISSING, result.stdout + result.stderr
    assert "gpu_check: error: cannot import omegaconf" in result.stdout and seconds < 60
    assert "cannot import omegaconf" in (tmp_path / "out" / "summary.md").read_text()
    assert "== throughput" not in result.stdout  # nothing after the preflight ran


@pytest.mark.slow
def test_gpu_check_with_require_cuda_stops_without_a_gpu(tmp_path):
    result, _ = gpu_check(tmp_path, 60, REQUIRE_CUDA="1")
    assert result.returncode == NO_CUDA, result.stdout + result.stderr
    assert "REQUIRE_CUDA=1 but torch sees no CUDA device" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.tar.gz", "summary.json", "summary.md"]


@pytest.mark.slow
def test_gpu_check_rehearsal_on_cpu_skips_every_cuda_step_inside_its_budget(tmp_path):
    """The whole script as a GPU machine without omegaconf would meet it, on the CPU: the vendored
    wheel stands in, every CUDA step runs its script, which reports itself skipped with the reason
    (in its result file), inside 120 s; nothing about a GPU was checked, so the check does not pass."""
    out = tmp_path / "out"
    result, seconds = gpu_check(out, 200, PYTHONPATH=omegaconf_hidden(tmp_path), GPU_CHECK_BUDGET_S="120")
    assert result.returncode == NOTHING_CHECKED, result.stdout + result.stderr
    assert seconds < 130, result.stdout  # each step's time is in its summary table
    assert "omegaconf is not installed here: using omegaconf-" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "summary.json", "summary.md"]  # <= 8 files
    s = json.loads((out / "summary.json").read_text())
    names = ["preflight", "throughput", "proofs", "cuda_tests", "matrix", "gpu_decode", "plan_check"]
    assert [step["name"] for step in s["steps"]] == names, s["steps"]
    assert s["steps"][0]["status"] == "passed" and all(step["status"] == "skipped" for step in s["steps"][1:])
    assert all(step["limit_s"] > 0 for step in s["steps"]), s["steps"]  # each step's script ran (not skipped for time)
    no_cuda = "no CUDA device (torch.cuda.is_available() is False)"
    assert {step["reason"] for step in s["steps"][1:] if step["name"] != "cuda_tests"} == {no_cuda}
    rows = [*s["proofs"]["rows"], *s["matrix"]["runs"], s["throughput"], s["gpu_decode"], s["plan_check"]]
    assert len(rows) == 7 + 12 + 3 and all(r["status"] == "skipped" and r["reason"] == no_cuda for r in rows)
    tests = s["cuda_tests"]
    assert tests["status"] == "skipped" and tests["passed"] == 0 and not tests["failed"]
    assert len(tests["skipped"]) >= 8 and all("CUDA GPU" in x for x in tests["skipped"])  # needs one, or 2
    assert s["environment"]["omegaconf_from"].endswith("/deps/omegaconf") and not s["environment"]["gpus"]
    assert (out / "summary.md").read_text().strip() in result.stdout
    assert s["verdict"]["exit"] == NOTHING_CHECKED and "gpu_check: NOTHING CHECKED" in result.stdout


@pytest.mark.parametrize("budget", ["abc", "1e9", "12.5", "99999999999999999999", " 120"])
def test_a_gpu_check_budget_that_is_not_whole_seconds_is_one_usage_line(tmp_path, budget):
    out = tmp_path / "out"
    result, _ = gpu_check(out, 30, GPU_CHECK_BUDGET_S=budget)
    assert result.returncode == USAGE, result.stdout + result.stderr
    line = one_line(result.stderr)
    assert line == f"gpu_check: error: GPU_CHECK_BUDGET_S={budget} must be whole seconds from 60 to 3600 (default 480)"
    assert not out.exists() and result.stdout == ""  # refused before anything is made or run


@pytest.mark.parametrize("budget", ["0", "1", "-100", "59", "3601"])
def test_a_gpu_check_budget_too_small_to_run_anything_is_refused_even_with_require_cuda(tmp_path, budget):
    result, _ = gpu_check(tmp_path / "out", 30, GPU_CHECK_BUDGET_S=budget, REQUIRE_CUDA="1")
    assert result.returncode == USAGE, result.stdout + result.stderr
    assert one_line(result.stderr).startswith(f"gpu_check: error: GPU_CHECK_BUDGET_S={budget} must be whole seconds")


def test_an_interpreter_that_only_exits_0_is_refused_before_any_step(tmp_path):
    result, _ = gpu_check(tmp_path / "out", 30, PYTHON="/bin/true")
    assert result.returncode == USAGE, result.stdout + result.stderr
    assert one_line(result.stderr) == (
        "gpu_check: error: PYTHON=/bin/true is not a Python with torch installed (set PYTHON=/path/to/python)"
    )


def test_unknown_steps_in_gpu_check_steps_are_one_usage_line(tmp_path):
    result, _ = gpu_check(tmp_path / "out", 30, GPU_CHECK_STEPS="matrix,cuda-tests")
    assert result.returncode == USAGE, result.stdout + result.stderr
    assert one_line(result.stderr) == (
        "gpu_check: error: GPU_CHECK_STEPS names cuda-tests: choose from throughput,proofs,cuda_tests,matrix,"
        "gpu_decode,plan_check (comma-separated)"
    )


@pytest.mark.slow
def test_gpu_check_without_pytest_skips_the_tests_step_alone(tmp_path):
    """A bare `make demo` environment: the preflight passes, the one step that needs pytest is skipped
    with the reason; with every selected step skipped, nothing was checked (exit 5), not a pass."""
    fake = tmp_path / "hide" / "pytest"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'pytest'\", name='pytest')\n")
    out = tmp_path / "out"
    result, _ = gpu_check(out, 90, PYTHONPATH=str(fake.parent), GPU_CHECK_STEPS="cuda_tests", GPU_CHECK_BUDGET_S="60")
    assert result.returncode == NOTHING_CHECKED, result.stdout + result.stderr
    s = json.loads((out / "summary.json").read_text())
    outcome = {step["name"]: (step["status"], step["reason"]) for step in s["steps"]}
    assert outcome["preflight"] == ("passed", "")
    assert outcome["cuda_tests"][0] == "skipped"
    assert outcome["cuda_tests"][1].startswith("cannot import pytest, which it needs (ModuleNotFoundError")
    assert outcome["matrix"] == ("skipped", "not selected (GPU_CHECK_STEPS=cuda_tests)")
    assert s["environment"]["pytest"] is None and "cuda_tests" in s["environment"]["skipped_steps"]
    assert "gpu_check: NOTHING CHECKED" in result.stdout
