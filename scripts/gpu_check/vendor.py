"""Unpack the vendored pure-Python wheels (scripts/gpu_check/wheels/) whose module this
interpreter cannot import into DEST, which gpu_check.sh puts on PYTHONPATH: nothing to fetch on a
GPU machine without a package index, and the machine's own packages are never shadowed.
A wheel's module is its distribution name (omegaconf-2.4.0-py3-none-any.whl: omegaconf).

    python scripts/gpu_check/vendor.py WHEELS_DIR DEST
"""

from __future__ import annotations

import importlib
import sys
import zipfile
from pathlib import Path


def importable(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def main() -> int:
    wheels, dest = Path(sys.argv[1]), Path(sys.argv[2])
    for wheel in sorted(wheels.glob("*.whl")):
        module = wheel.name.split("-")[0].lower()
        if not importable(module):
            zipfile.ZipFile(wheel).extractall(dest)
            print(f"gpu_check: {module} is not installed here: using {wheel.name} (vendored)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
