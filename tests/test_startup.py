"""A launcher starts in about torch's own import time: the training stack loads in the workers."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import clean_env

# Each costs a launcher (and `multicard --help`, `plan`) a fraction of a second to a second.
HEAVY = ("torchvision", "torch.distributed.checkpoint", "multicard.cli.commands", "multicard.strategy.factory",
         "multicard.strategy.ddp", "multicard.strategy.fsdp")


def test_the_command_line_loads_no_training_stack():
    probe = f"import json, sys, multicard.cli.main; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=clean_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
