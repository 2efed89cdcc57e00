#!/usr/bin/env bash
# The GPU check, in one command, inside a global deadline (GPU_CHECK_BUDGET_S, default 480 s):
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# Steps, most valuable first (scripts/gpu_check/; docs/gpu-check.md has the time plan per step):
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
# Exit codes (a step passes only on evidence: the result file it writes, never its exit code alone):
#   0  the check ran: at least one step after the preflight passed, and nothing failed
#   1  a step, test or row failed, or a step exited 0 without writing its result (see summary.md)
#   2  usage: no OUT_DIR, GPU_CHECK_BUDGET_S not whole seconds from 60 to 3600, an unknown step in
#      GPU_CHECK_STEPS, or no Python with torch installed (PYTHON=/path/to/python)
#   3  preflight: a module cannot be imported (the message names it), or it did not end within 60 s
#      or wrote no preflight.json
#   4  preflight: REQUIRE_CUDA=1 and torch sees no CUDA device
#   5  nothing was checked: every step after the preflight was skipped (no CUDA device, no pytest,
#      the time budget, GPU_CHECK_STEPS; summary.md says why). Without CUDA this is the outcome:
#      the steps' scripts run and report themselves skipped, but nothing about a GPU is proved.
#
# GPU_CHECK_STEPS=matrix,plan_check runs only those steps after the preflight (default: all).
# pytest is needed by the cuda_tests step alone: without it that step is skipped, with the reason.
# It uses the torch already installed (PYTHON, else python3 / python) and runs multicard from src/.
# Pure-Python wheels the machine lacks travel in the checkout (scripts/gpu_check/wheels/:
# omegaconf, whose antlr4 runtime is vendored inside it); they are unpacked into the work folder
# only for modules the interpreter cannot import (GPU_CHECK_WHEELS=DIR to use another folder).
set -uo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: bash scripts/gpu_check.sh OUT_DIR" >&2
    exit 2
