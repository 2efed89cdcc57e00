"""multicard.Run — a user's own loop, model, loss and task get every guarantee (issue 34).

A loop that is not a classifier (examples/segmentation: per-pixel loss, IoU sums, a transform that
draws random numbers, run.state) in float64 with grad_accum 2: ddp×2 and fsdp×2 end where one
process ends; evaluation sums agree at 1, 2 and 3 processes on a dataset no world size divides; a
SIGTERM mid-epoch under ddp×2 resumes under 1, 2 and 3 processes to the uninterrupted run's
parameters and state. The seed example (a tutorial's ResNet-18 script, 10 lines changed) runs
under every launcher; the text example trains; bad usage is one line with exit code 2.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import IterableDataset

from conftest import (
    MULTICARD,
    ROOT,
    assert_bitwise_equal,
    clean_env,
    final_params,
    load_checkpoint,
    max_rel_diff,
    slowed,
    srun_task,
    wait_for,
)
from multicard.base.errors import UserError
from multicard.checkpoint import checkpoints_in
from multicard.runtime.launch import free_port

EXAMPLES = ROOT / "examples"
SHAPES = EXAMPLES / "segmentation" / "train_shapes.py"
# 16 steps an epoch; 20 steps end 4 steps into the second; 12 divides by 1, 2 and 3 processes × 2 micro-steps.
PARITY = ["--precision", "fp64", "--accum", "2", "--steps", "20", "--samples", "200", "--size", "12",
          "--batch-size", "12", "--epochs", "2"]  # fmt: skip
CIFAR = ROOT.parent / "shared" / "data" / "cifar10" / "train"
SEED_TINY = ["--data", str(CIFAR), "--limit", "32", "--val", "16", "--batch-size", "16", "--epochs", "1"]


def script(path: Path, *args: str, launch: tuple[str, ...] = (), env: dict | None = None) -> subprocess.Popen:
    """`multicard run [launch flags] SCRIPT ARGS` (or `python SCRIPT ARGS` without flags), started."""
    program = [MULTICARD, "run", *launch, str(path)] if launch else [sys.executable, str(path)]
    return subprocess.Popen(
        [*program, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=clean_env(env), start_new_session=True,
    )  # fmt: skip


def finished(proc: subprocess.Popen, code: int = 0) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err
    return out


def shapes(out: Path, *extra: str, nproc: int = 1) -> str:
    launch = ("--nproc-per-node", str(nproc), "--oversubscribe") if nproc > 1 else ()
    return finished(script(SHAPES, *PARITY, "--out", str(out), *extra, launch=launch))


def state_of(out: Path) -> torch.Tensor:
    folder = out / "checkpoints"
    path = folder / "last" / "train_state.pt" if (folder / "last").is_dir() else folder / "last.pt"
    return load_checkpoint(path)["resume"]["state"]["loss_ema"]["value"]


def last_epoch(out: Path) -> dict:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "epoch"][-1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The reference runs: one process and ddp×2."""
    base = tmp_path_factory.mktemp("library")
    single, ddp = script(SHAPES, *PARITY, "--out", str(base / "1")), None
    ddp = script(SHAPES, *PARITY, "--out", str(base / "2"), launch=("--nproc-per-node", "2"))
    finished(single), finished(ddp)
    return {1: base / "1", 2: base / "2"}


@pytest.mark.distributed
def test_a_loop_that_is_not_a_classifier_trains_alike_under_ddp_and_fsdp(uninterrupted, tmp_path):
    one, two = uninterrupted[1], uninterrupted[2]
    assert max_rel_diff(final_params(two), final_params(one)) < 1e-10
    assert abs(state_of(two) - state_of(one)) <= 1e-10 * abs(state_of(one))
    shapes(tmp_path / "fsdp", "--strategy", "fsdp", nproc=2)
    assert (tmp_path / "fsdp" / "checkpoints" / "last" / "COMPLETE").is_file()  # fsdp's sharded format
    assert max_rel_diff(final_params(tmp_path / "fsdp"), final_params(one)) < 1e-10
    a, b = last_epoch(one), last_epoch(two)
    assert a["val_samples"] == b["val_samples"] == 53  # 53 images: nothing padded or dropped
    assert a["val_miou"] == b["val_miou"] and b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-12)


