"""GPU options (torch.compile, cuDNN autotuning, autocast under DataParallel, SyncBatchNorm):
tested on the CPU wherever they mean something there, with CUDA twins skipped without a GPU."""

import json

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn

from conftest import LEARN, TINY, cli, load_checkpoint, max_rel_diff, requires_2_gpus, run_here
from multicard.assembly.process import start_process
from multicard.base.config import load_config
from multicard.base.errors import UserError
from multicard.runtime import process_group
from multicard.runtime.environment import ProcessEnv
from multicard.runtime.process_group import ProcessContext
from multicard.strategy import topology
from multicard.strategy.base import ModelSetup, Strategy
from multicard.strategy.data_parallel import DataParallelStrategy

# float64, no BatchNorm, 5 optimizer steps: DDP and single-process runs agree to rounding.
from multicard.strategy.ddp import DDPStrategy
from multicard.strategy.models import build_model
from multicard.strategy.precision import AutocastForward, Precision

PARITY = [*TINY, "precision=fp64", "model.kwargs={norm: none}", "train.max_steps=5", "data.val_size=64"]


def _cpu_context() -> ProcessContext:
    return ProcessContext(0, 0, 1, 1, torch.device("cpu"), distributed=False)


def _assert_bare_checkpoint(path) -> dict:
    state = load_checkpoint(path)
    assert not any(k.startswith(("_orig_mod.", "module.")) or "._orig_mod." in k for k in state["model"])
    bare = build_model(state["config"]["model"]["name"], 10, state["config"]["model"]["kwargs"])
    bare.load_state_dict(state["model"])  # strict: every key matches an uncompiled, unwrapped model
    return state


