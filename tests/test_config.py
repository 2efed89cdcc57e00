import dataclasses

import pytest

from multicard.base.config import load_config, parse_devices
from multicard.base.errors import UserError
from multicard.cli.main import parse


def test_defaults_are_valid_and_read_only():
    cfg = load_config()
    assert cfg.strategy == "auto" and cfg.train.global_batch_size == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3  # type: ignore[misc]


def test_cli_overrides_beat_yaml_which_beats_defaults(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  epochs: 7\n  global_batch_size: 64\noptim:\n  lr: 0.5\n")
    cfg = load_config(str(f), ["train.epochs=3", "devices=[0,1]"])
    assert cfg.train.epochs == 3  # override wins
    assert cfg.train.global_batch_size == 64  # yaml wins over default
    assert cfg.optim.lr == 0.5
    assert cfg.optim.momentum == 0.9  # default kept
    assert list(cfg.devices) == [0, 1]


def test_overrides_between_flags_are_accepted():
    args = parse(["train", "--config", "f.yaml", "--nproc-per-node", "2", "out_dir=X", "--max-restarts", "1", "a=b"])
    assert args.overrides == ["out_dir=X", "a=b"] and args.nproc_per_node == 2 and args.max_restarts == 1


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("nosuch=1", "unknown key 'nosuch'"),
        ("train.nosuch=1", "unknown key 'train.nosuch'"),
        ("train.epochs=abc", "train.epochs"),
        ("strategy=zero", "strategy=zero is not one of"),
        ("precision=fp8", "precision=fp8"),
        ("optim.name=lamb", "optim.name=lamb"),
        ("sched.name=poly", "sched.name=poly"),
        ("train.global_batch_size=0", "train.global_batch_size=0 must be > 0"),
        ("devices=gpu", "devices=gpu must be auto, cpu"),
        ("devices=[0,0]", "lists a GPU twice"),
        ("train.epochs", "is not KEY=VALUE"),
        ("fsdp.reshard_after_forward=maybe", "fsdp.reshard_after_forward: Value 'maybe' is not a valid bool"),
        ("fsdp.cpu_release_memory=maybe", "fsdp.cpu_release_memory=maybe is not one of auto, true, false"),
    ],
)
def test_bad_values_are_one_line_user_errors(override, fragment):
    with pytest.raises(UserError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_global_batch_must_divide_by_accumulation():
    with pytest.raises(UserError, match="not divisible by train.grad_accum=3"):
        load_config(None, ["train.global_batch_size=64", "train.grad_accum=3"])


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(UserError, match="bad config file"):
        load_config(str(bad))


def test_home_directory_config_dir_and_yaml_line_numbers(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_config(None, ["out_dir=~/runs/x"]).out_dir == f"{tmp_path}/runs/x"
    with pytest.raises(UserError, match=r"--config .* is a directory; pass a YAML file"):
        load_config(str(tmp_path))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: 3\n   bad: [1,\n")
    with pytest.raises(UserError, match=r"bad config file .*bad.yaml: line 3, column 7: mapping values are not"):
        load_config(str(bad))


def test_parse_devices():
    assert parse_devices("cpu") is None
    assert parse_devices("auto") == []
    assert parse_devices(1) == [1]
    assert parse_devices([2, 0]) == [2, 0]


def test_a_url_for_a_path_is_one_line_and_makes_no_local_folder(tmp_path, monkeypatch, capsys):
    """s3://bucket/x as out_dir, data.root or verify --keep was a folder named `s3:` here; a
    pack's data.root may be a URL, and checkpoint.dir, train.resume, model.weights, eval --checkpoint,
    export and pack --out (tests/test_object_storage.py, test_checkpoint_storage.py, test_pack_storage.py)."""
    from multicard.cli.main import main

    monkeypatch.chdir(tmp_path)
    for args in (["train", "out_dir=s3://bucket/run"], ["train", "data.name=imagefolder", "data.root=gs://b/pack"],
                 ["verify", "--keep", "s3://bucket/x"], ["train", "data.val_root=az://c/val"]):  # fmt: skip
        assert main(args) == 2
        line = capsys.readouterr().err.strip()
        assert "://" in line and "is a URL" in line and "\n" not in line, line
    assert list(tmp_path.iterdir()) == []
