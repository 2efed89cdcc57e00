"""Real multi-process runs on CPU (gloo): parity with single-process training, exact eval."""

import json

import pytest
import torch

from conftest import (
    TINY,
    cli,
    final_params,
    load_checkpoint,
    max_rel_diff,
    requires_2_gpus,
    run_here,
    train_on_two_nodes,
)

pytestmark = pytest.mark.distributed

# float64, a model without BatchNorm, augmentation on (the default): 5 optimizer steps.
PARITY = [*TINY, "precision=fp64", "model.kwargs={norm: none}", "train.max_steps=5", "data.val_size=64"]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    run_here("train", *PARITY, f"out_dir={out}")
    return out


@pytest.mark.parametrize("accum", [1, 2])
def test_ddp2_equals_single_process_after_5_steps(single_run, tmp_path, accum):
    run_here("train", "--nproc-per-node", "2", *PARITY, f"train.grad_accum={accum}", f"out_dir={tmp_path}")
    single, ddp = final_params(single_run), final_params(tmp_path)
    assert final_params(single_run).keys() == ddp.keys()
    assert max_rel_diff(ddp, single) < 1e-10
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["step"] == 5


def _compressed_vs_exact(tmp_path, devices: str, hook: str) -> float:
    """Max relative parameter difference of a ddp×2 run with `hook` against exact all-reduce."""
    common = ["--nproc-per-node", "2", *PARITY, "precision=fp32", f"devices={devices}"]
    run_here("train", *common, f"ddp.comm_hook={hook}", "ddp.powersgd_start_step=2", f"out_dir={tmp_path / hook}")
    run_here("train", *common, f"out_dir={tmp_path / 'exact'}")
    compressed = final_params(tmp_path / hook)
    assert all(torch.isfinite(v).all() for v in compressed.values() if v.is_floating_point())
    return max_rel_diff(compressed, final_params(tmp_path / "exact"))


def test_gradient_compression_is_opt_in_and_changes_the_maths(tmp_path):
    """fp16 all-reduce trains (finite, close to exact) but not exactly: that is why it is opt-in."""
    assert 0 < _compressed_vs_exact(tmp_path, "cpu", "fp16") < 0.5


def test_powersgd_on_cpu_is_refused_in_one_line(tmp_path):
    result = cli("train", "--nproc-per-node", "2", *PARITY, "ddp.comm_hook=powersgd", f"out_dir={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "needs CUDA GPUs (NCCL)" in result.stderr


@requires_2_gpus
@pytest.mark.cuda
def test_cuda_powersgd_trains_close_to_exact(tmp_path):
    assert 0 < _compressed_vs_exact(tmp_path, "[0,1]", "powersgd") < 0.5


def test_ddp2_with_sync_bn_on_cpu_equals_single_process_with_batchnorm(tmp_path):
    """BatchNorm over the global batch: DDP×2 on gloo trains like one process on the whole batch."""
    with_bn = [arg for arg in PARITY if not arg.startswith("model.kwargs")]
    single = tmp_path / "single"
    run_here("train", *with_bn, f"out_dir={single}")
    synced = tmp_path / "synced"
    run_here("train", "--nproc-per-node", "2", *with_bn, "sync_bn=true", f"out_dir={synced}")
    assert max_rel_diff(final_params(synced), final_params(single)) < 1e-10  # running stats included
    per_rank = tmp_path / "per_rank"
    run_here("train", "--nproc-per-node", "2", *with_bn, f"out_dir={per_rank}")
    assert max_rel_diff(final_params(per_rank), final_params(single)) > 1e-6  # without it, BN differs


def test_parity_would_catch_a_different_data_order(single_run, tmp_path):
    """Same run with another seed for the data order differs: the check above can fail."""
    run_here("train", *PARITY, "train.grad_accum=2", "seed=1", f"out_dir={tmp_path}")
    assert max_rel_diff(final_params(tmp_path), final_params(single_run)) > 1e-6


def test_eval_is_exact_for_world_sizes_1_2_3(single_run):
    ckpt = str(single_run / "checkpoints" / "last.pt")
    results = []
    for nproc in (1, 2, 3):
        launch = ["--nproc-per-node", str(nproc), "--oversubscribe"] if nproc > 1 else []
        output = run_here("eval", "--checkpoint", ckpt, "--json", *launch, "data.val_size=1001")
        results.append(json.loads(output.strip().splitlines()[-1]))
    for r in results:
        assert r["samples"] == 1001  # 1001 divides by neither 2 nor 3: nothing padded or dropped
        assert r["top1"] == results[0]["top1"] and r["top5"] == results[0]["top5"]
        assert r["loss"] == pytest.approx(results[0]["loss"], rel=1e-12)


def test_two_nodes_on_loopback_equal_one_node(single_run, tmp_path):
    """--nnodes 2 with one process per node (two launchers on this host) trains like ddp×2."""
    out = tmp_path / "run"
    outputs = train_on_two_nodes(*PARITY, f"out_dir={out}")
    assert "world_size=2" in outputs[0][0]
    assert max_rel_diff(final_params(out), final_params(single_run)) < 1e-10


@requires_2_gpus
@pytest.mark.cuda
def test_cuda_ddp2_nccl_equals_single_gpu(tmp_path):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert cli("train", *PARITY, "devices=[0]", f"out_dir={single}").returncode == 0
    result = cli("train", "--nproc-per-node", "2", *PARITY, "devices=[0,1]", f"out_dir={ddp}")
    assert result.returncode == 0, result.stderr
    assert max_rel_diff(final_params(ddp), final_params(single)) < 1e-10
