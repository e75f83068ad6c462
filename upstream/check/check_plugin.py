"""pytest plugin used by ``upstream/check/run_series.py`` (not part of the proposed change).

It makes each step's run prove what it claims:

* ``prompt_embed_cache`` is imported from the tree being checked, with no plugin rebinding its names;
* the public-contract tests (``test_public_contract.py``) get that module as ``implementation``;
* upstream's own tests whose meaning a PR of the series changes are listed below, by the PR that
  changes them, for each version of upstream's test file we know. The version is recognised by the
  listed tests it holds; a file that matches no list stops the run, to be read and listed. From
  that PR on, a listed test runs as a strict expected failure that must fail on an assertion: one
  that passes, or errors, fails the run. Each PR's ``PR.md`` gives the same list.
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest

_TYPED = "numbers are keyed with their type, so 1, 1.0 and True no longer share an entry"
#: Changed by PR 1 in both known versions of upstream's file.
_CONTENT_KEYS = {
    "TestHashable::test_numpy_ndarray_is_not_hashable": "a numpy array is keyed by its content",
    "TestHashable::test_list_containing_tensor_is_not_hashable": "a tensor inside a list is keyed by its content",
    "TestHashable::test_dict_containing_tensor_is_not_hashable": "a tensor inside a dict is keyed by its content",
}
#: Changed by PR 3 in both known versions.
_TYPED_VALUES = {
    **{
        f"TestHashable::test_scalars_are_returned_unchanged[{value}]": _TYPED
        for value in ("0", "1", "-5", "3.14", "True", "False")
    },
    "TestHashable::test_numpy_scalar_is_unwrapped": "a numpy scalar keeps its dtype in the key",
}
#: Upstream's tests/diffusion/cache/test_prompt_embed_cache.py, by version: PR number -> {test: why it now fails}.
CHANGED: dict[str, dict[int, dict[str, str]]] = {
    "vLLM-Omni 0.30": {
        1: {
            **_CONTENT_KEYS,
            "TestHashable::test_tensor_is_not_hashable": "a tensor is keyed by its content",
            "TestBuildKey::test_tensor_argument_bypasses": "a tensor argument is keyed, not bypassed",
        },
        3: _TYPED_VALUES,
    },
    "PR #5195 head 485f1be": {
        1: {
            **_CONTENT_KEYS,
            "TestHashable::test_float_tensor_is_not_hashable": "a float tensor is keyed by its content",
            "TestBuildKey::test_float_tensor_argument_bypasses": "a float tensor argument is keyed, not bypassed",
            "TestInstallAndUninstall::test_unsupported_tensor_argument_bypasses_and_increments_counter": (
                "a float tensor argument hits by content, so the second call is served from the cache"
            ),
        },
        3: _TYPED_VALUES,
    },
}

UPSTREAM_TEST_FILE = "test_prompt_embed_cache.py"
_matched: list[tuple[str, int]] = []


def changed_by(version: str, step: int) -> dict[str, str]:
    """Upstream's tests whose meaning the series up to PR ``step`` changes, with why."""
    return {name: why for number, tests in CHANGED[version].items() if number <= step for name, why in tests.items()}


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    upstream = {item.nodeid.split("::", 1)[1]: item for item in items if item.path.name == UPSTREAM_TEST_FILE}
    if not upstream:
        return
    versions = [version for version in CHANGED if set(changed_by(version, 99)) <= set(upstream)]
    if len(versions) != 1:
        raise pytest.UsageError(
            f"upstream's {UPSTREAM_TEST_FILE} matches {len(versions)} of the known versions "
            f"({', '.join(CHANGED)}): read it, and list the tests whose meaning the change alters"
        )
    changed = changed_by(versions[0], _step())
    _matched.append((versions[0], len(changed)))
    for name, why in changed.items():
        upstream[name].add_marker(
            pytest.mark.xfail(reason=f"meaning changed: {why}", strict=True, raises=AssertionError)
        )


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for version, changed in _matched:
        terminalreporter.write_line(f"upstream's {UPSTREAM_TEST_FILE}: the {version} version, {changed} tests changed")