@pytest.mark.distributed
def test_sigterm_under_ddp2_resumes_exactly_under_1_2_and_3_processes(uninterrupted, tmp_path):
    stopped = tmp_path / "stopped"
    proc = script(SHAPES, *PARITY, "--out", str(stopped), "--checkpoint-every", "3",
                  launch=("--nproc-per-node", "2"), env=slowed(150))  # fmt: skip
    wait_for(lambda: bool(checkpoints_in(stopped / "checkpoints")), what="the first checkpoint")
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    step = load_checkpoint(stopped / "checkpoints" / "last.pt")["step"]
    assert 3 <= step < 16 and f"multicard: stopped by SIGTERM at step {step}; checkpoint" in err  # mid-epoch
    for nproc in (1, 3, 2):
        resumed = tmp_path / f"resumed-{nproc}"
        shutil.copytree(stopped, resumed)
        out = shapes(resumed, nproc=nproc)
        assert f"resumed from {resumed}/checkpoints/step-{step:09d}.pt" in out
        reference = uninterrupted[1 if nproc != 2 else 2]
        if nproc == 2:
            assert_bitwise_equal(final_params(resumed), final_params(reference))
            assert torch.equal(state_of(resumed), state_of(reference))
        else:
            assert max_rel_diff(final_params(resumed), final_params(reference)) < 1e-10
            assert abs(state_of(resumed) - state_of(reference)) <= 1e-10 * abs(state_of(reference))
        if nproc == 3:  # evaluation at 3 processes: the same sums as at 1
            a, b = last_epoch(uninterrupted[1]), last_epoch(resumed)
            assert b["val_samples"] == 53 and a["val_miou"] == b["val_miou"]
            assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-12)


# ------------------------------------------------------------------ the seed example under every launcher


def test_the_seed_example_differs_from_the_plain_script_in_at_most_10_lines():
    plain = (EXAMPLES / "seed" / "train_plain.py").read_text().splitlines()
    ours = (EXAMPLES / "seed" / "train_multicard.py").read_text().splitlines()
    changed = [line for line in difflib.unified_diff(plain, ours, lineterm="", n=0) if line[:1] in "+-"]
    added = [line for line in changed if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in changed if line.startswith("-") and not line.startswith("---")]
    assert 0 < len(added) <= 10 and len(removed) <= 10, "\n".join(changed)


def _check_seed_run(out: Path, stdout: str, world_size: int) -> None:
    assert stdout.count("val top-1") == 1  # printed by rank 0 only
    assert f"world_size={world_size}" in stdout
    model = load_checkpoint(out / "checkpoints" / "last.pt")["model"]
    assert not any(k.startswith("module.") for k in model)  # unwrapped, whatever the strategy


@pytest.mark.skipif(not CIFAR.is_dir(), reason="needs ../shared/data/cifar10 (the real CIFAR-10 images)")
@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["python", "multicard run", "torchrun", "srun"])
def test_the_seed_example_runs_under_every_launcher(launcher, tmp_path):
    seed = EXAMPLES / "seed" / "train_multicard.py"
    args = [*SEED_TINY, "--out", str(tmp_path)]
    if launcher == "python":
        _check_seed_run(tmp_path, finished(script(seed, *args)), 1)
    elif launcher == "multicard run":
        _check_seed_run(tmp_path, finished(script(seed, *args, launch=("--nproc-per-node", "2"))), 2)
    elif launcher == "torchrun":
        torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(seed), *args]
        done = subprocess.run([sys.executable, *torchrun], capture_output=True, text=True, env=clean_env(), timeout=300)
        assert done.returncode == 0, done.stderr
        _check_seed_run(tmp_path, done.stdout, 2)
    else:
        port = free_port()
        tasks = [srun_task(rank, port, [str(seed), *args]) for rank in (0, 1)]
        outputs = [task.communicate(timeout=300) for task in tasks]
        assert [task.returncode for task in tasks] == [0, 0], outputs
        _check_seed_run(tmp_path, outputs[0][0] + outputs[1][0], 2)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2 or not CIFAR.is_dir(), reason="needs 2 CUDA GPUs and CIFAR-10")
