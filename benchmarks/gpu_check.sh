#!/usr/bin/env bash
# GPU ONLY - never run in CI or on the CPU development machines.
#
# Everything in this project that needs a CUDA GPU, in one go, each step under its own timeout so the
# whole stays under 10 minutes on one H200 (step timeouts plus kill grace add up to 585 s):
#   1. the GPU:                  nvidia-smi name and memory
#   2. CUDA tests:               tests/test_cuda.py (they skip without CUDA elsewhere)
#   3. engine tests on the GPU:  pytest -m engine (on a CUDA machine conftest leaves the CPU platform off)
#   4. encoder benchmark:        benchmarks/gpu_encoder_bench.py (Qwen-Image's 7B text stack, random weights)
#   5. tiny rollout on the GPU:  vllm-omni-prompt-cache demo (with CUDA the demo runs on the GPU by itself)
#   6. offload on the GPU:       benchmarks/offload.py (module offload and encoder-on-a-miss rollouts with
#                                real host<->device copies: wall time, CUDA memory between requests, peak)
# then a summary table of step / exit code / seconds; the exit code is non-zero if any step failed.
#
# It assumes the venv that `make install` makes (.venv, with the vllm-omni extra); if .venv is missing
# it runs `make install` first (about 3 minutes, not counted in the 8, and it needs the package
# registries). On a machine without registry access but with torch, transformers, xxhash and pytest
# already installed, point GPU_CHECK_PYTHON at that interpreter instead (steps 2 and 4 need only those;
# steps 3 and 5 need vllm-omni and are reported as skipped when it does not import):
#
#   benchmarks/gpu_check.sh [OUT_DIR]                                   # default OUT_DIR: gpu-out
#   GPU_CHECK_PYTHON=python3 PYTHONPATH=$PWD benchmarks/gpu_check.sh    # a bare GPU box with torch
#
# Nothing is downloaded: the tiny demo model and the benchmark's weights are built by the code. Each
# step's output goes to the terminal and to OUT_DIR/logs/STEP.log; the demo writes OUT_DIR/demo.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-out}

command -v nvidia-smi >/dev/null || {
    echo "error: no nvidia-smi on PATH: benchmarks/gpu_check.sh runs only on a machine with an NVIDIA GPU" >&2
    exit 2
}
if [[ -n ${GPU_CHECK_PYTHON:-} ]]; then
    python=$GPU_CHECK_PYTHON
else
    [[ -x .venv/bin/python ]] || make install
    python=.venv/bin/python
fi
mkdir -p "$out/logs"
has_vllm_omni=1
"$python" -c "import vllm_omni" >/dev/null 2>&1 || has_vllm_omni=0

steps=() codes=() seconds=()
# run NAME SECONDS COMMAND...: run COMMAND under a timeout, tee its output to the step's log, record the result.
run() {
    local name=$1 limit=$2 code=0 start end
    shift 2
    echo
    echo "=== $name (timeout ${limit}s): $*"
    start=$(date +%s.%N)
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$out/logs/$name.log" || code=${PIPESTATUS[0]}
    end=$(date +%s.%N)
    [[ $code == 124 || $code == 137 ]] && echo "=== $name: TIMED OUT after ${limit}s"
    steps+=("$name") codes+=("$code") seconds+=("$(awk "BEGIN {printf \"%.1f\", $end - $start}")")
    echo "=== $name: exit $code in ${seconds[-1]} s"
}
skip() {
    echo
    echo "=== $1: skipped ($2)"
    steps+=("$1") codes+=("skipped: $2") seconds+=("-")
}

export PYTHONUNBUFFERED=1
run gpu 15 nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run cuda-tests 45 "$python" -m pytest tests/test_cuda.py -q -p no:cacheprovider
if ((has_vllm_omni)); then
    run engine-tests 180 "$python" -m pytest tests -q -p no:cacheprovider -m engine
else
    skip engine-tests "vllm_omni does not import with $python"
fi
run encoder-bench 75 "$python" benchmarks/gpu_encoder_bench.py
if ((has_vllm_omni)); then
    run demo 120 "$python" -m vllm_omni_prompt_cache demo --out "$out/demo"
    run offload-bench 120 "$python" benchmarks/offload.py
else
    skip demo "vllm_omni does not import with $python"
    skip offload-bench "vllm_omni does not import with $python"
fi

echo
echo "| step | exit code | seconds |"
echo "|---|---|---:|"
failed=0
for i in "${!steps[@]}"; do
    echo "| ${steps[$i]} | ${codes[$i]} | ${seconds[$i]} |"
    [[ ${codes[$i]} == 0 || ${codes[$i]} == skipped* ]] || failed=1
done
echo
echo "logs: $out/logs/"
exit "$failed"
