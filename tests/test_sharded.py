"""Sharded training — fsdp ZeRO-3 and ZeRO-2, HSDP, ZeRO-1 under ddp — and sharded checkpoints
that reshard on load (fsdp and ZeRO-1 resume each other's), with real processes (gloo on CPU) and
real signals. A damaged or unmarked step directory is skipped and named, a full disk during a
sharded save leaves no partial write, and options of one strategy under another are refused."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import (
    ROOT,
    TINY,
    alive,
    cli,
    copy_of,
    descendants,
    final_params,
    max_rel_diff,
    one_line,
    run_here,
    slowed,
    start,
    train_on_two_nodes,
    wait_for,
    worker_pid,
)
from multicard.base.config import load_config
from multicard.base.errors import UserError
from multicard.checkpoint import checkpoints_in, read_checkpoint
from multicard.cli.main import main
from multicard.strategy.topology import resolve

MODELS = {"PYTHONPATH": str(ROOT / "tests")}  # sharding_models.py
# float64, a model without BatchNorm whose shards are uneven at 2 and 3 ranks, 4 steps per epoch.
ODD = [
    "model.name=sharding_models:odd", "data.num_classes=5", "data.image_size=16", "data.train_size=96",
    "data.val_size=64", "train.global_batch_size=24", "precision=fp64", "sched.name=constant", "log_every=2",
]  # fmt: skip


def launch(nproc: int) -> list[str]:
    return ["--nproc-per-node", str(nproc), "--oversubscribe"] if nproc > 1 else []


def train(*args: str) -> str:
    """`multicard train ARGS` run by this process (conftest.run_here); its stdout and its workers'."""
    return run_here("train", *args, env=MODELS)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    train(*ODD, "train.max_steps=6", f"out_dir={out}")
    return final_params(out)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "nproc, options",
    [
        (2, ["strategy=fsdp"]),
        (2, ["strategy=fsdp", "fsdp.reshard_after_forward=false"]),
        (3, ["strategy=fsdp"]),
        (3, ["strategy=fsdp", "fsdp.reshard_after_forward=false"]),
        (2, ["strategy=ddp", "ddp.shard_optimizer=true"]),
    ],
    ids=["zero3x2", "zero2x2", "zero3x3", "zero2x3", "zero1x2"],
)
def test_sharded_training_equals_one_process(single, tmp_path, nproc, options):
    """Six steps with two micro-steps each (the first without communication): within 1e-10."""
    train(*launch(nproc), *ODD, *options, "train.max_steps=6", "train.grad_accum=2", f"out_dir={tmp_path}")
    assert max_rel_diff(final_params(tmp_path), single) < 1e-10


@pytest.mark.distributed
def test_hsdp_over_two_nodes_equals_one_process(single, tmp_path):
    """fsdp.replicate=nodes on two nodes (two launchers on this host): a 2-D mesh, same maths."""
    train_on_two_nodes(
        *ODD, "strategy=fsdp", "fsdp.replicate=nodes", "train.max_steps=6", f"out_dir={tmp_path}", env=MODELS
    )
    assert max_rel_diff(final_params(tmp_path), single) < 1e-10


