"""Every bad input exits 2 with one line on stderr and no traceback."""

import pytest
import torch

from conftest import TINY, cli, one_line, unwritable
from multicard.cli.main import main

BAD_OVERRIDES = [
    (["nosuch.key=1"], "unknown key 'nosuch'"),
    (["train.epochs=many"], "train.epochs"),
    (["train.global_batch_size=30", "train.grad_accum=4"], "not divisible"),
    (["strategy=dp", "devices=cpu"], "strategy=dp needs CUDA GPUs"),
    (["devices=[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]"], "GPU"),
    (["model.name=nosuchnet"], "model.name=nosuchnet is unknown"),
    (["data.name=nosuchdata"], "data.name=nosuchdata"),
]


@pytest.mark.parametrize("overrides, fragment", BAD_OVERRIDES)
def test_bad_config_in_process(overrides, fragment, tmp_path, capsys):
    code = main(["train", *TINY, f"out_dir={tmp_path}", *overrides])
    err = capsys.readouterr().err
    assert code == 2
    assert fragment in err
    assert err.count("\n") == 1 and "Traceback" not in err


BAD_VALUES = [
    (["data.image_size=1"], "data.image_size=1 must be in [8, 4096]"),
    (["data.image_size=1000000"], "data.image_size=1000000 must be in [8, 4096]"),
    (["model.name=vit_b_16"], "model.name=vit_b_16 cannot take 16×16 images"),
    (["model.name=inception_v3"], "model.name=inception_v3 cannot take 16×16 images"),
    (["optim.momentum=-1"], "optim.momentum=-1.0 must be in [0, 1)"),
    (["optim.betas=[2,3]"], "optim.betas[0]=2.0 must be in [0, 1)"),
    (["seed=-1"], "seed=-1 must be >= 0"),
    (["model.kwargs.width=-1"], "model.name=smallcnn rejected model.kwargs={'width': -1}"),
    (["train.epochs=${oc.env:MULTICARD_UNSET}"], "Environment variable 'MULTICARD_UNSET' not found"),
    (["threads=100000"], "threads=100000 must be in [0, 256]"),
    (["optim.lr=nan"], "optim.lr=nan must be a finite number"),
]


@pytest.mark.parametrize("overrides, message", BAD_VALUES, ids=[o[0] for o, _ in BAD_VALUES])
def test_values_torch_rejects_are_one_line(tmp_path, capsys, overrides, message):
    assert main(["train", *TINY, f"out_dir={tmp_path}", *overrides]) == 2
    assert message in one_line(capsys.readouterr().err)


def test_launcher_checks_divisibility_by_processes_before_starting(tmp_path, capsys):
    code = main(["train", "--nproc-per-node", "2", *TINY, "train.global_batch_size=33", f"out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "2 process(es)" in err and err.count("\n") == 1


def test_nproc_with_single_strategy_is_refused(tmp_path, capsys):
    assert main(["train", "--nproc-per-node", "2", *TINY, "strategy=single", f"out_dir={tmp_path}"]) == 2
    assert "use strategy=ddp" in capsys.readouterr().err


def test_more_cpu_processes_than_cores_is_refused_unless_asked(tmp_path, capsys):
    assert main(["train", "--nproc-per-node", "64", *TINY, "train.global_batch_size=64", f"out_dir={tmp_path}"]) == 2
    err = one_line(capsys.readouterr().err)
    assert "--nproc-per-node 64 starts more CPU processes than the" in err and "--oversubscribe" in err


def test_unknown_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--nosuch-flag"])
    assert info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_unwritable_out_dir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main(["train", *TINY, f"out_dir={blocker}/run"]) == 2
    assert "choose a writable out_dir" in capsys.readouterr().err


def test_plan_bench_and_verify_refuse_an_output_folder_they_cannot_use_before_any_work(tmp_path, capsys):
    file = tmp_path / "a-file"
    file.write_text("in the way")
    locked = tmp_path / "locked"
    locked.mkdir()
    commands = {
        "plan": ["plan", "--gpu", "h100", "--out"],
        "bench": ["bench", "--world-sizes", "1", "--out"],
        "verify": ["verify", "--keep"],
    }
    for name, argv in commands.items():
        assert main([*argv, str(file)]) == 2, name
        assert f"{file} is a file; give a folder (the results are written inside it)" in one_line(
            capsys.readouterr().err
        )
    with unwritable(locked):
        assert main(["plan", "--gpu", "h100", "--out", str(locked / "plan")]) == 2
        assert "plan cannot be written (" in one_line(capsys.readouterr().err)
    assert not list(locked.iterdir())


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks the message on a machine without GPUs")
def test_real_process_exit_code_and_single_line(tmp_path):
    result = cli("train", *TINY, f"out_dir={tmp_path}", "strategy=dp", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "strategy=dp needs CUDA GPUs" in result.stderr
    assert not (tmp_path / "config.yaml").exists()


def test_eval_of_missing_checkpoint(tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path / "none.pt")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err


def test_run_of_a_folder_names_it_a_folder_and_runs_one_with_a_main(tmp_path, capsys):
    """Before: `script a dir not found` for a folder that is there."""
    folder = tmp_path / "a dir"
    folder.mkdir()
    assert main(["run", str(folder)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"multicard: error: script {folder} is a folder (without a __main__.py); give the path of a Python file "
        f"(multicard run my_train.py)"
    )
    (folder / "__main__.py").write_text("import sys\nprint('ran', sys.argv, sys.path[0])\n")  # as `python FOLDER`
    ran = cli("run", str(folder), "--steps", "3")
    assert ran.returncode == 0 and ran.stdout == f"ran [{str(folder)!r}, '--steps', '3'] {folder}\n", ran.stderr
