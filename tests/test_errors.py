"""Errors: bad inputs from docs/errors.md not covered elsewhere, and ranks that fail (killed, stopped,
raising, entering a collective alone) — one line, a documented exit code, nothing lost (the last good
checkpoint stays loadable); and the catalogue itself: each row names a test that exists, each message
it quotes is still said by the code."""

from __future__ import annotations

import ast
import errno
import os
import re
import signal
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import RUNNING, TINY, cli, load_checkpoint, one_line, start, wait_for, worker_pid
from multicard.base.errors import UserError
from multicard.checkpoint import checkpoints_in, load_file
from multicard.cli.main import main
from multicard.runtime.launch import WORKER_VARIABLES

ROOT = Path(__file__).resolve().parents[1]


def test_wrong_data_path(tmp_path, capsys):
    code = main(["train", *TINY, "data.name=imagefolder", f"data.root={tmp_path}/nowhere", f"out_dir={tmp_path}/o"])
    assert code == 2
    assert "has no train/ directory; expected" in one_line(capsys.readouterr().err)


def test_checkpoint_of_another_model(tmp_path, capsys):
    assert main(["train", *TINY, "train.max_steps=2", f"out_dir={tmp_path}"]) == 0
    capsys.readouterr()
    ckpt = str(tmp_path / "checkpoints" / "last.pt")
    assert main(["eval", "--checkpoint", ckpt, "model.name=resnet18_cifar"]) == 2
    assert "does not fit this model" in one_line(capsys.readouterr().err)
    assert main(["train", *TINY, "model.name=resnet18_cifar", f"train.resume={ckpt}", f"out_dir={tmp_path}/b"]) == 2
    assert "other settings (model.name: smallcnn → resnet18_cifar)" in one_line(capsys.readouterr().err)


def test_disk_full_while_saving_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    args = ["train", *TINY, "checkpoint.every_steps=4", f"out_dir={tmp_path}"]
    real_save = torch.save
    calls = []

    def save_then_fill_the_disk(obj, f, *a, **kw):
        calls.append(1)
        if len(calls) < 3:
            return real_save(obj, f, *a, **kw)
        f.write(b"partial bytes")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", save_then_fill_the_disk)
    assert main(args) == 2
    err = one_line(capsys.readouterr().err)
    assert "cannot write" in err and "No space left on device" in err and "earlier checkpoints are intact" in err
    monkeypatch.undo()
    folder = tmp_path / "checkpoints"
    assert not list(folder.glob(".*"))  # the half-written temporary file is gone
    assert load_file(folder / "last.pt")["step"] == 8  # the second save, intact


def test_port_in_use(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["train", "--nproc-per-node", "2", "--master-port", str(port), *TINY, f"out_dir={tmp_path}"])
    assert code == 2
    assert f"--master-port {port} is in use" in one_line(capsys.readouterr().err)
    assert not set(WORKER_VARIABLES) & set(os.environ)  # a launcher leaves this process's environment as it was


@pytest.mark.distributed
def test_a_taken_rendezvous_port_is_never_a_strangers_store(monkeypatch):
    """One node hosts its own rendezvous store: a free port another process took meanwhile is
    tried again with another (never joined: torch's agent would use the stranger's store, and
    the job would die with it); one that stays taken is one line (here: the same port each try)."""
    from multicard.runtime import launch

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        tries = []
        monkeypatch.setattr(launch, "free_port", lambda: tries.append(1) or taken.getsockname()[1])
        with pytest.raises(UserError, match="this node cannot host its store there"):
            launch.launch_workers(launch.LaunchOptions(nproc_per_node=2), ["train"])
    assert len(tries) == 3
    assert not set(launch.WORKER_VARIABLES) & set(os.environ)  # its workers' variables went with it


class NanAfter(torch.nn.Module):
    """A user model whose output turns NaN after a number of training forwards."""

    def __init__(self, num_classes: int, after: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(num_classes))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        out = self.net(x)
        if self.training:
            self.calls += 1
            if self.calls > self.after:
                out = out * float("nan")
        return out


def nan_after(num_classes: int, after: int = 8) -> torch.nn.Module:
    model = NanAfter(num_classes, after)
    model.after = after
    model.eval()(torch.zeros(1, 3, 16, 16))  # materialise the lazy layer (not a training forward)
    return model.train()


@pytest.mark.distributed
def test_nan_loss_stops_every_rank_and_keeps_the_last_good_checkpoint(tmp_path):
    result = cli(
        "train", "--nproc-per-node", "2", *TINY, "model.name=test_errors:nan_after", "log_every=1",
        "checkpoint.every_steps=3", f"out_dir={tmp_path}",
        env={"PYTHONPATH": str(ROOT / "tests")},
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("multicard: error")]
    assert len(lines) == 2 and all("loss is NaN/inf at step 9; lower optim.lr" in line for line in lines)
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["step"] == 6


