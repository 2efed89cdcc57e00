#!/usr/bin/env bash
# The GPU check, in one command (under 8 minutes on one H100/H200-class GPU):
#   (a) the CUDA-marked tests; (b) every GPU path trained briefly (scripts/gpu_check/matrix.py);
#   (c) single-GPU throughput and MFU of resnet18_cifar (scripts/gpu_check/throughput.py);
#   (d) GPU JPEG decode (scripts/gpu_check/gpu_decode.py); (e) `multicard plan`'s memory, step time
#   and largest micro-batch against real steps here (scripts/gpu_check/plan_check.py);
#   (f) OUT_DIR/summary.json and summary.md, and the table on stdout (scripts/gpu_check/summary.py).
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# It uses the torch already installed: PYTHON if set, else the first of python3 / python that
# imports torch. multicard runs from src/ (PYTHONPATH), not installed. Runtime dependencies the
# interpreter lacks are installed offline from wheelhouse/ (scripts/gpu_wheels.sh fills it;
# WHEELHOUSE=DIR to use another) into .gpu-deps/, beside the interpreter's own packages, never
# over them. Without CUDA every GPU step is reported as skipped, with the reason.
set -uo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: bash scripts/gpu_check.sh OUT_DIR" >&2
    exit 2
fi
mkdir -p "$1" && OUT=$(cd "$1" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
WHEELHOUSE=${WHEELHOUSE:-$ROOT/wheelhouse}
DEPS=$ROOT/.gpu-deps

PY=""
for candidate in ${PYTHON:-} python3 python; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then
        PY=$candidate
        break
    fi
done
if [[ -z $PY ]]; then
    echo "gpu_check: no python with torch found (set PYTHON=/path/to/python)" >&2
    exit 2
fi
export PYTHONPATH="$ROOT/src:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# Projects whose modules are missing, as pip names (--no-deps: each dependency is listed).
missing=$("$PY" - <<'EOF'
import importlib.util, sys
needs = [("omegaconf", "omegaconf"), ("antlr4", "antlr4-python3-runtime"), ("yaml", "PyYAML"),
         ("rich", "rich"), ("markdown_it", "markdown-it-py"), ("mdurl", "mdurl"), ("pygments", "pygments"),
         ("numpy", "numpy"), ("PIL", "pillow"), ("pytest", "pytest"), ("pluggy", "pluggy"),
         ("iniconfig", "iniconfig"), ("packaging", "packaging")]
if sys.version_info < (3, 11):
    needs += [("exceptiongroup", "exceptiongroup"), ("tomli", "tomli")]
print(" ".join(project for module, project in needs if importlib.util.find_spec(module) is None))
EOF
)
if [[ -n $missing ]]; then
    echo "gpu_check: installing $missing from $WHEELHOUSE into $DEPS"
    if ! "$PY" -m pip install --quiet --no-deps --no-index --find-links "$WHEELHOUSE" --target "$DEPS" $missing; then
        echo "gpu_check: could not install $missing (run scripts/gpu_wheels.sh where PyPI is reachable and bring wheelhouse/)" >&2
    fi
fi
"$PY" -c "import multicard.commands" || echo "gpu_check: multicard cannot be imported; the steps below will fail" >&2

# Each step: its exit code and seconds go to steps.json; a stuck step is stopped by timeout.
declare -A RC SECONDS_TAKEN
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    RC[$name]=$?
    SECONDS_TAKEN[$name]=$((SECONDS - start))
}

# Limits add up to 590 s; expected on one H200: about 8 minutes in all. The matrix starts no
# run after its budget and writes its JSON after every run, so a stopped matrix still reports.
step cuda_tests 130 "$PY" -m pytest -m cuda -q -p no:cacheprovider --junitxml="$OUT/cuda_tests.xml" tests
step matrix 240 "$PY" scripts/gpu_check/matrix.py --out "$OUT/matrix" --budget-s 190
step throughput 100 "$PY" scripts/gpu_check/throughput.py --out "$OUT/throughput" --timeout-s 90
step gpu_decode 90 "$PY" scripts/gpu_check/gpu_decode.py --out "$OUT/gpu_decode" --seconds 15
step plan_check 120 "$PY" scripts/gpu_check/plan_check.py --out "$OUT/plan_check" --budget-s 100

{
    echo "{"
    sep=""
    for name in cuda_tests matrix throughput gpu_decode plan_check; do
        printf '%s "%s": {"rc": %d, "seconds": %d}' "$sep" "$name" "${RC[$name]}" "${SECONDS_TAKEN[$name]}"
        sep=$',\n'
    done
    printf '\n}\n'
} >"$OUT/steps.json"

echo "== summary ($OUT/summary.json, $OUT/summary.md)"
"$PY" scripts/gpu_check/summary.py "$OUT"
