#!/usr/bin/env bash
# Fill a wheelhouse for scripts/gpu_check.sh on a GPU machine without internet: multicard's
# runtime dependencies and pytest, never torch or torchvision (the GPU machine's own are used).
#
#   bash scripts/gpu_wheels.sh [DIR]      # default: wheelhouse/ (git-ignored)
#
# Pure-Python wheels serve any interpreter. PyYAML ships compiled wheels only: one is fetched
# per Python version in PY_VERSIONS (default "3.10 3.11 3.12 3.13") for ARCH (default x86_64;
# aarch64 for Grace machines). WITH_NUMPY=1 adds numpy and pillow (tens of MB; the GPU
# machine's torchvision normally brings them).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-wheelhouse}
PY=${PYTHON:-python3}
PY_VERSIONS=${PY_VERSIONS:-3.10 3.11 3.12 3.13}
ARCH=${ARCH:-x86_64}
mkdir -p "$DIR"
get() { "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DIR" "$@"; }

get "omegaconf==2.3.*" "rich>=13" "markdown-it-py>=2.2" mdurl "pygments>=2.13" \
    "pytest>=8" pluggy iniconfig packaging exceptiongroup
# pytest's tomli (Python < 3.11 only) also comes compiled: ask for the pure wheel.
get --python-version 3.10 --implementation py --abi none --platform any tomli
# omegaconf pins antlr4-python3-runtime 4.9.*, published as source only: build its (pure) wheel.
"$PY" -m pip wheel --quiet --no-deps --wheel-dir "$DIR" "antlr4-python3-runtime==4.9.*"
for version in $PY_VERSIONS; do
    get --python-version "$version" --platform "manylinux2014_$ARCH" "PyYAML>=5.1"
    if [[ ${WITH_NUMPY:-0} == 1 ]]; then
        get --python-version "$version" --platform "manylinux2014_$ARCH" "numpy>=1.24" "pillow>=9"
    fi
done
ls -1 "$DIR"
du -sh "$DIR"
