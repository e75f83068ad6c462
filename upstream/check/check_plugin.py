"""pytest plugin used by ``upstream/check/run_series.py`` (not part of the proposed change).

It makes each step's run prove what it claims:

* ``prompt_embed_cache`` is imported from the tree being checked, with no plugin rebinding its names;
* the public-contract tests (``test_public_contract.py``) get that module as ``implementation``;
* upstream's own tests (``--upstream-tests``) run as they are in the tree: a PR that changes what one of
  them pins edits that test in its patch, so there is no list of expected failures here.
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest


def _environment(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise pytest.UsageError(f"{name} is not set: run this plugin through upstream/check.sh")
    return value


def _step() -> int:
    return int(_environment("CHECK_STEP"))


def pytest_configure(config: pytest.Config) -> None:
    package = os.path.realpath(_environment("CHECK_VLLM_OMNI_DIR"))
    from vllm_omni.diffusion.cache import prompt_embed_cache

    module = os.path.realpath(prompt_embed_cache.__file__)
    if module != os.path.join(package, "diffusion", "cache", "prompt_embed_cache.py"):
        raise pytest.UsageError(f"prompt_embed_cache was imported from {module}, not from {package}")
    if prompt_embed_cache.install_prompt_embed_cache.__module__ != prompt_embed_cache.__name__:
        raise pytest.UsageError("prompt_embed_cache's names were rebound after import (a plugin?)")


@pytest.fixture
def implementation() -> ModuleType:
    """The tree's module, for the public-contract tests."""
    from vllm_omni.diffusion.cache import prompt_embed_cache

    return prompt_embed_cache


@pytest.fixture
def tensor_keys() -> bool:
    """Whether this step keys tensor arguments (PR 1 on)."""
    return _step() >= 1


#: The wheels' ``DiffusionWorker.sleep()`` first reads the runner's ``_kv_receive_progress`` (a native KV prefetch
#: guard); vLLM-Omni main's worker tests build the runner as a bare ``Mock``, whose auto-made attribute is truthy,
#: so every one of their sleeps would stop at that guard. For the tests of upstream's files only, a mocked runner
#: answers it with None (no prefetch in flight), as a real runner does when idle.
@pytest.fixture(autouse=True)
def _idle_kv_prefetch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if "upstream-run" not in request.node.path.parts:
        return
    from unittest import mock

    from vllm_omni.diffusion.worker.diffusion_worker import DiffusionWorker

    sleep = DiffusionWorker.sleep

    def sleep_with_idle_prefetch(self, *args, **kwargs):
        runner = getattr(self, "model_runner", None)
        if isinstance(runner, mock.Mock) and "_kv_receive_progress" not in vars(runner):
            runner._kv_receive_progress = None
        return sleep(self, *args, **kwargs)

    monkeypatch.setattr(DiffusionWorker, "sleep", sleep_with_idle_prefetch)