fi
STEPS=(throughput proofs cuda_tests matrix gpu_decode plan_check) # after the preflight, in this order
MIN_BUDGET=60 MAX_BUDGET=3600 # the preflight's minute at least; the steps' caps total 630 s
BUDGET=${GPU_CHECK_BUDGET_S:-480}
# digits only (at most 5: no overflow), read as decimal (10#: "08" is not octal)
if ! [[ $BUDGET =~ ^[0-9]{1,5}$ ]] || ((10#$BUDGET < MIN_BUDGET || 10#$BUDGET > MAX_BUDGET)); then
    echo "gpu_check: error: GPU_CHECK_BUDGET_S=${BUDGET//[^[:print:]]/?} must be whole seconds from $MIN_BUDGET" \
        "to $MAX_BUDGET (default 480)" >&2
    exit 2
fi
BUDGET=$((10#$BUDGET))
SELECTED=",${GPU_CHECK_STEPS:-$(IFS=,; echo "${STEPS[*]}")},"
IFS=, read -ra names <<<"${GPU_CHECK_STEPS:-}"
for name in "${names[@]}"; do
    if [[ -n $name && " ${STEPS[*]} " != *" $name "* ]]; then
        echo "gpu_check: error: GPU_CHECK_STEPS names ${name//[^[:print:]]/?}: choose from" \
            "$(IFS=,; echo "${STEPS[*]}") (comma-separated)" >&2
        exit 2
    fi
done
mkdir -p "$1" && OUT=$(cd "$1" && pwd) || exit 2
rm -f "$OUT/summary.md" "$OUT/summary.json" "$OUT/logs.tar.gz" # an earlier run's files never pass for this one's
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
DEADLINE=$((SECONDS + BUDGET))
RESERVE=20 # kept for a step's kill-after (10 s), the last summary and the archive
# A Python with torch says so (an exit code alone is no evidence: PYTHON=/bin/true); found, not
# imported (seconds): the preflight imports it and names what fails.
has_torch() {
    command -v "$1" >/dev/null &&
        [[ $("$1" -c "import importlib.util as u; print('torch', u.find_spec('torch') is not None)" 2>/dev/null) == \
            "torch True" ]]
}
PY=""
candidates=(python3 python)
[[ -n ${PYTHON:-} ]] && candidates=("$PYTHON") # PYTHON, when set, is the only one tried
for candidate in "${candidates[@]}"; do
    if has_torch "$candidate"; then
        PY=$candidate
        break
    fi
done
if [[ -z $PY && -n ${PYTHON:-} ]]; then
    echo "gpu_check: error: PYTHON=${PYTHON//[^[:print:]]/?} is not a Python with torch installed" \
        "(set PYTHON=/path/to/python)" >&2
    exit 2
elif [[ -z $PY ]]; then
    echo "gpu_check: error: no python with torch found (set PYTHON=/path/to/python)" >&2
    exit 2
fi
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/scripts/gpu_check/wheels}
WORK=${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
mkdir -p "$WORK/logs" || exit 2
for name in preflight "${STEPS[@]}"; do # a reused GPU_CHECK_WORK: an earlier run's results are no evidence
    rm -rf "${WORK:?}/$name"
done
rm -f "$WORK/steps.jsonl" "$WORK/cuda_tests.xml"
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
    if [[ ! -s $OUT/summary.md ]] || ((summary_rc != 0 && summary_rc != 1 && summary_rc != 5)); then
        # summary.py could not say (it crashed or hung): the run is no pass, and still reports
        { echo "# GPU check: summary.py failed (exit $summary_rc); the steps as recorded:"; echo
          cat "$WORK/steps.jsonl" 2>/dev/null; } >"$OUT/summary.md"
        summary_rc=1
    fi
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

# Why step NAME cannot run (empty when it can): not selected, or the preflight's reason (a module
# only that step needs is missing: preflight/skip.tsv, NAME<tab>reason), or no time left.
skip_reason() {
    local name=$1 limit=$2 why
    if [[ $name != preflight && $SELECTED != *",$name,"* ]]; then
        echo "not selected (GPU_CHECK_STEPS=$GPU_CHECK_STEPS)"
    elif why=$(awk -F'\t' -v n="$name" '$1 == n { print $2; exit }' "$WORK/preflight/skip.tsv" 2>/dev/null) &&
        [[ -n $why ]]; then
        echo "$why"
    elif ((limit < 10)); then
        echo "time budget spent"
    fi
}

# step NAME CAP SIGNAL CMD...: CMD for at most min(CAP, time left), stopped by SIGNAL (10 s later
# SIGKILL); its output goes to logs/NAME.log, its last lines (STEP_TAIL, default 3) to the console.
# Its outcome is the summary's, from the result file the step wrote (exit 0 alone is "ran").
step() {
    local name=$1 cap=$2 signal=$3
    shift 3
    local left=$((DEADLINE - RESERVE - SECONDS))
    local limit=$((cap < left ? cap : left))
    local why
    why=$(skip_reason "$name" "$limit")
    if [[ -n $why ]]; then
        echo "== $name: skipped ($why)"
        record "$name" skipped 0 0 "$why"
        return
    fi
    echo "== $name (at most $limit s)"
    local start=$SECONDS rc status reason=""
    GPU_CHECK_DEADLINE=$(($(date +%s) + limit)) timeout --signal="$signal" --kill-after=10 "$limit" "$@" \
        >"$WORK/logs/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=ran ;; # passed, skipped or failed: its result file says
        124 | 137) status="timed out" reason="stopped after $limit s" ;;
        *) status=failed reason="exit $rc: $(grep -v '^\s*$' "$WORK/logs/$name.log" | tail -n 1 | cut -c1-200)" ;;
    esac
    tail -n "${STEP_TAIL:-3}" "$WORK/logs/$name.log"
    record "$name" "$status" $((SECONDS - start)) "$limit" "$reason"
    summarise --step "$name" # after every step (a run cut short still reports): its outcome line
    return $rc
}

echo "== gpu_check: budget $BUDGET s, work in $WORK, results in $OUT"
"$PY" scripts/gpu_check/vendor.py "$WHEELS" "$WORK/deps"
STEP_TAIL=30 step preflight 60 TERM "$PY" scripts/gpu_check/preflight.py "$WORK/preflight/preflight.json"
rc=$?
if ((rc == 3 || rc == 4)); then
    exit "$rc"
fi
if ((rc == 0)) && [[ ! -s $WORK/preflight/preflight.json ]]; then
    echo "gpu_check: error: the preflight exited 0 but wrote no preflight.json: it did not run (PYTHON=$PY)" >&2
    exit 3
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
exit 0 # the summary decides: 0 only on evidence (see Exit codes)