@pytest.mark.distributed
def test_sharding_holds_half_the_state_per_rank(tmp_path):
    """A 20 M-parameter model with AdamW: bytes of parameters, gradients and optimizer state each
    rank holds (its tensors, shards counted as held) under fsdp×2 ≤ 0.55 × ddp×2."""
    result = cli(
        "bench", "--runners", "multicard", "--strategies", "ddp,fsdp", "--world-sizes", "2", "--warmup", "0",
        "--steps", "2", "--out", str(tmp_path), "model.name=sharding_models:wide", "model.kwargs.width=2048",
        "model.kwargs.depth=5", "data.image_size=16",
        "optim.name=adamw", "train.global_batch_size=2", "data.val_size=2", env=MODELS, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = {row["strategy"]: row for row in json.loads((tmp_path / "bench.json").read_text())}
    ddp, fsdp = (rows[s]["held_mib_per_rank"] for s in ("ddp", "fsdp"))
    assert sum(ddp[0].values()) > 18e6 * 4 * 4 / 2**20  # parameters + gradients + two AdamW moments
    ratio = max(sum(r.values()) for r in fsdp) / min(sum(r.values()) for r in ddp)
    assert ratio <= 0.55, (ddp, fsdp)


# ------------------------------------------------------------------ sharded checkpoints

# Two epochs of 20 steps, a checkpoint every 5 steps. The run a test stops has every step of rank 1
# made 150 ms longer (tests/faults), so the signal lands mid-run; the other runs go at full speed.
LONG = [*ODD, "data.train_size=480", "train.epochs=2", "checkpoint.every_steps=5", "strategy=fsdp"]
SLOW_MODELS = slowed(150, path=ROOT / "tests")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The out_dir of an uninterrupted fsdp×2 run."""
    out = tmp_path_factory.mktemp("uninterrupted")
    train(*launch(2), *LONG, f"out_dir={out}")
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("resume_with", [3, 1], ids=["fsdp3", "single"])
def test_stopped_fsdp2_run_resumes_under_another_layout_exactly(uninterrupted, tmp_path, resume_with):
    """SIGTERM mid-epoch under fsdp×2 (writing its checkpoints in the background), then the rest of
    the run under fsdp×3 or one process: the parameters end where an uninterrupted run's do."""
    launcher = start("train", *launch(2), *LONG, "checkpoint.async_save=true", f"out_dir={tmp_path}", env=SLOW_MODELS)
    wait_for(lambda: bool(checkpoints_in(tmp_path / "checkpoints")), what="the first sharded checkpoint")
    os.kill(launcher.pid, signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 143, err
    stopped = re.search(r"stopped by SIGTERM at step (\d+)", err)
    assert stopped and 5 <= int(stopped[1]) < 40  # mid-run
    layout = [*launch(3), "strategy=fsdp"] if resume_with == 3 else ["strategy=single"]
    output = train(*LONG, *layout, f"out_dir={tmp_path}")
    assert f"resumed from {tmp_path / 'checkpoints'}/step-{int(stopped[1]):09d}" in output
    assert max_rel_diff(final_params(tmp_path), final_params(uninterrupted)) < 1e-10
    if resume_with == 3:  # export, then eval in one process: the run's own final top-1 and loss
        exported = tmp_path / "model.pt"
        assert main(["export", "--checkpoint", str(tmp_path / "checkpoints" / "last"), "--out", str(exported)]) == 0
        evaluated = run_here("eval", "--checkpoint", str(tmp_path / "checkpoints" / "last"), "--json")
        final = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
        got = json.loads(evaluated.strip().splitlines()[-1])
        # The same sums over the same images; only their order differs (3 ranks' shards, then one).
        assert got["top1"] == final["val_top1"] and got["loss"] == pytest.approx(final["val_loss"], rel=1e-12)
        assert torch.load(exported, weights_only=True).keys() == final_params(tmp_path).keys()


@pytest.mark.distributed
def test_a_rank_killed_while_writing_leaves_the_previous_checkpoint(tmp_path):
    """SIGKILL of rank 1 while a sharded checkpoint is being written: the next run removes the
    unfinished directory, says so, and resumes from the last complete checkpoint."""
    big = ["model.name=sharding_models:wide", "model.kwargs.width=2048", "model.kwargs.depth=4", "optim.name=adamw",
           "data.image_size=16", "data.train_size=512", "train.global_batch_size=4", "strategy=fsdp",
           "checkpoint.every_steps=1", "log_every=1", "sched.name=constant"]  # fmt: skip
    launcher = start("train", *launch(2), *big, f"out_dir={tmp_path}", env=MODELS)
    folder = tmp_path / "checkpoints"
    try:
        wait_for(lambda: bool(checkpoints_in(folder)), what="a complete checkpoint")
        wait_for(lambda: bool(list(folder.glob(".step-*.incomplete"))), what="a checkpoint being written")
        os.kill(worker_pid(launcher.pid, 1), signal.SIGKILL)
        workers = descendants(launcher.pid)
        launcher.communicate(timeout=120)
        wait_for(lambda: not alive(workers), timeout=30, what="the workers to end")
    finally:
        launcher.kill()
    unfinished = [p.name for p in folder.glob(".step-*.incomplete")]
    complete = [p.name for p in checkpoints_in(folder)]
    assert unfinished and complete
    newest = max(int(name[len("step-") :]) for name in complete)
    output = train(*launch(2), *big, f"train.max_steps={newest + 1}", f"out_dir={tmp_path}")
    assert f"removed {unfinished[0]}: a run ended while writing that checkpoint" in output
    assert f"resumed from {folder}/step-{newest:09d}" in output


# ------------------------------------------------------------------ bad input


@pytest.mark.distributed
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ddp.comm_hook=fp16"], "ddp.comm_hook=fp16 compresses DDP's all-reduce; strategy=fsdp reduce-scatters"),
        (["ddp.static_graph=true"], "ddp.static_graph is a DDP option and has no effect under strategy=fsdp"),
        (["fsdp.units=[NoSuchBlock]"], "fsdp.units=['NoSuchBlock'] matches no module of model.name=smallcnn"),
        (["fsdp.replicate=nodes"], "fsdp.replicate=nodes (HSDP) replicates across nodes, but this job runs on one"),
    ],
    ids=["comm-hook", "ddp-option", "unit", "replicate"],
)
def test_fsdp_bad_input_is_one_line_before_any_worker_starts(tmp_path, capsys, overrides, message):
    args = ["train", "--nproc-per-node", "2", "strategy=fsdp", "model.name=smallcnn", f"out_dir={tmp_path}"]
    assert main([*args, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


@pytest.mark.distributed
def test_a_file_of_a_sharded_checkpoint_names_its_directory(uninterrupted, tmp_path, capsys):
    step = checkpoints_in(uninterrupted / "checkpoints")[0]
    shard = next(step.glob("__0_*.distcp"))
    assert main(["eval", "--checkpoint", str(shard)]) == 2
    assert f"is one file of the sharded checkpoint {step}; give the directory" in capsys.readouterr().err
    unfinished = tmp_path / ".step-000000005.incomplete"
    unfinished.mkdir()
    assert main(["export", "--checkpoint", str(unfinished), "--out", str(tmp_path / "m.pt")]) == 2
    assert "is incomplete (a run ended while writing it)" in capsys.readouterr().err


# float64 and no BatchNorm: one process and two give the same parameters (within 1e-10).
EXACT = [*TINY, "precision=fp64", "model.kwargs={norm: none}", "sched.name=constant", "checkpoint.every_steps=2"]


FSDP2 = ["--nproc-per-node", "2", "--oversubscribe", "strategy=fsdp"]


ZERO1 = [
    "--nproc-per-node", "2", "--oversubscribe", "strategy=ddp", "ddp.shard_optimizer=true", "checkpoint.format=file",
]  # fmt: skip


def step_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:09d}"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """The out_dir of an fsdp×2 run of 6 steps: sharded checkpoints at steps 2, 4 and 6."""
    out = tmp_path_factory.mktemp("sharded")
    train(*FSDP2, *EXACT, "train.max_steps=6", f"out_dir={out}")
    return out


@pytest.mark.distributed
def test_a_damaged_newest_sharded_checkpoint_is_skipped_once_and_named(sharded, tmp_path, capsys):
    out = copy_of(sharded, tmp_path)
    missing = step_dir(out, 6) / "__1_0.distcp"
    missing.unlink()
    output = train(*FSDP2, *EXACT, "train.max_steps=8", f"out_dir={out}")
    skipped = [line for line in output.splitlines() if "skipping damaged" in line]
    assert len(skipped) == 1 and f"({missing} is missing)" in skipped[0], output  # once, not per rank
    assert f"resumed from {step_dir(out, 4)}:" in output
    damaged = copy_of(sharded, tmp_path / "truncated")
    shard = step_dir(damaged, 6) / "__0_0.distcp"
    os.truncate(shard, 100)
    for command in (["export", "--out", str(tmp_path / "m.pt")], ["eval"]):
        assert main([command[0], "--checkpoint", str(damaged / "checkpoints" / "last"), *command[1:]]) == 2
        err = one_line(capsys.readouterr().err)
        assert f"cannot be read ({shard} has 100 of its" in err and "it is damaged" in err
    assert not (tmp_path / "m.pt").exists()


@pytest.mark.slow
def test_a_step_directory_without_its_marker_is_named_and_refused(sharded, tmp_path, capsys):
    out = copy_of(sharded, tmp_path)
    unmarked = step_dir(out, 6)
    (unmarked / "COMPLETE").unlink()
    for command in (["export", "--out", str(tmp_path / "m.pt")], ["eval"]):
        assert main([command[0], "--checkpoint", str(unmarked), *command[1:]]) == 2
        assert f"checkpoint {unmarked} is incomplete" in one_line(capsys.readouterr().err)
    assert main(["train", *EXACT, "train.max_steps=8", f"out_dir={out}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("warning:")] == [
        f"warning: skipping {unmarked}: it has no COMPLETE marker (a run ended while writing it, or it was copied "
        f"in part)"
    ]
    assert any(line.startswith(f"resumed from {step_dir(out, 4)}:") for line in lines)


@pytest.mark.distributed
def test_fsdp_and_zero1_resume_each_others_checkpoints_exactly(sharded, tmp_path):
    """fsdp×2 to step 6 (shards), ZeRO-1 to 8 (a file), fsdp×2 to 10: one process's parameters."""
    out = copy_of(sharded, tmp_path)
    assert f"resumed from {step_dir(out, 6)}:" in train(*ZERO1, *EXACT, "train.max_steps=8", f"out_dir={out}")
    back = train(*FSDP2, *EXACT, "train.max_steps=10", f"out_dir={out}")
    assert f"resumed from {out / 'checkpoints' / 'step-000000008.pt'}:" in back
    alone = tmp_path / "alone"
    assert main(["train", *EXACT, "train.max_steps=10", f"out_dir={alone}"]) == 0
    assert max_rel_diff(final_params(out), final_params(alone)) < 1e-10


@pytest.mark.distributed
@pytest.mark.parametrize("async_save", ["false", "true"])
def test_disk_full_during_a_sharded_save_removes_the_partial_write(tmp_path, async_save):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("needs to mount a small tmpfs (root)")
    try:
        out = disk / "out"
        # fp32 smallcnn: a checkpoint takes ~0.9 MB; the first fits, the second fills the disk.
        args = [*FSDP2, *TINY, "train.max_steps=6", "checkpoint.every_steps=2", f"checkpoint.async_save={async_save}"]
        result = cli("train", *args, f"out_dir={out}")
        assert result.returncode == 2, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("multicard: error")]
        assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr  # once, not per rank
        folder = out / "checkpoints"
        step = folder / "step-000000004"
        assert f"cannot write {step} (No space left on device); free space in {folder}" in errors[0]
        assert not list(folder.glob(".*"))  # the unfinished step directory is gone
        assert shutil.disk_usage(disk).free > 400_000  # and its bytes with it
        assert read_checkpoint(folder / "last")["step"] == 2  # the earlier checkpoint, intact
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.distributed
def test_zero1_and_node_copies_are_refused_where_they_cannot_work(tmp_path, capsys):
    cases = [
        (["strategy=single", "ddp.shard_optimizer=true"], "ZeRO-1) shards optimizer state over DDP ranks but"),
        (["strategy=ddp", "ddp.shard_optimizer=true", "checkpoint.format=sharded"], "gathers the whole optimizer"),
        (["checkpoint.format=sharded", "checkpoint.local_copy=true"], "checkpoint.local_copy=true keeps single-file"),
        (["data.image_size=224"], "synthetic images of 224 px take about"),
    ]
    for overrides, message in cases:
        assert main(["train", "model.name=smallcnn", "data.train_size=200000", f"out_dir={tmp_path}", *overrides]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (overrides, err)
    assert main(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "is a directory that holds no checkpoint" in capsys.readouterr().err  # out_dir is not a checkpoint


def test_fsdp_options_under_ddp_are_refused_like_ddp_options_under_fsdp(tmp_path, capsys):
    argv = ["train", *TINY, "strategy=ddp", "fsdp.reshard_after_forward=false", f"out_dir={tmp_path}"]
    assert main([*argv, "--nproc-per-node", "2"]) == 2  # the launcher refuses: no worker starts
    assert (
        "fsdp.reshard_after_forward is an FSDP option and has no effect under strategy=ddp; remove it, or use "
        "strategy=fsdp" in one_line(capsys.readouterr().err)
    )
    assert not list(tmp_path.iterdir())
    # Evaluation runs an fsdp checkpoint's config (its fsdp options included) under ddp: allowed.
    cfg = load_config(None, ["fsdp.units=[BasicBlock]", "fsdp.reshard_after_forward=false"])
    assert resolve(cfg, 2, 2, launched=True, training=False).strategy == "ddp"
    with pytest.raises(UserError, match=r"is an FSDP option and has no effect under strategy=ddp"):
        resolve(cfg, 2, 2, launched=True)


@pytest.mark.slow
def test_a_one_process_sharded_save_prints_no_torch_warning(tmp_path):
    done = cli("train", *TINY, "data.train_size=64", "checkpoint.format=sharded", f"out_dir={tmp_path}")
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr and "torch.distributed is disabled" not in done.stderr
    assert (tmp_path / "checkpoints" / "last" / "COMPLETE").exists()


@pytest.mark.distributed
@pytest.mark.parametrize("name, fused", [("adamw", True), ("sgd", False)])
def test_the_optimizer_step_on_shards_is_fused_where_torch_has_the_kernel(tmp_path, name, fused):
    """AdamW's fused kernel runs on sharded (DTensor) parameters, and updates them as the
    unfused loop does; SGD's has no sharding rule, so it runs unfused there."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from multicard.base.config import OptimConfig
    from multicard.strategy.optim import optimizer_recipe

    tdist.init_process_group("gloo", store=tdist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        after = {}
        for kernel in (fused, False):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
            fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
            optimizer = optimizer_recipe(model, OptimConfig(name=name, fused=kernel), global_batch=8).build()
            assert optimizer.param_groups[0].get("fused") is (True if kernel else None)
            for _ in range(3):
                model(torch.randn(4, 5, dtype=torch.float64)).square().sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            after[kernel] = [p.full_tensor() for p in model.parameters()]
        pairs = zip(after[fused], after[False], strict=True)
        assert max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs) < 1e-12
    finally:
        tdist.destroy_process_group()
