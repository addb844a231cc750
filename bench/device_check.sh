#!/usr/bin/env bash
# The GPU checks of hasten in one run of at most 8 minutes, for a lent GPU machine (see bench/README.md, "GPU"):
#   1. compiled steps on the ~1.8B-parameter "wide" LM (bench_gpu_compile.py): raw torch.compile / hasten /
#      hasten-keep / Accelerate, regional and whole-model, bf16 and fp16; fp8 through hasten (default, size filter,
#      rowwise) and Accelerate (default, all-gather off) against hasten bf16 with loss curves; the profile of
#      hasten's and Accelerate's bf16 regional steps side by side (profile_compiled.py); the issue's targets;
#   2. the CUDA test group (pytest -m cuda: tests/test_cuda.py);
#   3. eager LM throughput: raw PyTorch / hasten / hasten-keep / Accelerate, bf16 and fp16 (GPT-2 small);
#   4. fp8 + FSDP2 (float8 all-gather) + torch.compile on one GPU, started by hasten launch;
#   5. NCCL runs on 2 processes, context parallelism (ring attention, cp_size 2) included, and the step and
#      evaluation bench on NCCL, hasten vs raw vs Accelerate (only where the machine has 2 GPUs: torch's
#      context_parallel does not run on the CPU).
# Each part has a time limit and the whole run a budget; a part that fails or runs out of time is reported, and the
# others still run. Results: $OUT/device_check.json, $OUT/device_check.md (the table bench/README.md shows) and
# $OUT/device_check.log.
#
# Usage: bench/device_check.sh [--dry-run] [--only PART ...]
#   --dry-run: everything shrunk to run on a CPU in a few minutes (tiny models, aot_eager, emulated fp8), CUDA-only
#              parts skipped with one line each. Checks the script, measures nothing.
#   --only:    run only these parts (compiled, cuda_tests, lm_throughput, fsdp_fp8_compile, nccl), e.g. to rerun
#              what a first run had to skip. COMPILED_ARGS="--only fp8 ..." passes options to bench_gpu_compile.py.
# Wheels: Python packages missing on the machine (torchao) are installed from .whl/ when that folder exists
# (bench/README.md says how to fetch them); hasten itself runs from src/.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
DRY=0
ONLY=()
while (($#)); do
    case $1 in
        --dry-run) DRY=1 ;;
        --only) shift; while (($#)) && [[ $1 != --* ]]; do ONLY+=("$1"); shift; done; continue ;;
        *) echo "device_check: unknown argument $1 (usage: bench/device_check.sh [--dry-run] [--only PART ...])"; exit 2 ;;
    esac
    shift
done
# wanted PART: whether --only names PART (every part when --only is not given)
wanted() { ((${#ONLY[@]} == 0)) || [[ " ${ONLY[*]} " == *" $1 "* ]]; }
OUT=${OUT:-$ROOT/outputs/device_check}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/device_check.XXXXXX")
mkdir -p "$OUT"
LOG="$OUT/device_check.log"
: >"$LOG"
BUDGET=${DEVICE_CHECK_BUDGET:-470}  # seconds for all parts; the report needs a few more
DEADLINE=$((SECONDS + BUDGET))
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    [[ -x "$ROOT/.venv/bin/python" ]] && PYTHON="$ROOT/.venv/bin/python"
fi
export PYTHONUNBUFFERED=1 TORCHAO_FORCE_SKIP_LOADING_SO_FILES=${TORCHAO_FORCE_SKIP_LOADING_SO_FILES:-0}

say() { echo "$*" | tee -a "$LOG"; }

if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$ROOT"/.whl/*.whl >>"$LOG" 2>&1; then
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        say "wheels installed from .whl/: $(cd "$ROOT/.whl" && ls *.whl | tr '\n' ' ')"
    else
        say "wheels in .whl/ could not be installed (see the log); parts that need them will say so"
    fi
fi
export PYTHONPATH="$ROOT/src:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"

# part NAME LIMIT COMMAND...: run COMMAND (output to $WORK/NAME.log and the log) within min(LIMIT, budget left).
part() {
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - SECONDS))
    ((limit > left)) && limit=$left
    if ((limit < 20)); then
        say "== $name: skipped: the 8-minute budget is spent"
        echo "{\"part\": \"$name\", \"status\": \"skipped\", \"reason\": \"budget spent\"}" >>"$WORK/parts.jsonl"
        return
    fi
    say "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    grep -v -e "^USDT" -e "Failed to load .*torchao" "$WORK/$name.log" | tee -a "$LOG" | tail -n 40
    local status=ok
    ((rc == 124 || rc == 137)) && status=timeout
    ((rc != 0 && rc != 124 && rc != 137)) && status=failed
    say "== $name: $status (exit $rc, $((SECONDS - start)) s)"
    echo "{\"part\": \"$name\", \"status\": \"$status\", \"rc\": $rc, \"seconds\": $((SECONDS - start))}" >>"$WORK/parts.jsonl"
}

skip() {
    say "== $1: skipped: $2"
    echo "{\"part\": \"$1\", \"status\": \"skipped\", \"reason\": \"$2\"}" >>"$WORK/parts.jsonl"
}

part environment 60 "$PYTHON" "$ROOT/bench/device_report.py" --environment "$WORK/environment.json"
GPUS=$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['gpus'])" "$WORK/environment.json" 2>/dev/null || echo 0)
FP8_GPU=$("$PYTHON" -c "import json,sys; print(int(json.load(open(sys.argv[1]))['fp8_gpu']))" "$WORK/environment.json" 2>/dev/null || echo 0)
if ((DRY == 0 && GPUS == 0)); then
    say "device_check: no CUDA GPU visible; run with --dry-run to check the script on a CPU"
fi

# 1. compiled steps, fp8 and the profile of hasten vs Accelerate (prewarms the compile caches, then one contestant
#    at a time; keeps within its own budget and reports what it had to cut)
read -r -a COMPILED_EXTRA <<<"${COMPILED_ARGS:-}"
if ! wanted compiled; then
    :
elif ((DRY)); then
    part compiled 420 "$PYTHON" bench/bench_gpu_compile.py --dry-run --budget 400 --json "$WORK/compiled.json" \
        "${COMPILED_EXTRA[@]}"
elif ((GPUS > 0)); then
    part compiled 335 "$PYTHON" bench/bench_gpu_compile.py --budget 315 --json "$WORK/compiled.json" "${COMPILED_EXTRA[@]}"
else
    skip compiled "no CUDA GPU"
fi

# 2. the CUDA test group (on a CPU every test skips, saying why)
if wanted cuda_tests; then
    part cuda_tests 90 "$PYTHON" -m pytest -m cuda tests/test_cuda.py -q -rs -p no:cacheprovider \
        --junitxml="$WORK/cuda_tests.xml"
fi

# 3. eager LM throughput, bf16 and fp16 (its targets held on the H200 before issue 30: kept short, as a regression
#    check)
if ! wanted lm_throughput; then
    :
elif ((DRY)); then
    part lm_throughput 150 "$PYTHON" bench/bench_gpu_lm.py --smoke --precisions bf16 fp16 --rounds 1 --steps 3 \
        --warmup 1 --batch 2 --threads 1 --json "$WORK/lm_throughput.json"
elif ((GPUS > 0)); then
    part lm_throughput 75 "$PYTHON" bench/bench_gpu_lm.py --precisions bf16 fp16 --rounds 2 --steps 10 --warmup 3 \
        --json "$WORK/lm_throughput.json"
else
    skip lm_throughput "no CUDA GPU"
fi

# 4. fp8 + FSDP2 with float8 all-gather + torch.compile, one process
FSDP_FP8=(--use_fsdp --mixed_precision fp8 --fp8_backend ao --fp8_enable_fsdp_float8_all_gather true --fp8_pad_inner_dim true)
if ! wanted fsdp_fp8_compile; then
    :
elif ((DRY)); then
    part fsdp_fp8_compile 120 "$PYTHON" -m hasten.commands.main launch "${FSDP_FP8[@]}" --cpu --num_processes 1 \
        --dynamo_backend aot_eager tests/scripts/fp8_fsdp_training.py
elif ((FP8_GPU)); then
    part fsdp_fp8_compile 70 "$PYTHON" -m hasten.commands.main launch "${FSDP_FP8[@]}" --num_processes 1 \
        --dynamo_backend inductor tests/scripts/fp8_fsdp_training.py
else
    skip fsdp_fp8_compile "no GPU with fp8 units (compute capability 8.9+) or no torchao"
fi

# 5. NCCL on 2 processes
if ! wanted nccl; then
    :
elif ((GPUS >= 2 && DRY == 0)); then
    part nccl_fsdp_fp8 120 "$PYTHON" -m hasten.commands.main launch "${FSDP_FP8[@]}" --num_processes 2 \
        tests/scripts/fp8_fsdp_training.py
    part nccl_self_check 90 "$PYTHON" -m hasten.commands.main launch --multi_gpu --num_processes 2 \
        src/hasten/test_utils/scripts/test_script.py
    part nccl_step 100 "$PYTHON" bench/bench_step.py --device cuda --processes 2 --variants eval plain \
        --rounds 5 --steps 100
    part context_parallel 120 "$PYTHON" -m hasten.commands.main launch --num_processes 2 --use_fsdp \
        --parallelism_config_cp_size 2 tests/scripts/cp_training.py
else
    skip nccl "this machine has $GPUS GPU(s); the NCCL 2-process runs need 2"
fi

"$PYTHON" "$ROOT/bench/device_report.py" --report "$WORK" "$OUT" 2>&1 | tee -a "$LOG"
say "device_check: done in $SECONDS s; results in $OUT"
rm -rf "$WORK"
