"""Issue 37, the checks: a check passes only on evidence. scripts/gpu_check.sh's budget, its Python,
its steps' result files and a machine without pytest; `multicard verify` when every chosen check
would be skipped. Each test is named after its case."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from multicard.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "gpu_check"))  # the check's scripts import each other as siblings


SCRIPT = ROOT / "scripts" / "gpu_check.sh"
USAGE, FAILED, MISSING, NOTHING_CHECKED = 2, 1, 3, 5  # gpu_check.sh's exit codes (its header; README "GPU check")
SMALL = ["model.name=smallcnn", "data.image_size=16", "train.global_batch_size=32"]


def gpu_check(out: Path, timeout: float = 30, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=timeout, env=env)


def one_line(err: str) -> str:
    """stderr holds exactly one line and no traceback; that line."""
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    return err.strip()


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
