#!/usr/bin/env bash
# Refresh the wheels vendored for scripts/gpu_check.sh (scripts/gpu_check/wheels/, tracked in git):
# pure-Python wheels of the runtime dependencies a bare GPU image with torch lacks, which the
# check unpacks there only for modules its interpreter cannot import (no package index needed).
# Today that is omegaconf alone: 2.4 carries its own antlr4 runtime (omegaconf 2.3 needed
# antlr4-python3-runtime 4.9, published as source only).
#
#   bash scripts/gpu_wheels.sh      # where PyPI is reachable; commit the result
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=scripts/gpu_check/wheels
PY=${PYTHON:-python3}
rm -f "$DIR"/*.whl
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.10 --implementation py \
    --abi none --platform any --dest "$DIR" "omegaconf==2.4.*"
ls -l "$DIR"
