#!/usr/bin/env bash
# The GPU check, in one command, inside a global deadline (GPU_CHECK_BUDGET_S, default 480 s):
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# Steps, most valuable first (scripts/gpu_check/; docs/benchmarks.md has the time plan per step):
#   preflight   imports every module the steps use, prints the versions and the GPU (< 1 min)
#   throughput  one compiled single-GPU run of resnet18_cifar: img/s, MFU, loader share
#   proofs      fsdp×1 bf16 + sharded checkpoint resume + eval; SIGTERM-and-resume bitwise (fp32;
#               fp16 with the GradScaler state); multicard eval; compile_mode=reduce-overhead;
#               the workers loader on JPEGs with pinned memory; nvjpeg training (fails on fallback)
#   cuda_tests  the `cuda`-marked tests, from the test files that hold them
#   matrix      single / dp / ddp × fp32 / bf16 / fp16 (+ bf16 compiled), eager first
#   gpu_decode  nvjpeg against the workers' CPU decoding (fails if nvjpeg fell back to Pillow)
#   plan_check  `multicard plan` against measured memory and step time, and a largest-batch probe
# Each step runs for at most its own cap and the time left; the summary is rewritten after every
# step and once more at exit, whatever happens (trap). OUT_DIR receives three files only:
# summary.md, summary.json and logs.tar.gz (every step's log and JSON; no checkpoints). The work
# itself happens in a temporary folder (GPU_CHECK_WORK to choose it; removed at the end).
#
# Exit codes:
#   0  every step passed or was skipped (without CUDA: every CUDA step skipped, with the reason)
#   1  a step, test or row failed (see summary.md)
#   2  usage: no OUT_DIR, or no Python that imports torch (PYTHON=/path/to/python)
#   3  preflight: a module cannot be imported (the message names it), or it did not end within 60 s
#   4  preflight: REQUIRE_CUDA=1 and torch sees no CUDA device
#
# It uses the torch already installed (PYTHON, else python3 / python) and runs multicard from src/.
# Pure-Python wheels the machine lacks travel in the checkout (scripts/gpu_check/wheels/:
# omegaconf, whose antlr4 runtime is vendored inside it); they are unpacked into the work folder
# only for modules the interpreter cannot import (GPU_CHECK_WHEELS=DIR to use another folder).
set -uo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: bash scripts/gpu_check.sh OUT_DIR" >&2
    exit 2
fi
mkdir -p "$1" && OUT=$(cd "$1" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
BUDGET=${GPU_CHECK_BUDGET_S:-480}
DEADLINE=$((SECONDS + BUDGET))
RESERVE=20 # kept for a step's kill-after (10 s), the last summary and the archive
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/scripts/gpu_check/wheels}
WORK=${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
mkdir -p "$WORK/logs" || exit 2

PY=""
for candidate in ${PYTHON:-} python3 python; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then
        PY=$candidate
        break
    fi
done
if [[ -z $PY ]]; then
    echo "gpu_check: error: no python with torch found (set PYTHON=/path/to/python)" >&2
    exit 2
fi
export PYTHONPATH="$ROOT/src:$WORK/deps${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

summarise() {
    timeout 30 "$PY" scripts/gpu_check/summary.py "$WORK" "$OUT" "$@"
}

finish() {
    local rc=$?
    trap - EXIT INT TERM
    echo "== summary ($OUT/summary.md)"
    summarise --print
    local summary_rc=$?
    tar -czf "$OUT/logs.tar.gz" -C "$WORK" --exclude=checkpoints --exclude='*.pt' --exclude=deps \
        --exclude=photos --exclude=imagefolder --exclude=__pycache__ . 2>/dev/null
    [[ -z ${GPU_CHECK_WORK:-} ]] && rm -rf "$WORK"
    if ((rc == 0)); then
        rc=$summary_rc
    fi
    echo "gpu_check: exit $rc after $SECONDS s (budget $BUDGET s)"
    exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# record NAME STATUS SECONDS LIMIT REASON: one line of steps.jsonl
record() {
    local reason
    reason=$(printf '%s' "$5" | tr -d '"\\' | tr -c '[:print:]' ' ') # kept valid JSON
    printf '{"name": "%s", "status": "%s", "seconds": %d, "limit_s": %d, "reason": "%s"}\n' \
        "$1" "$2" "$3" "$4" "$reason" >>"$WORK/steps.jsonl"
}

# step NAME CAP SIGNAL CMD...: CMD for at most min(CAP, time left), stopped by SIGNAL (10 s later
# SIGKILL); its output goes to logs/NAME.log, its last lines (STEP_TAIL, default 3) to the console.
step() {
    local name=$1 cap=$2 signal=$3
    shift 3
    local left=$((DEADLINE - RESERVE - SECONDS))
    local limit=$((cap < left ? cap : left))
    if ((limit < 10)); then
        echo "== $name: skipped (time budget spent)"
        record "$name" skipped 0 0 "time budget spent"
        return
    fi
    echo "== $name (at most $limit s)"
    local start=$SECONDS rc status reason=""
    GPU_CHECK_DEADLINE=$(($(date +%s) + limit)) timeout --signal="$signal" --kill-after=10 "$limit" "$@" \
        >"$WORK/logs/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=passed ;;
        124 | 137) status="timed out" reason="stopped after $limit s" ;;
        *) status=failed reason="exit $rc: $(grep -v '^\s*$' "$WORK/logs/$name.log" | tail -n 1 | cut -c1-200)" ;;
    esac
    tail -n "${STEP_TAIL:-3}" "$WORK/logs/$name.log"
    echo "-- $name: $status in $((SECONDS - start)) s"
    record "$name" "$status" $((SECONDS - start)) "$limit" "$reason"
    summarise # after every step: a run cut short still reports
    return $rc
}

echo "== gpu_check: budget $BUDGET s, work in $WORK, results in $OUT"
"$PY" scripts/gpu_check/vendor.py "$WHEELS" "$WORK/deps"
STEP_TAIL=30 step preflight 60 TERM "$PY" scripts/gpu_check/preflight.py "$WORK/preflight/preflight.json"
rc=$?
if ((rc == 3 || rc == 4)); then
    exit "$rc"
fi
if ((rc != 0)); then
    exit 3 # the preflight itself did not finish: nothing after it would
fi

G=scripts/gpu_check
step throughput 120 TERM "$PY" $G/throughput.py --out "$WORK/throughput" --timeout-s 110
step proofs 170 TERM "$PY" $G/proofs.py --out "$WORK/proofs" --photos "$WORK/photos"
# SIGINT first: pytest then stops like Ctrl-C and still writes its JUnit XML.
mapfile -t cuda_files < <(grep -l "mark.cuda" tests/test_*.py)
step cuda_tests 100 INT "$PY" -m pytest -m cuda -q -p no:cacheprovider --junitxml="$WORK/cuda_tests.xml" "${cuda_files[@]}"
step matrix 75 TERM "$PY" $G/matrix.py --out "$WORK/matrix" --budget-s 55
step gpu_decode 45 TERM "$PY" $G/gpu_decode.py --out "$WORK/gpu_decode" --photos "$WORK/photos" --batch 64 --seconds 5
step plan_check 60 TERM "$PY" $G/plan_check.py --out "$WORK/plan_check" --budget-s 45
exit 0
