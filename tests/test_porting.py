"""Real scripts' shapes on multicard.Run, as docs/library.md "Porting real scripts" walks through them:
a GAN (two networks, two optimizers, BatchNorm synced), a frozen teacher's distillation, truncated
BPTT over ordered streams (hidden state carried from batch to batch) and a step-based loop (evaluation
every N steps, a per-pass and a plateau scheduler, the model's own methods on the returned model).

Each example in float64: ddp×2 stopped by SIGTERM at a step equals one process at that step, and the
stopped run resumed in one process ends where one process ends. The runs of every example start
together (one shared fixture): the machine is busy with all of them at once, not one after another.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, clean_env, max_rel_diff, slowed, wait_for
from multicard.checkpoint import checkpoints_in, read_checkpoint

EXAMPLES = ROOT / "examples"
SAVED = ["--precision", "fp64", "--checkpoint-every", "1", "--keep-last", "100"]  # every step kept, to compare
SHAPES = {
    "gan": (EXAMPLES / "gan" / "train_gan.py", ["--samples", "96", "--batch-size", "8", "--epochs", "2"]),
    "distillation": (EXAMPLES / "distillation" / "train_distill.py", ["--samples", "96", "--batch-size", "8",
                                                                       "--epochs", "2"]),  # fmt: skip
    "bptt": (EXAMPLES / "text" / "train_bptt.py", ["--limit", "4000", "--batch-size", "16", "--epochs", "2"]),
    "steps": (EXAMPLES / "steps" / "train_gpt.py", ["--limit", "200", "--block", "8", "--batch-size", "8",
                                                    "--steps", "30", "--eval-every", "8"]),  # fmt: skip
}
STEPS_PER_EPOCH = {"gan": 12, "distillation": 12, "bptt": 14, "steps": 21}
DDP2 = ("--nproc-per-node", "2", "--oversubscribe")


def start(path: Path, *args: str, launch: tuple[str, ...] = (), env: dict | None = None) -> subprocess.Popen:
    program = ["-m", "multicard", "run", *launch, str(path)] if launch else [str(path)]
    return subprocess.Popen(
        [sys.executable, *program, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=clean_env(env), start_new_session=True,
    )  # fmt: skip


def ended(proc: subprocess.Popen, code: int = 0) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err
    return out + err


@pytest.fixture(scope="module")
def ported(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per example: one process (every step kept), ddp×2 stopped by SIGTERM, that run resumed in one
    process; and the GAN under fsdp×2 (evaluating one image on two ranks), the step-based loop in bf16."""
    base = tmp_path_factory.mktemp("ported")
    procs = {}
    for name, (path, args) in SHAPES.items():
        procs[name, "one"] = start(path, *args, *SAVED, "--out", str(base / name / "one"))
        procs[name, "stopped"] = start(path, *args, *SAVED, "--out", str(base / name / "stopped"), launch=DDP2,
                                       env=slowed(300))  # fmt: skip
    gan, gan_args = SHAPES["gan"]
    procs["gan", "fsdp"] = start(gan, *gan_args, "--precision", "fp64", "--strategy", "fsdp", "--val-samples", "1",
                                 "--out", str(base / "gan" / "fsdp"), launch=DDP2)  # fmt: skip
    procs["steps", "bf16"] = start(SHAPES["steps"][0], "--limit", "200", "--block", "8", "--batch-size", "8",
                                   "--steps", "2", "--eval-every", "2", "--precision", "bf16", "--out",
                                   str(base / "steps" / "bf16"))  # fmt: skip
    for name in SHAPES:  # each stopped once its first checkpoint is there
        folder = base / name / "stopped" / "checkpoints"
        wait_for(lambda folder=folder: bool(checkpoints_in(folder)), timeout=240, what=f"{name}'s first checkpoint")
        os.killpg(procs[name, "stopped"].pid, signal.SIGTERM)
    outputs = {key: ended(proc, 143 if key[1] == "stopped" else 0) for key, proc in procs.items()}
    resumed = {}
    for name, (path, args) in SHAPES.items():
        shutil.copytree(base / name / "stopped", base / name / "resumed")
        resumed[name] = start(path, *args, *SAVED, "--out", str(base / name / "resumed"))
    outputs |= {(name, "resumed"): ended(proc) for name, proc in resumed.items()}
    return {"base": base, "outputs": outputs}


def assert_alike(a: dict, b: dict) -> None:
    """The run's model and its others (a GAN's second network, a teacher) within 1e-10."""
    assert max_rel_diff(a["model"], b["model"]) < 1e-10
    for key in b.get("models", {}):
        assert max_rel_diff(a["models"][key], b["models"][key]) < 1e-10


def stop_step(out: str) -> int:
    line = next(line for line in out.splitlines() if "stopped by SIGTERM at step" in line)
    return int(line.split("at step ")[1].split(";")[0])


@pytest.mark.distributed
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_real_scripts_shape_trains_alike_under_ddp2_and_resumes_in_one_process(ported, shape):
    base, outputs = ported["base"] / shape, ported["outputs"]
    step = stop_step(outputs[shape, "stopped"])
    assert 0 < step < 2 * STEPS_PER_EPOCH[shape] and f"resumed from {base / 'resumed'}" in outputs[shape, "resumed"]
    if shape == "bptt":  # in the middle of an epoch: every stream's hidden state came back with the checkpoint
        carried = read_checkpoint(base / "stopped" / "checkpoints" / "last.pt")["resume"]["streams0"]
        assert step % STEPS_PER_EPOCH[shape] and carried["tensors"][0].shape == (1, 16, 64)
    at_stop, last = f"checkpoints/step-{step:09d}.pt", "checkpoints/last.pt"
    assert_alike(read_checkpoint(base / "stopped" / at_stop), read_checkpoint(base / "one" / at_stop))
    assert_alike(read_checkpoint(base / "resumed" / last), read_checkpoint(base / "one" / last))


@pytest.mark.distributed
def test_two_optimizers_set_up_by_run_setup_train_under_fsdp_as_in_one_process(ported):
    gan = ported["base"] / "gan"
    assert (gan / "fsdp" / "checkpoints" / "last" / "COMPLETE").is_file()  # fsdp's sharded format
    whole = read_checkpoint(gan / "fsdp" / "checkpoints" / "last")
    one = torch.load(gan / "one" / "checkpoints" / "last.pt", weights_only=True)
    assert max_rel_diff(whole["model"], one["model"]) < 1e-10
    assert max_rel_diff(whole["models"]["1"], one["models"]["1"]) < 1e-10
    assert "samples: brightest pixel of 16 generated images" in ported["outputs"]["gan", "fsdp"]


@pytest.mark.distributed
def test_evaluation_of_fewer_samples_than_ranks_under_fsdp_counts_each_once(ported):
    lines = (ported["base"] / "gan" / "fsdp" / "metrics.jsonl").read_text().splitlines()
    epochs = [r for r in map(json.loads, lines) if r["kind"] == "epoch"]
    assert [r["val_samples"] for r in epochs] == [1, 1] and all(r["d_real"] in (0.0, 1.0) for r in epochs)


@pytest.mark.distributed  # its fixture runs ddp×2 and fsdp×2 too
def test_the_models_own_methods_work_on_what_setup_returns_under_bf16(ported):
    out = ported["outputs"]["steps", "bf16"]
    assert "precision=bf16" in out and "sample: '" in out
    assert "tflops" in (ported["base"] / "steps" / "bf16" / "metrics.jsonl").read_text()
