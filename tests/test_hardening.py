"""What a hostile new user broke, each case fixed: one line, a documented exit code, no
traceback, nothing lost. Numbers refer to the cases of the hardening issue."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from conftest import (
    TINY,
)
from multicard.cli.main import main


def one_line(err: str) -> str:
    """stderr holds exactly one line and no traceback; that line."""
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    return err.strip()


def image_folder(root: Path, classes: list[str], per_class: int = 8) -> Path:
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(np.full((8, 8, 3), 10 * c + i, dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


# ------------------------------------------------------------------ silently wrong


def test_1_rerun_with_other_settings_is_refused_and_run_length_may_grow(tmp_path, capsys):
    args = ["train", *TINY, "train.max_steps=4", f"out_dir={tmp_path}"]
    assert main(args) == 0
    config = (tmp_path / "config.yaml").read_text()
    capsys.readouterr()
    assert main([*args, "optim.lr=0.001", "sched.name=constant"]) == 2
    err = one_line(capsys.readouterr().err)
    assert "optim.lr: 0.1 → 0.001" in err and "sched.name: cosine → constant" in err
    assert "train.resume=never" in err and "model.weights=" in err  # the choices
    assert (tmp_path / "config.yaml").read_text() == config  # a refused run writes nothing
    assert main([*args, "optim.name=adamw"]) == 2  # case 8: was KeyError 'step', rc 1
    assert "optim.name: sgd → adamw" in one_line(capsys.readouterr().err)
    assert main(["train", *TINY, "train.max_steps=8", f"out_dir={tmp_path}"]) == 0  # more steps: no fuss
    assert "resumed from" in capsys.readouterr().out


# ------------------------------------------------------------------ left-behind processes and hangs


# ------------------------------------------------------------------ tracebacks where one line is promised


# ------------------------------------------------------------------ security


# ------------------------------------------------------------------ misleading messages and small surprises