@pytest.mark.distributed
def test_exception_on_one_rank_ends_the_job_naming_the_rank(tmp_path):
    """A corrupt image read by one rank: the whole job ends promptly with that rank's message."""
    data = tmp_path / "data" / "train"
    for i in range(64):
        (data / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((8, 8, 3), i, dtype=np.uint8)).save(data / f"c{i % 2}" / f"{i:03d}.png")
    (data / "c1" / "013.png").write_bytes(b"broken")
    result = cli(
        "train", "--nproc-per-node", "2", "model.name=smallcnn", "data.name=imagefolder",
        f"data.root={tmp_path / 'data'}", "data.image_size=8", "data.loader=workers", "data.num_workers=0",
        "train.global_batch_size=8", "dist_timeout_s=60", f"out_dir={tmp_path / 'out'}",
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    line = one_line(result.stderr)  # the failing rank's line alone: its peer ends quietly
    assert re.search(r"multicard: error \(rank [01]\): cannot decode image .*013\.png", line)


@pytest.mark.distributed
def test_a_killed_worker_is_named_in_one_line_with_code_137(tmp_path):
    launcher = start("train", "--nproc-per-node", "2", *RUNNING, f"out_dir={tmp_path}")
    wait_for(lambda: bool(checkpoints_in(tmp_path / "checkpoints")), what="the first checkpoint")
    os.kill(worker_pid(launcher.pid, 1), signal.SIGKILL)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 137
    assert one_line(err) == "multicard: error: rank 1 was killed by SIGKILL (signal 9: out of memory?); exit code 137"


@pytest.mark.distributed
def test_a_collective_timeout_is_one_line_with_code_5(tmp_path):
    """Two ranks as torchrun would start them; rank 1 is stopped (SIGSTOP), so rank 0's next
    gradient all-reduce waits past dist_timeout_s: one line, exit 5, no traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [
        start("train", *RUNNING, "dist_timeout_s=5", f"out_dir={tmp_path}", env={
            "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        })  # fmt: skip
        for r in (0, 1)
    ]
    try:
        wait_for(lambda: bool(checkpoints_in(tmp_path / "checkpoints")), what="the first checkpoint")
        os.kill(ranks[1].pid, signal.SIGSTOP)
        _, err = ranks[0].communicate(timeout=60)
        assert ranks[0].returncode == 5, err
        assert "(rank 0): a collective waited longer than dist_timeout_s for another rank" in one_line(err)
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()


# A script's own loop (multicard.Run, 2 processes) in which only rank 0 enters a collective.
ONE_RANK_COLLECTIVE = """
import sys

import torch
import torch.distributed as dist

import multicard

run = multicard.Run(sys.argv[1], global_batch_size=4, devices="cpu")
if run.rank == 0:
    dist.all_reduce(torch.ones(3))
dist.all_reduce(torch.ones(1000))
"""


@pytest.mark.distributed
def test_a_collective_one_rank_alone_enters_is_named_as_the_likely_cause_with_code_134(tmp_path):
    """Before: gloo's C++ abort text alone, then `rank 0 was killed by SIGABRT`; 134 was undocumented."""
    script = tmp_path / "one_rank.py"
    script.write_text(ONE_RANK_COLLECTIVE)
    result = cli("run", "--nproc-per-node", "2", str(script), str(tmp_path / "run"), timeout=120)
    assert result.returncode == 134, result.stderr
    assert "Traceback" not in result.stderr
    assert re.fullmatch(
        r"multicard: error: rank [01] aborted in native code \(SIGABRT; exit code 134\), most often because the "
        r"ranks called different collectives \(a collective on one rank only, or with tensors of other sizes: "
        r"gloo's \"collective mismatch\" above\); call the same collectives in the same order on every rank "
        r"\(TORCH_DISTRIBUTED_DEBUG=DETAIL names the first that differs\)",
        result.stderr.strip().splitlines()[-1],
    ), result.stderr


def test_every_row_of_the_catalogue_names_an_existing_test():
    text = (ROOT / "docs" / "errors.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`tests/" in line]
    assert len(rows) >= 15
    for row in rows:
        path, name = re.search(r"`(tests/[\w/]+\.py)::(\w+)`", row).groups()
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), row


def _source_text() -> str:
    """Every string literal of the package, f-string holes as NUL, concatenated pieces joined."""
    texts = []
    for path in (ROOT / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                texts.append("".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append(node.value)
    return "\n".join(texts)


# What the catalogue writes where the code fills in a value: example values after '=', numbers,
# capitalised placeholders (X, N, HOST), exception names, quoted names, dotted config keys, paths,
# the ellipsis, and reasons in parentheses (ours wrap what the OS or a library said).
EXAMPLE = re.compile(
    r"--[\w-]+(?: [^\s;,()]+)?|=[^\s;,)]+|\b[A-Z][A-Z_0-9]*\b|\b\w*Error\b|\d+(?:\.\d+)?|…|'[^']*'"
    r"|\b[a-z_]+(?:\.[a-z_]+)+\b|\S*/\S*|\([^)]*\)"
)


# Library words inside our line: argparse's, omegaconf's reasons for a value of the wrong type, and
# Python's for arguments a function does not take.
EXTERNAL = ("unrecognized arguments", "could not be converted", "is not a valid bool", "got an unexpected keyword")


def test_every_message_in_the_catalogue_is_still_produced_by_the_code():
    """Each quoted message's fixed parts are in the code's strings: docs/errors.md cannot drift."""
    source = _source_text()
    rows = [line for line in (ROOT / "docs" / "errors.md").read_text().splitlines() if line.startswith("| ")]
    checked = 0
    for row in rows:
        message_column = row.split(" | ")[1]
        for quoted in re.findall(r"`([^`]+)`", message_column):
            message = re.sub(r"^multicard: (error[^:]*: )?", "", quoted)
            for fragment in EXAMPLE.split(message):
                fragment = fragment.strip(" ;,.:()[]")
                if len(fragment) >= 12 and not fragment.startswith(EXTERNAL):
                    assert fragment in source, f"docs/errors.md quotes {fragment!r}, which the code no longer says"
                    checked += 1
    assert checked >= 40
