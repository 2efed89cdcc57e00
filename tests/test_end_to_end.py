"""The three ways to start a job each learn the embedded dataset to >= 90% validation top-1."""

import json

import pytest

from conftest import LEARN, cli, load_checkpoint, requires_2_gpus, torchrun
from multicard.strategy.models import build_model

pytestmark = pytest.mark.slow


def _check_run(out_dir, world_size):
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["kind"] == "epoch"]
    steps = [r for r in records if r["kind"] == "step"]
    assert len(epochs) == 10 and steps
    last = epochs[-1]
    for key in ("epoch", "train_loss", "train_top1", "val_loss", "val_top1", "val_top5", "img_per_s", "epoch_s"):
        assert isinstance(last[key], (int, float)), key
    assert len(last["peak_mem_mb"]) == world_size and min(last["peak_mem_mb"]) > 0
    assert last["val_top1"] >= 90.0, last
    assert (out_dir / "config.yaml").read_text().count("global_batch_size: 128") == 1

    for name in ("last.pt", "best.pt"):
        state = load_checkpoint(out_dir / "checkpoints" / name)
        assert not any(k.startswith("module.") for k in state["model"])
        assert {"model", "optimizer", "epoch", "config"} <= state.keys()
        bare = build_model(state["config"]["model"]["name"], 10)
        bare.load_state_dict(state["model"])  # strict: every key matches a bare model
    return last


def test_single_process(tmp_path):
    result = cli("train", *LEARN, f"out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    last = _check_run(tmp_path, world_size=1)
    assert f"top-1 {last['val_top1']:.2f}%" in result.stdout


@pytest.mark.distributed
def test_builtin_launcher_two_processes(tmp_path):
    scratch = tmp_path / "tmp"  # the launcher's temporary files go here, and must be gone at the end
    scratch.mkdir()
    # torch's compile cache is torch's, not the launcher's: its folder is put elsewhere (torch creates
    # it under TMPDIR on its first optimizer, unless a parent process already chose one)
    env = {"TMPDIR": str(scratch), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    result = cli("train", "--nproc-per-node", "2", *LEARN, f"out_dir={tmp_path / 'run'}", env=env)
    assert result.returncode == 0, result.stderr
    _check_run(tmp_path / "run", world_size=2)
    assert "strategy=ddp world_size=2" in result.stdout
    assert not list(scratch.iterdir())


@pytest.mark.distributed
def test_torchrun_unchanged(tmp_path):
    args = ["--standalone", "--nproc-per-node", "2", "-m", "multicard", "train", *LEARN, f"out_dir={tmp_path}"]
    result = torchrun(*args)
    assert result.returncode == 0, result.stderr
    _check_run(tmp_path, world_size=2)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cuda_single(tmp_path, precision):
    result = cli("train", *LEARN, "devices=[0]", f"precision={precision}", f"out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    _check_run(tmp_path, world_size=1)


@requires_2_gpus
@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cuda_data_parallel(tmp_path, precision):
    result = cli("train", *LEARN, "strategy=dp", "devices=[0,1]", f"precision={precision}", f"out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    _check_run(tmp_path, world_size=2)


@requires_2_gpus
@pytest.mark.cuda
def test_cuda_ddp_nccl_sync_bn(tmp_path):
    result = cli("train", "--nproc-per-node", "2", *LEARN, "devices=[0,1]", "sync_bn=true", f"out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    _check_run(tmp_path, world_size=2)
