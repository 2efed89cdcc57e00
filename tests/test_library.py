"""multicard.Run — a user's own loop, model, loss and task get every guarantee.

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
from typing import Any

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


def test_the_data_layers_loader_and_registered_components_are_one_line_when_misused(run):
    from multicard.base.config import load_config
    from multicard.data import build_data

    d = load_config(None, ["data.train_size=16", "data.val_size=8", "data.image_size=8"]).data
    data = build_data(d, 0, run.batch_split, run.context)  # multicard train's data, for this run
    try:
        with pytest.raises(UserError, match=r"run.loader\(data\): a multicard.data.Data with training data brings"):
            run.loader(data, num_workers=2)
        run.loader([torch.zeros(2)] * 8)
        with pytest.raises(UserError, match=r"run.loader\(data\): give the data layer's loader first"):
            run.loader(data)
    finally:
        data.close()
    with pytest.raises(UserError, match=r"run.register\('ema', \.\.\.\) takes an object with state_dict\(\)"):
        run.register("ema", object())
    with pytest.raises(UserError, match=r"run.register\('state', \.\.\.\): a checkpoint part of that name exists"):
        run.register("state", torch.nn.Linear(1, 1))
    model = torch.nn.Linear(2, 1)
    run.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in run.epochs(1):
        with pytest.raises(UserError, match=r"run.register\(...\) after run.epochs\(...\) started"):
            run.register("ema", torch.nn.Linear(1, 1))
        break


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


# ------------------------------------------------------------------ several models and optimizers, the bare model


def tiny_run(out: Path, **arguments) -> Any:
    """A Run of 4-sample global batches, a step record each step."""
    import multicard

    return multicard.Run(str(out), global_batch_size=4, log_every=1, **arguments)


def numbers(count: int = 16) -> list[torch.Tensor]:
    return [torch.tensor([float(i), 1.0]) for i in range(count)]


def test_two_models_step_per_global_batch_and_checkpoint_both_optimizers(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gan.py"])
    run = tiny_run(tmp_path, checkpoint_every=1, keep_last=10)
    g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    g, opt_g = run.setup(g, torch.optim.Adam(g.parameters(), lr=0.01))
    d, opt_d = run.setup(d, torch.optim.Adam(d.parameters(), lr=0.01))
    sched_d = torch.optim.lr_scheduler.StepLR(opt_d, step_size=1, gamma=0.5)
    train = run.loader(numbers())
    for _ in run.epochs(1):
        for x in train:
            run.backward(d(g(x).detach()).mean())
            assert run.step(opt_d, sched_d)
            with pytest.raises(UserError, match=r"run.step\(\) in a run of 2 optimizers: name the one to step"):
                run.step()
            run.backward(d(g(x)).mean())
            assert run.step(opt_g) and run.every(2) == (run.position.global_step % 2 == 0)
    assert run.position.global_step == 4  # one step per global batch, whatever number of optimizers stepped
    run.close()
    first = load_checkpoint(tmp_path / "checkpoints" / "step-000000001.pt")  # after both updates of batch 1
    assert first["optimizer"]["state"]["weight"]["step"] == first["optimizers"]["1"]["state"]["weight"]["step"] == 1
    assert first["schedulers"]["1"]["last_epoch"] == 1 and set(first["models"]) == {"1"}


def test_an_optimizer_not_given_to_setup_is_refused_at_its_first_step(run):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    outside = torch.optim.SGD(model[0].parameters(), lr=0.1)  # built before setup, stepped by hand
    model, optimizer = run.setup(model, torch.optim.SGD(model[1].parameters(), lr=0.1))
    model(torch.ones(2)).sum().backward()
    with pytest.raises(UserError, match=r"an optimizer \(SGD\) over parameters of a model given to run.setup steps "):
        outside.step()
    teacher = run.setup(torch.nn.Linear(2, 2).requires_grad_(False))  # a frozen model: returned alone
    assert isinstance(teacher, torch.nn.Linear)
    with pytest.raises(UserError, match="steps outside the run"):
        torch.optim.SGD(teacher.parameters(), lr=0.1).step()
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1).step()  # an optimizer of other tensors is free


class WithMethods(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer, self.width = torch.nn.Linear(4, 4), 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def init_hidden(self, rows: int) -> torch.Tensor:
        return self.layer.weight.new_zeros(rows, self.width)

    def generate(self, x: torch.Tensor) -> torch.dtype:
        return self(x).dtype


def test_the_model_setup_returns_keeps_its_own_methods_under_bf16(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gpt.py"])
    run = tiny_run(tmp_path, precision="bf16")
    model, _ = run.setup(WithMethods(), None)
    assert model.generate(torch.ones(1, 4)) == torch.bfloat16  # under the run's autocast, as its forward
    assert model.init_hidden(3).dtype == torch.float32 and model.width == 4 and model.layer is run.unwrap(model).layer
    assert isinstance(run.unwrap(model), WithMethods) and not hasattr(model, "module")
    run.close()


# ------------------------------------------------------------------ every way out of the loop, run.state, extending


def test_break_ends_the_epoch_and_the_run_still_ends_after_its_epochs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["my_train.py"])
    run = tiny_run(tmp_path, grad_accum=2)
    model = torch.nn.Linear(2, 1)
    model, optimizer = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    train = run.loader(numbers())
    epochs = []
    for epoch in run.epochs(3):
        epochs.append(epoch)
        assert len(epochs) <= 3, "run.epochs went on past its epochs"
        for i, x in enumerate(train):
            assert run.micro_step == i % 2
            run.backward(model(x).mean())
            run.step(optimizer)
            if i == 3 - epoch % 2:  # epochs 0 and 2 leave after two whole steps, epoch 1 between micro-steps
                break
    assert epochs == [0, 1, 2] and run.position.global_step == 5 and run.position.epoch == 3
    assert "warning: epoch 1 ended in the middle of a global batch" in capsys.readouterr().out
    run.close()


def test_a_loader_iterated_twice_in_an_epoch_or_outside_the_loop_is_refused(run):
    model = torch.nn.Linear(2, 1)
    model, optimizer = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    train = run.loader(numbers(8))
    with pytest.raises(UserError, match=r"iterated outside `for epoch in run.epochs\(N\)`"):
        iter(train)
    for _ in run.epochs(2):
        for x in train:
            run.backward(model(x).mean())
            run.step(optimizer)
        with pytest.raises(UserError, match="a run.loader was iterated twice in epoch 0; iterate it once an epoch"):
            iter(train)
        break


def test_a_stop_signal_in_a_loop_that_breaks_is_honoured(tmp_path, monkeypatch):
    import multicard

    monkeypatch.setattr(sys, "argv", ["my_train.py"])
    run = tiny_run(tmp_path)
    model = torch.nn.Linear(2, 1)
    model, optimizer = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    train = run.loader(numbers())
    with pytest.raises(multicard.Stopped) as stopped:
        for epoch in run.epochs(1000):
            for x in train:
                run.backward(model(x).mean())
                run.step(optimizer)
                if epoch == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
                break
    assert not isinstance(stopped.value, KeyboardInterrupt) and stopped.value.step <= 2 + 9
    run.close()


class Numpy:
    def state_dict(self):
        return {"mean": __import__("numpy").zeros(2)}

    def load_state_dict(self, state):
        pass


class Lambda(Numpy):
    def state_dict(self):
        return {"f": lambda x: x}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (__import__("numpy").float64(1.5), r"run.state\['v'\] = float64: a checkpoint holds .*; convert numpy values"),
        ([1, __import__("numpy").int64(2)], r"= list: it holds numpy.int64 at \[1\]"),
        (__import__("collections").namedtuple("Point", "x y")(1, 2), r"= Point: .*store a namedtuple as a tuple"),
        (Numpy(), r"= Numpy: its state_dict\(\) holds numpy.ndarray at \['mean'\]"),
        (Lambda(), r"= Lambda: its state_dict\(\) holds builtins.function at \['f'\]"),
        ({"k": object()}, r"= dict: it holds builtins.object at \['k'\]"),
    ],
)
def test_run_state_refuses_at_assignment_what_the_checkpoint_reader_cannot_read_back(run, value, says):
    with pytest.raises(UserError, match=says):
        run.state["v"] = value
    assert "v" not in run.state


def train_counting(out: Path, epochs: int, stop_at: int = 0) -> tuple[dict, float, dict]:
    """A loop that puts a LambdaLR and a per-epoch counter into run.state inside the epoch loop;
    SIGTERM to itself after step `stop_at` (the stop comes at the next agreement on it)."""
    import multicard

    run = tiny_run(out)
    model = torch.nn.Linear(2, 1)
    model, optimizer = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    train = run.loader(numbers())
    try:
        for _ in run.epochs(epochs):
            run.state["seen"] = 0  # reset at each epoch's start
            if "sched" not in run.state:
                run.state["sched"] = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 0.5**e)
            for x in train:
                run.backward(model(x).mean())
                run.step(optimizer)
                run.state["seen"] += len(x)
                if run.position.global_step == stop_at:
                    os.kill(os.getpid(), signal.SIGTERM)
            run.state["sched"].step()
            run.log(seen=run.state["seen"])
    except multicard.Stopped as stopped:
        assert stopped.step % 4 != 0  # in the middle of an epoch
    lr, weights = optimizer.param_groups[0]["lr"], dict(run.unwrap(model).state_dict())
    result = dict(run.state["sched"].state_dict()), lr, weights
    run.close()
    return result


def test_state_set_inside_the_loop_resumes_mid_epoch_and_a_run_can_be_extended(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["my_train.py"])
    whole = train_counting(tmp_path / "whole", 3)
    train_counting(tmp_path / "cut", 3, stop_at=6)  # stops in the middle of an epoch (4 steps an epoch)
    resumed = train_counting(tmp_path / "cut", 3)
    assert resumed[0]["last_epoch"] == whole[0]["last_epoch"] == 3 and resumed[1] == whole[1] == 0.0125
    assert_bitwise_equal(resumed[2], whole[2])
    records = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["seen"] for r in records if r["kind"] == "epoch"][-2:] == [16, 16]  # the replayed reset kept its count
    train_counting(tmp_path / "short", 1)  # then longer: the same run, extended
    extended = train_counting(tmp_path / "short", 3)
    assert extended[1] == whole[1] and max_rel_diff(extended[2], whole[2]) == 0


def test_values_logged_after_an_epochs_last_step_are_in_its_epoch_record_only(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["my_train.py"])
    run = tiny_run(tmp_path, best="val", best_mode="min")
    model = torch.nn.Linear(2, 1)
    model, optimizer = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    train = run.loader(numbers())
    for epoch in run.epochs(2):
        for x in train:
            run.backward(model(x).mean())
            run.step(optimizer)
            run.log(loss=1.0)
        run.log(val=float(1 - epoch))
    weights = {k: v.clone() for k, v in run.unwrap(model).state_dict().items()}
    run.load_weights(model, "best")  # epoch 1 logged the lower val
    assert_bitwise_equal(run.unwrap(model).state_dict(), weights)
    run.load_weights(model, str(tmp_path / "checkpoints" / "step-000000004.pt"))
    assert not torch.equal(run.unwrap(model).weight, weights["weight"])
    run.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    with_val = [r for r in records if "val" in r]
    assert [r["step"] for r in with_val] == [4, 8] and all(r["kind"] == "epoch" for r in with_val)
    assert all("loss" in r for r in records if r["kind"] == "step")  # values logged after run.step: that step's


# ------------------------------------------------------------------ processes: unused parameters, a late stop

AFTER_TRAINING = '''
import sys, time
from pathlib import Path
import torch, multicard

out, strategy = sys.argv[1], sys.argv[2]


class Partly(torch.nn.Module):
    def __init__(self, unused):
        super().__init__()
        self.used = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        self.unused = torch.nn.Linear(1, 1) if unused else None  # trained, and never in the forward

    def forward(self, x):
        return self.used(x)


run = multicard.Run(out, global_batch_size=4, strategy=strategy, precision="fp64")
model = Partly(unused=strategy == "ddp")
model, optimizer = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
train = run.loader([torch.ones(2) * i for i in range(8)])
for epoch in run.epochs(1):
    for x in train:
        run.backward(model(x).mean())
        run.step(optimizer)
scores = run.evaluate(model, [torch.ones(2)], lambda m, x: {"value": m(x)})
run.print(f"samples {scores.samples} value {scores['value']:.6f}")
Path(out, "trained").touch()
time.sleep(60)  # what a script may do after training (a stop signal comes meanwhile)
'''


def test_a_stop_signal_after_the_last_step_ends_the_script_with_one_line_and_exit_0(tmp_path):
    script_path = tmp_path / "after.py"
    script_path.write_text(AFTER_TRAINING)
    out = tmp_path / "run"
    proc = script(script_path, str(out), "single")
    wait_for(lambda: (out / "trained").exists(), what="the end of training")
    os.killpg(proc.pid, signal.SIGTERM)
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err  # all was done: nothing to resume
    assert "samples 1 value" in stdout
    assert err.strip().splitlines()[-1] == (
        "multicard: SIGTERM after the last step: training is complete, its checkpoints are written"
    )


@pytest.mark.distributed
def test_parameters_the_loss_does_not_reach_under_ddp_are_one_line_naming_the_option(tmp_path):
    script_path = tmp_path / "unused.py"
    script_path.write_text(AFTER_TRAINING)
    proc = script(script_path, str(tmp_path / "run"), "ddp", launch=("--nproc-per-node", "2"))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().splitlines()[-1] == (
        "multicard: error: 2 parameter(s) got no gradient in this backward under ddp (e.g. unused.weight), so DDP "
        "would wait for them forever; set options={'ddp.find_unused_parameters': True} (config "
        "ddp.find_unused_parameters=true), or freeze them (requires_grad=False) before run.setup"
    )


def test_misuses_of_several_models_streams_steps_and_weights_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["my_train.py"])
    run = tiny_run(tmp_path / "one")
    model = torch.nn.Linear(2, 1)
    model, optimizer = run.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    teacher = run.setup(torch.nn.Linear(2, 2).requires_grad_(False))
    train = run.loader(numbers(8))
    for _ in run.epochs(1):
        for x in train:
            run.backward(model(x).mean())
            with pytest.raises(UserError, match="ReduceLROnPlateau steps on a metric: call scheduler.step"):
                run.step(optimizer, torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer))
            with pytest.raises(UserError, match="loader.carry.* keeps the state of streams: create the loader"):
                train.carry(torch.zeros(1, 4), dim=1)
            run.step(optimizer)
    with pytest.raises(UserError, match=r"run.load_weights\(model, ...\) loads the run's model"):
        run.load_weights(teacher, "last")
    run.close()
    again = tiny_run(tmp_path / "one", max_steps=2)  # the same out_dir: it holds 2 models, 1 optimizer
    model = torch.nn.Linear(2, 1)
    model, optimizer = again.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    again.loader(numbers(8))
    with pytest.raises(UserError, match=r"run.steps\(4\) with Run\(max_steps=2\): give the steps once"):
        again.steps(4)
    again.close()
    other = tiny_run(tmp_path / "one")
    model = torch.nn.Linear(2, 1)
    model, optimizer = other.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    streams = other.loader(numbers(8), order="streams")
    with pytest.raises(UserError, match=r"the checkpoint holds 2 model\(s\) and 1 optimizer\(s\), this run set up 1"):
        other.epochs(2)
    with pytest.raises(UserError, match=r"loader.carry\(state, dim=1\) takes a tensor .* with 4 rows along dim 1"):
        streams.carry(torch.zeros(1, 3), dim=1)
    other.close()
