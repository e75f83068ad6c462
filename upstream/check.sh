#!/usr/bin/env bash
# Put the proposed change into a vLLM-Omni tree and run its tests there.
#
#   upstream/check.sh VLLM_OMNI_DIR
#
# VLLM_OMNI_DIR is the vllm_omni package directory of a source checkout, or of a *copy* of an
# installed wheel's package. The tree is changed in place (the module replaced, the worker patched,
# the tests added), so an installed package is refused. The directory above it goes first on
# PYTHONPATH. Upstream's own tests/diffusion/cache/test_prompt_embed_cache.py runs too when the tree
# has one (a source checkout; a wheel has none), with the tests whose meaning the change alters
# expected to fail (check/check_plugin.py lists them, PR.md says why). PYTHON picks the interpreter.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python}

if [ $# -ne 1 ]; then
    echo "usage: $0 VLLM_OMNI_DIR (the vllm_omni package directory of a source checkout or of a copy)" >&2
    exit 2
fi
if [ ! -f "$1/diffusion/cache/prompt_embed_cache.py" ] || [ ! -f "$1/diffusion/worker/diffusion_worker.py" ]; then
    echo "$0: $1 is not a vllm_omni package directory (no diffusion/cache/prompt_embed_cache.py)" >&2
    exit 2
fi
package=$(cd "$1" && pwd -P)
case "$package" in
    */site-packages/* | */dist-packages/*)
        echo "$0: $package is an installed package; give a copy of it (cp -r) instead" >&2
        exit 2
        ;;
esac
root=$(dirname "$package")
command -v patch >/dev/null || { echo "$0: needs patch(1)" >&2; exit 2; }

# The module, and the worker's sleep change (skipped when this tree already has it).
cp "$here/vllm_omni/diffusion/cache/prompt_embed_cache.py" "$package/diffusion/cache/prompt_embed_cache.py"
worker="$package/diffusion/worker/diffusion_worker.py"
worker_patch="$here/vllm_omni/diffusion/worker/diffusion_worker.py.patch"
if patch --dry-run --silent --reverse --force "$worker" "$worker_patch" >/dev/null 2>&1; then
    echo "diffusion_worker.py already has the sleep change"
else
    patch --fuzz=0 --no-backup-if-mismatch --reject-file=- "$worker" "$worker_patch"
fi

tests=()
for test_file in "$here"/tests/diffusion/*/test_*.py; do
    target="$root/tests/${test_file#"$here"/tests/}"
    mkdir -p "$(dirname "$target")"
    cp "$test_file" "$target"
    tests+=("$target")
done
upstream_tests="$root/tests/diffusion/cache/test_prompt_embed_cache.py"
if [ -f "$upstream_tests" ]; then
    tests+=("$upstream_tests")
else
    echo "no upstream tests/diffusion/cache/test_prompt_embed_cache.py here (a wheel): running ours only"
fi

# This repository's plugin, if installed alongside, rebinds the module's names: keep it out.
export VLLM_OMNI_PROMPT_CACHE_PLUGIN=0
export CHECK_VLLM_OMNI_DIR="$package"
export CHECK_PROPOSED_MODULE="$here/vllm_omni/diffusion/cache/prompt_embed_cache.py"
export CHECK_WORKER_PATCH="$worker_patch"
export PYTHONPATH="$root:$here/check${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
exec "$python" -m pytest -p check_plugin -p no:cacheprovider -W ignore::pytest.PytestUnknownMarkWarning \
    -q -rfExX "${tests[@]}"
