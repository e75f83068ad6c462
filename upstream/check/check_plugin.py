"""pytest plugin used by ``upstream/check.sh`` (not part of the proposed change).

It makes the run prove what it claims:

* the ``prompt_embed_cache`` module imported is the proposed one (same bytes), from the tree
  ``check.sh`` changed, with no plugin rebinding its names, and that tree's worker carries every
  line the sleep change adds;
* upstream's own tests whose meaning the change alters are listed below, each with why, for each
  version of upstream's test file we know. The version is recognised by the listed tests it holds;
  a file that matches no list stops the run, to be read and listed. Listed tests run as strict
  expected failures that must fail on an assertion: one that passes, or errors, fails the run.
  ``PR.md`` gives the same lists.
"""

from __future__ import annotations

import ast
import hashlib
import os

import pytest

_TYPED = "numbers are keyed with their type, so 1, 1.0 and True no longer share an entry"
_IN_BOTH = {
    **{
        f"TestHashable::test_scalars_are_returned_unchanged[{v}]": _TYPED
        for v in ("0", "1", "-5", "3.14", "True", "False")
    },
    "TestHashable::test_numpy_scalar_is_unwrapped": "a numpy scalar keeps its dtype in the key",
    "TestHashable::test_numpy_ndarray_is_not_hashable": "a numpy array is keyed by its content",
    "TestHashable::test_list_containing_tensor_is_not_hashable": "a tensor inside a list is keyed by its content",
    "TestHashable::test_dict_containing_tensor_is_not_hashable": "a tensor inside a dict is keyed by its content",
    "TestPromptEmbedCache::test_stats_reports_expected_fields": "stats() also reports bytes and max_bytes",
}
#: Upstream's tests/diffusion/cache/test_prompt_embed_cache.py, by version: test -> why it now fails.
CHANGED: dict[str, dict[str, str]] = {
    "vLLM-Omni 0.30": {
        **_IN_BOTH,
        "TestHashable::test_tensor_is_not_hashable": "a tensor is keyed by its content",
        "TestBuildKey::test_tensor_argument_bypasses": "a tensor argument is keyed, not bypassed",
    },
    "PR #5195 head 485f1be": {
        **_IN_BOTH,
        "TestHashable::test_float_tensor_is_not_hashable": "a float tensor is keyed by its content",
        "TestBuildKey::test_float_tensor_argument_bypasses": "a float tensor argument is keyed, not bypassed",
        "TestInstallAndUninstall::test_unsupported_tensor_argument_bypasses_and_increments_counter": (
            "a float tensor argument hits by content, so the second call is served from the cache"
        ),
    },
}

UPSTREAM_TEST_FILE = "test_prompt_embed_cache.py"
_matched: list[str] = []


def _environment(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise pytest.UsageError(f"{name} is not set: run this plugin through upstream/check.sh")
    return value


def _sha256(path: str) -> str:
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()


def pytest_configure(config: pytest.Config) -> None:
    package = os.path.realpath(_environment("CHECK_VLLM_OMNI_DIR"))
    from vllm_omni.diffusion.cache import prompt_embed_cache
    from vllm_omni.diffusion.worker import diffusion_worker

    module = os.path.realpath(prompt_embed_cache.__file__)
    if module != os.path.join(package, "diffusion", "cache", "prompt_embed_cache.py"):
        raise pytest.UsageError(f"prompt_embed_cache was imported from {module}, not from {package}")
    if _sha256(module) != _sha256(_environment("CHECK_PROPOSED_MODULE")):
        raise pytest.UsageError(f"{module} is not the proposed module")
    if prompt_embed_cache.install_prompt_embed_cache.__module__ != prompt_embed_cache.__name__:
        raise pytest.UsageError("prompt_embed_cache's names were rebound after import (a plugin?)")
    with open(_environment("CHECK_WORKER_PATCH")) as patch_file:
        hunk = patch_file.read().split("\n@@", 1)[1].splitlines()[1:]
    # The added lines, then the line the patch places them before.
    change = [line[1:] for line in hunk if line.startswith("+")] + [next(line[1:] for line in hunk if line[:1] == " ")]
    with open(diffusion_worker.__file__) as worker_file:
        source = worker_file.read()
    sleep = next(
        node
        for cls in ast.parse(source).body
        if isinstance(cls, ast.ClassDef) and cls.name == "DiffusionWorker"
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and node.name == "sleep"
    )
    body = "\n".join(source.splitlines()[sleep.lineno - 1 : sleep.end_lineno])
    if "\n".join(change) not in body:
        raise pytest.UsageError(f"DiffusionWorker.sleep in {diffusion_worker.__file__} lacks the sleep change")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    upstream = {item.nodeid.split("::", 1)[1]: item for item in items if item.path.name == UPSTREAM_TEST_FILE}
    if not upstream:
        return
    versions = [version for version, changed in CHANGED.items() if set(changed) <= set(upstream)]
    if len(versions) != 1:
        raise pytest.UsageError(
            f"upstream's {UPSTREAM_TEST_FILE} matches {len(versions)} of the known versions "
            f"({', '.join(CHANGED)}): read it, and list the tests whose meaning the change alters"
        )
    _matched.append(versions[0])
    for name, why in CHANGED[versions[0]].items():
        upstream[name].add_marker(
            pytest.mark.xfail(reason=f"meaning changed: {why}", strict=True, raises=AssertionError)
        )


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for version in _matched:
        changed = len(CHANGED[version])
        terminalreporter.write_line(f"upstream's {UPSTREAM_TEST_FILE}: the {version} version, {changed} tests changed")
