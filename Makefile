# Two entry points, each installing what it needs on first use:
#   make demo   run the main job (GRPO-shaped rollout through vLLM-Omni, cache off / stock / ours),
#               print the table and write demo-out/report.md, results.json, time.png
#   make test   run the test suite (on vLLM-Omni 0.30.0)
#   make releases   the release-sensitive tests on every supported vLLM-Omni release (nox)
VENV ?= .venv
PYTHON ?= python3
# vLLM-Omni 0.30 needs the PyPI torch build that vLLM 0.30 pins. Some machines point pip at a
# local CPU-only torch wheel (PIP_FIND_LINKS, a pip config file); hide both so the install is the
# one a user gets. On a machine without them this changes nothing.
PIP_INSTALL = env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $(VENV)/bin/python -m pip install
# The ~9 GB of vLLM, torch and CUDA wheels go in with uv (it reads no pip settings, so it gets the
# same PyPI builds): pip took 7 min 30 s for them on 2 AVX2 cores, most of CI's limit after the suite.
# Compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is set (these machines set it),
# every process would compile vLLM's sources again on import (the suite took 1,392 s, not 902 s).
UV_INSTALL = $(VENV)/bin/uv pip install --compile-bytecode --python $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) 'uv>=0.5'
	$(UV_INSTALL) -e '.[vllm-omni,demo,dev]'
	touch $@

.PHONY: install demo test releases releases-ci upstream-check lint bench docs-table
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/vllm-omni-prompt-cache demo --out demo-out

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest

# The release matrix (noxfile.py): the release-sensitive tests on every vLLM-Omni release we support,
# each in an environment of its own, then docs/support.md from what they recorded.
releases: $(VENV)/.installed
	$(VENV)/bin/nox

# The oldest release, UniRL's pin (0.28.0) and the newest (what CI runs beside `make test`).
releases-ci: $(VENV)/.installed
	$(VENV)/bin/nox -t ci

# The upstream series (upstream/README.md), PR by PR, on copies of the 0.30.0 wheel (.venv) and the
# 0.32.0rc1 one (.nox, from `make releases-ci`): by default an 8 x 16 rollout at every step.
UPSTREAM_CHECK_ARGS ?=
upstream-check: $(VENV)/.installed
	upstream/check.sh $(UPSTREAM_CHECK_ARGS)

# The settings table of docs/user-guide.md, made from settings.schema.SETTINGS (tests/test_config.py checks it is current).
docs-table: $(VENV)/.installed
	$(VENV)/bin/python -c "from vllm_omni_prompt_cache.settings.schema import write_settings_table as w; w('docs/user-guide.md')"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# Micro benchmarks (pytest-benchmark, not collected by `make test`): the JSON is committed, and the
# tables in docs/benchmarks.md are rendered from it.
bench: $(VENV)/.installed
	mkdir -p benchmarks/results
	$(VENV)/bin/python -m pytest benchmarks --benchmark-only --benchmark-disable-gc \
		--benchmark-columns=min,median,rounds,iterations --benchmark-json=benchmarks/results/keys.json
	$(VENV)/bin/python benchmarks/render_tables.py benchmarks/results/keys.json --write-into docs/benchmarks.md
