"""fsdp.cpu_release_memory=auto follows the process's memory limit, read from its real cgroup."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import clean_env
from multicard.base.config import load_config
from multicard.base.malloc import wants_release
from multicard.tools.plan import cgroup_cap

PROBE = (
    "import json; from multicard.base.malloc import wants_release; from multicard.base.host_memory import cgroup_limit;"
    "print(json.dumps([cgroup_limit(), wants_release('auto'), wants_release('false'), wants_release('TRUE')]))"
)


@pytest.mark.skipif(cgroup_cap.available() != "", reason=cgroup_cap.available() or "memory caps work")
@pytest.mark.parametrize("limit", [None, 3 * 2**30])
def test_auto_releases_memory_exactly_under_a_cgroup_limit(limit):
    with cgroup_cap.MemoryCap(limit) as cap:
        done = cap.run([sys.executable, "-c", PROBE], timeout=60, env=clean_env())
    assert done.returncode == 0, done.stderr
    seen, auto, off, on = json.loads(done.stdout)
    assert seen == limit and auto == (limit is not None)
    assert (off, on) == (False, True)  # an explicit choice holds either way


def test_the_setting_is_auto_by_default_and_yaml_booleans_still_work():
    assert load_config(None, []).fsdp.cpu_release_memory == "auto"
    setting = load_config(None, ["fsdp.cpu_release_memory=false"]).fsdp.cpu_release_memory
    assert wants_release(setting) is False and wants_release("true", capped=False) is True
    assert wants_release("auto", capped=True) is True and wants_release("auto", capped=False) is False
