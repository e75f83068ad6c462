#!/usr/bin/env bash
# Apply the upstream series (upstream/series/<n>-<name>/change.patch) one PR at a time to copies of
# installed vLLM-Omni wheels, test each step, and print a line per PR: applied, tests passed, lines
# changed, and what a rollout through the real engine did at that step.
#
#   upstream/check.sh [--python PYTHON]... [--rollout PxK[xS] | --rollout none] [--upto N]
#                     [--upstream-tests FILE]...
#
# By default it checks the 0.30.0 wheel (.venv) and the 0.32.0rc1 wheel of the release matrix
# (.nox/releases-vllm_omni-0-32-0rc1), with an 8 x 16 rollout at every step. The installed packages
# are never changed: each is copied to a scratch tree first. See check/run_series.py.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-$here/../.venv/bin/python}
[ -x "$python" ] || python=python3
exec "$python" "$here/check/run_series.py" "$@"
