#!/usr/bin/env bash
# What the plugin does on another vLLM-Omni release, in a venv of its own (not part of `make test`).
#
#   benchmarks/other_vllm_omni.sh 0.28.0               # venv in /tmp/venv-vllm-omni-0.28.0
#   benchmarks/other_vllm_omni.sh 0.28.0 /path/to/venv
#
# Installs torch 2.13.0, vLLM and vLLM-Omni of the given version (vLLM-Omni does not declare its
# vLLM: the same major.minor is what its version check wants; VLLM_VERSION overrides), then this
# package without dependencies, from a copy of the committed tree (an in-place build would write
# build/ here). Then, in a fresh process: the hook-point survey, and what the plugin did once
# vLLM-Omni's runner module was imported (hooked, or inert). Prints a Markdown table and the
# plugin's warnings; benchmarks/results/other_vllm_omni_<version>.txt keeps the last run's.
set -euo pipefail

version=${1:?usage: $0 VLLM_OMNI_VERSION [VENV]}
venv=${2:-/tmp/venv-vllm-omni-$version}
vllm_version=${VLLM_VERSION:-$version}
here=$(cd "$(dirname "$0")/.." && pwd)
pip_install() { env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install -q "$@"; }

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip_install torch==2.13.0 "vllm==$vllm_version" "vllm-omni==$version" xxhash
copy=$(mktemp -d)
logs=$(mktemp -d)  # outside the copy, so a failure's logs survive the cleanup
trap 'rm -rf "$copy"' EXIT
git -C "$here" archive HEAD | tar -x -C "$copy"
pip_install --no-deps --force-reinstall "$copy"

cd "$copy"  # not the checkout: the installed copy must be the one imported
cat >"$logs/survey.py" <<'PYTHON'
import importlib.metadata
import logging
import os
import sys

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from vllm_omni_prompt_cache.vllm_omni.hook_points import FEATURES, HOOK_POINTS, missing_hook_points, vllm_omni_source_root

missing = missing_hook_points(vllm_omni_source_root())
import vllm_omni.diffusion.worker.diffusion_model_runner as runner_module  # the plugin registers on the way

from vllm_omni_prompt_cache.vllm_omni import runner

hooked = runner_module.install_prompt_embed_cache is runner._installed_after_load_model
versions = {name: importlib.metadata.version(name) for name in ("vllm-omni", "vllm", "torch")}
lines = ["| " + " | ".join(f"{name} {value}" for name, value in versions.items()) + " |", "|---|---|---|"]
for feature in FEATURES:
    lacking = [str(point) for point in missing if point.feature == feature]
    points = sum(point.feature == feature for point in HOOK_POINTS)
    listed = ", ".join(f"`{name}`" for name in lacking) or "all found"
    lines.append(f"| {feature} | {points - len(lacking)} of {points} hook points | {listed} |")
state = "hooked the cache" if hooked else "stayed inert"
lines.append(f"\nThe plugin {state} (the runner's install_prompt_embed_cache is {'ours' if hooked else 'stock'}).")
with open(os.environ["REPORT"], "w") as report:
    report.write("\n".join(lines) + "\n")
PYTHON
if ! VLLM_OMNI_PROMPT_CACHE_CPU_PLATFORM=1 REPORT="$logs/report.md" "$venv/bin/python" "$logs/survey.py" \
    >"$logs/stdout.log" 2>"$logs/stderr.log"; then
    tail -40 "$logs/stderr.log" >&2
    echo "the survey failed; its logs are in $logs" >&2
    exit 1
fi
cat "$logs/report.md"
echo
echo "What the plugin said:"
grep -h "vllm-omni-prompt-cache" "$logs/stderr.log" "$logs/stdout.log" || echo "(nothing)"
rm -rf "$logs"
