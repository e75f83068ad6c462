#!/usr/bin/env bash
# GPU ONLY - never run in CI or on the CPU development machines.
#
# The demo's rollout on the real Qwen-Image (Qwen2.5-VL-7B text encoder, 20B transformer) at a
# realistic RL resolution: cache off, vLLM-Omni's own cache, and ours, one engine each, with the
# exactness check. Needs a CUDA GPU that holds Qwen-Image (its 20B + 7B parameters are about 54 GB in
# bf16, by arithmetic; never run here) and a local Qwen-Image diffusers checkpoint; nothing is downloaded. On a machine with a GPU the demo leaves the CPU platform off by itself.
#
#   benchmarks/gpu_qwen_image.sh /models/Qwen-Image [out-dir]
set -euo pipefail
model=${1:?usage: benchmarks/gpu_qwen_image.sh QWEN_IMAGE_DIR [OUT_DIR]}
out=${2:-gpu-out}
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null || { echo "error: no nvidia-smi: this script needs a CUDA GPU" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
.venv/bin/vllm-omni-prompt-cache demo --model "$model" --size 512 --steps 10 \
    --prompts 8 --group-size 16 --cache-size 64 --max-bytes 4GiB --out "$out"