def test_the_seed_example_under_data_parallel(tmp_path):
    out = finished(script(EXAMPLES / "seed" / "train_multicard.py", *SEED_TINY, "--out", str(tmp_path),
                          "--strategy", "dp"))  # fmt: skip
    assert "strategy=dp" in out
    _check_seed_run(tmp_path, out, 1)


@pytest.mark.slow
def test_the_text_example_trains_and_reports_perplexity(tmp_path):
    args = ["--steps", "4", "--context", "32", "--batch-size", "16", "--epochs", "1", "--out", str(tmp_path)]
    out = finished(script(EXAMPLES / "text" / "train_chars.py", *args))
    record = last_epoch(tmp_path)
    assert record["step"] == 4 and 1 < record["val_perplexity"] < 200 and "sample:" in out


# ------------------------------------------------------------------ bad usage: one line, exit 2


class Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(1)


@pytest.fixture
def run(tmp_path, monkeypatch):
    import multicard

    monkeypatch.setattr(sys, "argv", ["my_train.py"])
    made = multicard.Run(str(tmp_path / "run"), global_batch_size=4)
    yield made
    made.close()


def test_backward_before_setup_is_one_line(run):
    with pytest.raises(UserError, match=r"run.backward\(loss\) before run.setup\(model, optimizer\)"):
        run.backward(torch.ones((), requires_grad=True))


def test_a_loader_over_an_iterable_dataset_is_one_line(run):
    with pytest.raises(UserError, match="run.loader needs a map-style dataset"):
        run.loader(Stream())


def test_step_without_backward_is_one_line(run):
    model = torch.nn.Linear(2, 1)
    model, optimizer = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    train = run.loader([torch.zeros(2)] * 8)
    for _ in run.epochs(1):
        for _ in train:
            with pytest.raises(UserError, match=r"run.step\(...\) without run.backward\(loss\)"):
                run.step(optimizer)
            break
        break


@pytest.mark.slow
def test_a_global_batch_the_processes_do_not_divide_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(f"import multicard\nmulticard.Run({str(tmp_path / 'run')!r}, global_batch_size=3)\n")
    proc = script(bad, launch=("--nproc-per-node", "2"))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip() == (
        "multicard: error: global_batch_size=3 is not divisible by 2 process(es) × grad_accum=1; "
        "use a multiple of 2 such as 2 or 4"
    )
    assert not (tmp_path / "run").exists()  # a refused run writes nothing


def test_epochs_before_a_loader_and_a_stepped_optimizer_are_one_line(run):
    model = torch.nn.Linear(2, 1)
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2)).sum().backward()
    stepped.step()
    with pytest.raises(UserError, match="got an optimizer that has already stepped"):
        run.setup(model, stepped)
    run.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(UserError, match=r"run.epochs\(...\) before run.loader\(train_set\)"):
        run.epochs(1)


def test_state_a_checkpoint_cannot_hold_and_options_that_set_an_argument_are_one_line(run):
    with pytest.raises(UserError, match=r"run.state\['f'\] = builtin_function_or_method: a checkpoint holds"):
        run.state["f"] = print
    import multicard

    with pytest.raises(UserError, match=r"sets train.grad_accum: give it as Run's own argument grad_accum=\.\.\."):
        multicard.Run("unused", global_batch_size=4, options={"train.grad_accum": 2})


@pytest.mark.distributed  # its fixture trains under ddp×2 too
def test_eval_refuses_and_export_writes_a_checkpoint_of_a_scripts_loop(uninterrupted, tmp_path, capsys):
    from multicard.cli.main import main

    last = str(uninterrupted[1] / "checkpoints" / "last.pt")
    assert main(["eval", "--checkpoint", last]) == 2
    assert "written by a script's own loop" in capsys.readouterr().err
    assert main(["export", "--checkpoint", last, "--out", str(tmp_path / "model.pt")]) == 0
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert_bitwise_equal(exported, final_params(uninterrupted[1]))


def test_run_of_a_missing_script_is_one_line(tmp_path, capsys):
    from multicard.cli.main import main

    assert main(["run", str(tmp_path / "nothing.py")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"multicard: error: script {tmp_path / 'nothing.py'} not found; give the path of a Python file "
        f"(multicard run my_train.py)"
    )