class Probe(nn.Module):
    """Records, per call, whether torch.compile traced it and the dtype and device of a matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.calls: list[tuple[bool, torch.dtype, torch.device]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.calls.append((torch.compiler.is_compiling(), out.dtype, out.device))
        return out


# ------------------------------------------------------------------ config and topology


def test_compile_mode_is_checked():
    with pytest.raises(UserError, match="compile_mode=fast is not one of default, reduce-overhead"):
        load_config(None, ["compile_mode=fast"])
    cfg = load_config(None, ["compile=true", "compile_mode=max-autotune", "cudnn_benchmark=true"])
    assert cfg.compile and cfg.compile_mode == "max-autotune" and cfg.cudnn_benchmark


def test_compile_with_dataparallel_over_several_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(process_group, "cuda_count", lambda: 2)
    cfg = load_config(None, ["strategy=dp", "compile=true", "train.global_batch_size=64"])
    with pytest.raises(UserError, match="compile=true is not supported by strategy=dp over 2 GPUs; use strategy=ddp"):
        topology.resolve(cfg, 1, 1, launched=False)
    one_gpu = load_config(None, ["strategy=dp", "compile=true", "devices=[0]"])
    assert topology.resolve(one_gpu, 1, 1, launched=False).gpus == [0]  # one GPU: DataParallel makes no replicas


@pytest.mark.parametrize("enabled", [True, False])
def test_cudnn_benchmark_follows_the_config(enabled):
    before, threads = torch.backends.cudnn.benchmark, torch.get_num_threads()
    torch.backends.cudnn.benchmark = not enabled
    try:
        cfg = load_config(None, ["devices=cpu", f"cudnn_benchmark={str(enabled).lower()}"])
        start_process(cfg, ProcessEnv("none"), topology.resolve(cfg, 1, 1, launched=False))
        assert torch.backends.cudnn.benchmark is enabled
    finally:
        torch.backends.cudnn.benchmark = before
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ compile on the CPU


def test_unwrap_sees_through_torch_compile_and_every_wrapper():
    model = nn.Linear(4, 2)
    wrapped = nn.DataParallel(AutocastForward(torch.compile(model), Precision("bf16", "cpu")))
    assert Strategy.unwrap(wrapped) is model
    assert list(Strategy.unwrap(wrapped).state_dict()) == ["weight", "bias"]


def test_prepare_compiles_the_bare_model_in_place():
    probe = Probe()
    prepared = Strategy(_cpu_context(), Precision("bf16", "cpu"), ModelSetup(compile_mode="default")).prepare(probe)
    assert Strategy.unwrap(prepared) is probe and list(probe.state_dict()) == ["linear.weight", "linear.bias"]
    with torch.no_grad():
        prepared(torch.randn(3, 4))
    compiled, dtype, _ = probe.calls[-1]
    assert compiled and dtype == torch.bfloat16  # traced by torch.compile, under our autocast


def test_prepare_without_compile_runs_eagerly():
    """The check above can fail: the same probe reports eager calls."""
    probe = Probe()
    prepared = Strategy(_cpu_context(), Precision("fp32", "cpu"), ModelSetup()).prepare(probe)
    prepared(torch.randn(3, 4))
    assert probe.calls == [(False, torch.float32, torch.device("cpu"))]


@pytest.fixture(scope="module")
def compiled_ddp2(tmp_path_factory):
    """The out_dir of a compiled DDP×2 run (float64). Compiling is most of a test's time on the
    CPU, so the two tests below share this run."""
    out = tmp_path_factory.mktemp("compiled")
    run_here("train", "--nproc-per-node", "2", *PARITY, "compile=true", f"out_dir={out}")
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_compiled_training_checkpoints_the_bare_model(compiled_ddp2):
    state = _assert_bare_checkpoint(compiled_ddp2 / "checkpoints" / "last.pt")
    assert state["step"] == 5 and state["config"]["compile"] is True
    evaluated = cli("eval", "--checkpoint", str(compiled_ddp2 / "checkpoints" / "last.pt"), "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    eager_top1 = json.loads(evaluated.stdout.strip().splitlines()[-1])["top1"]
    assert abs(eager_top1 - state["val"]["top1"]) < 100 / 64  # eager eval of it: at most one of 64 flips


@pytest.mark.slow
@pytest.mark.distributed
def test_compiled_ddp2_trains_like_eager_single_process(compiled_ddp2, tmp_path):
    """DDP around a compiled model still all-reduces every gradient: compiled DDP×2 ends where an
    eager single process does (float64; only kernel rounding differs)."""
    run_here("train", *PARITY, f"out_dir={tmp_path}")
    compiled = _assert_bare_checkpoint(compiled_ddp2 / "checkpoints" / "last.pt")["model"]
    assert max_rel_diff(compiled, load_checkpoint(tmp_path / "checkpoints" / "last.pt")["model"]) < 1e-9


# ------------------------------------------------------------------ CUDA twins


@pytest.mark.cuda
def test_cuda_fp16_autocast_runs_in_every_dataparallel_replica():
    gpus = list(range(torch.cuda.device_count()))
    ctx = ProcessContext(0, 0, 1, 1, torch.device("cuda", 0), distributed=False)
    probe = Probe()
    model = DataParallelStrategy(ctx, Precision("fp16", "cuda"), ModelSetup(), gpus).prepare(probe)
    model(torch.randn(4 * len(gpus), 4, device="cuda"))
    assert sorted(device.index for _, _, device in probe.calls) == gpus  # one call per replica
    assert {dtype for _, dtype, _ in probe.calls} == {torch.float16}


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_cuda_fp16_with_grad_scaler_learns(tmp_path, strategy):
    result = cli("train", *LEARN, f"strategy={strategy}", "devices=[0]", "precision=fp16", f"out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    epochs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in epochs if r["kind"] == "epoch"][-1]
    assert last["val_top1"] >= 90 and last["peak_mem_mb"][0] > 0, last
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["scaler"]["scale"] > 0


@pytest.mark.cuda
def test_cuda_compiled_bf16_channels_last_training(tmp_path):
    args = ["compile=true", "precision=bf16", "model.channels_last=true", "cudnn_benchmark=true", "devices=[0]"]
    result = cli("train", *TINY, *args, "train.max_steps=8", f"out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    state = _assert_bare_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert state["step"] == 8


@pytest.mark.cuda
def test_cuda_ddp_converts_batchnorm_to_syncbatchnorm(tmp_path):
    tdist.init_process_group("nccl", store=tdist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ctx = ProcessContext(0, 0, 1, 1, torch.device("cuda", 0), distributed=True)
        model = build_model("smallcnn", 10)
        options = load_config(None, []).ddp
        wrapped = DDPStrategy(ctx, Precision("bf16", "cuda"), ModelSetup(), options, sync_bn=True).prepare(model)
        assert any(isinstance(m, nn.SyncBatchNorm) for m in Strategy.unwrap(wrapped).modules())
        wrapped(torch.randn(8, 3, 16, 16, device="cuda")).float().sum().backward()
    finally:
        tdist.destroy_process_group()


@requires_2_gpus
@pytest.mark.cuda
def test_cuda_ddp2_sync_bn_equals_single_gpu(tmp_path):
    with_bn = [arg for arg in PARITY if not arg.startswith("model.kwargs")]
    single, synced = tmp_path / "single", tmp_path / "synced"
    assert cli("train", *with_bn, "devices=[0]", f"out_dir={single}").returncode == 0
    result = cli("train", "--nproc-per-node", "2", *with_bn, "devices=[0,1]", "sync_bn=true", f"out_dir={synced}")
    assert result.returncode == 0, result.stderr
    a, b = (load_checkpoint(d / "checkpoints" / "last.pt")["model"] for d in (synced, single))
    assert max_rel_diff(a, b) < 1e-9
