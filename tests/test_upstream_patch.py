"""The upstream change in ``upstream/``: its check script on a copy of the installed vLLM-Omni 0.30, and
upstream's public contract, which the proposed module, the stock module and this plugin all keep."""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

pytest.importorskip("vllm_omni", reason="the upstream change is checked against the vllm-omni extra")

from vllm_omni_prompt_cache.vllm_omni import bindings

UPSTREAM = Path(__file__).resolve().parent.parent / "upstream"
PROPOSED = UPSTREAM / "vllm_omni" / "diffusion" / "cache" / "prompt_embed_cache.py"
CHECK = UPSTREAM / "check.sh"
ENV_VARS = (
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_MAX_BYTES",
)


def _installed_package() -> Path:
    return Path(importlib.util.find_spec("vllm_omni").origin).parent


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECK_PLUGIN = _load(UPSTREAM / "check" / "check_plugin.py", "upstream_check_plugin")


def _run_check(target: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(CHECK), str(target)], capture_output=True, text=True, env=env, timeout=600)


def _stand_in_upstream_tests(body_of: dict[str, str]) -> str:
    """Write a file shaped like upstream's 0.30 test file: the tests the check expects to change, each
    with the given body (default: an assertion that fails on the proposed module). Not upstream's
    code: only its test names, which the check recognises a version by."""
    default = "assert _hashable(torch.zeros(2)) is _NOT_HASHABLE"
    lines = [
        "import pytest",
        "import torch",
        "from vllm_omni.diffusion.cache.prompt_embed_cache import _NOT_HASHABLE, _hashable",
    ]
    classes: dict[str, list[str]] = {}
    for name in CHECK_PLUGIN.CHANGED["vLLM-Omni 0.30"]:
        cls, test = name.split("::")
        test = test.split("[")[0]
        if f"def {test}(" in "".join(classes.get(cls, [])):
            continue
        parametrize = "    @pytest.mark.parametrize('value', [0, 1, -5, 3.14, True, False])\n" if "[" in name else ""
        args = "self, value" if "[" in name else "self"
        body = body_of.get(test, default)
        classes.setdefault(cls, []).append(f"{parametrize}    def {test}({args}):\n        {body}\n")
    for cls, tests in classes.items():
        lines.append(f"\n\nclass {cls}:\n" + "\n".join(tests))
    return "\n".join(lines) + "\n"


@dataclass
class CheckRuns:
    """check.sh run three times on one copy of the installed package, and what was seen after the first run."""

    copy: Path
    installed_before: str  # the installed module's hash before anything ran
    first: subprocess.CompletedProcess  # on the wheel's tree as copied
    module_after_first: str  # the copy's module's hash after the first run
    worker_after_first: str  # the copy's worker's source after the first run
    installed_after_first: str
    second: subprocess.CompletedProcess  # with a stand-in upstream test file, every listed test failing
    third: subprocess.CompletedProcess  # with one listed test passing and one failing on an import


def check_three_times(scratch: Path) -> CheckRuns:
    """Copy the installed package and run check.sh on the copy three times (the test's steps, in order)."""
    installed = _installed_package()
    installed_module = installed / "diffusion" / "cache" / "prompt_embed_cache.py"
    before = _sha(installed_module)
    copy = scratch / "vllm_omni"
    # With its compiled bytecode (copytree keeps the sources' times, so it stays valid): the four
    # interpreters that import the copy need not compile it again, and the two files check.sh
    # replaces get new times, so Python compiles those afresh.
    shutil.copytree(installed, copy)
    first = _run_check(copy)
    seen_after_first = (
        _sha(copy / "diffusion" / "cache" / "prompt_embed_cache.py"),
        (copy / "diffusion" / "worker" / "diffusion_worker.py").read_text(),
        _sha(installed_module),
    )
    upstream_tests = copy.parent / "tests" / "diffusion" / "cache" / "test_prompt_embed_cache.py"
    upstream_tests.parent.mkdir(parents=True, exist_ok=True)  # check.sh makes it; not if the first run failed early
    upstream_tests.write_text(_stand_in_upstream_tests({}))
    second = _run_check(copy)
    upstream_tests.write_text(
        _stand_in_upstream_tests(
            {"test_numpy_scalar_is_unwrapped": "pass", "test_numpy_ndarray_is_not_hashable": "import no_such_module"}
        )
    )
    third = _run_check(copy)
    return CheckRuns(copy, before, first, *seen_after_first, second, third)


@pytest.fixture(scope="module")
def check_runs(tmp_path_factory: pytest.TempPathFactory) -> CheckRuns:
    """The three runs of check.sh, once for the module: both tests below read them."""
    return check_three_times(tmp_path_factory.mktemp("upstream"))


def test_check_script_on_a_copy_of_the_installed_package(check_runs) -> None:
    """The three runs of check.sh run in this order before the assertions (see ``check_three_times``);
    what the first left in the copy is read right after it."""
    result, before = check_runs.first, check_runs.installed_before

    # A wheel's tree: no upstream test file, ours only.
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed, 1 skipped in [\d.]+s", summary), summary  # skipped: the CUDA test
    assert "running ours only" in output
    assert check_runs.module_after_first == _sha(PROPOSED)
    assert "clear_prompt_embed_cache()" in check_runs.worker_after_first
    assert check_runs.installed_after_first == before  # the installed package every other test imports is untouched

    # Run again with a file where upstream's is: the worker is already patched, and the listed tests
    # are recognised as the 0.30 version's and must fail on an assertion.
    result = check_runs.second
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "already has the sleep change" in output
    assert "the vLLM-Omni 0.30 version, 13 tests changed" in output
    assert re.search(r" 13 xfailed in ", result.stdout), result.stdout[-2000:]

    # A listed test that passes, or fails on something else than an assertion, fails the run.
    result = check_runs.third
    assert result.returncode != 0
    # "FAILED <node id>", with " - <reason>" after it where pytest does not truncate (CI=true)
    failed = {line.split()[1].split("::")[-1] for line in result.stdout.splitlines() if line.startswith("FAILED ")}
    assert failed == {"test_numpy_scalar_is_unwrapped", "test_numpy_ndarray_is_not_hashable"}, result.stdout[-3000:]
    assert "[XPASS(strict)] meaning changed" in result.stdout
    assert "ModuleNotFoundError: No module named 'no_such_module'" in result.stdout


def rollout_on_the_checked_copy(copy: Path, scratch: Path) -> tuple[subprocess.CompletedProcess, str | None]:
    """Run ``benchmarks/upstream_rollout.py`` on the checked copy; return the run and its table (None if unwritten)."""
    table = scratch / "rollout.md"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "upstream_rollout.py"
    arguments = [str(copy), "--prompts", "2", "--group-size", "4", "--steps", "2", "--write", str(table)]
    run = subprocess.run(
        [sys.executable, str(script), *arguments],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )
    return run, table.read_text() if table.is_file() else None


@pytest.mark.engine
def test_the_proposed_module_serves_a_rollout_through_the_real_engine(check_runs, tmp_path) -> None:
    """vLLM-Omni's own runner installs the proposed module (plugin off); the patched worker clears it on sleep."""
    assert check_runs.first.returncode == 0
    run, report = rollout_on_the_checked_copy(check_runs.copy, tmp_path)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    # 2 prompts x 4 siblings, each with the shared negative prompt: 16 calls, 3 distinct prompts.
    assert "| none | 16 | 16 | - | - | - |" in report
    assert "| proposed module | 3 | 3 | 13 | 3 | 0 |" in report
    assert "identical to the uncached run: 8 of 8 requests" in report
    assert re.search(r"to 0 entries \(0 bytes\)", report), report


@pytest.mark.parametrize("kind", ["installed", "not a package"])
def test_check_script_refuses_what_it_must_not_change(tmp_path: Path, kind: str) -> None:
    target = _installed_package() if kind == "installed" else tmp_path
    result = _run_check(target)
    assert result.returncode == 2
    assert ("installed package" if kind == "installed" else "is not a vllm_omni package directory") in result.stderr


def test_the_proposed_module_needs_nothing_vllm_does_not_install() -> None:
    from packaging.requirements import Requirement

    tree = ast.parse(PROPOSED.read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    third_party = imported - set(sys.stdlib_module_names) - {"__future__"}
    assert third_party == {"numpy", "torch", "vllm", "xxhash", "blake3"}
    required = {Requirement(requirement).name for requirement in importlib.metadata.requires("vllm")}
    assert {"numpy", "torch", "blake3"} <= required  # xxhash is optional: blake3 stands in without it


def test_pr_description_explains_every_changed_upstream_test() -> None:
    description = (UPSTREAM / "PR.md").read_text()
    for changed in CHECK_PLUGIN.CHANGED.values():
        for name in changed:
            assert name.split("[")[0] in description, name
            if "[" in name:
                assert f"`[{name.split('[')[1]}`" in description, name


# Upstream's public contract, held by every implementation a pipeline may be given.


@pytest.fixture(params=["stock 0.30", "proposed", "plugin"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    if request.param == "stock 0.30":
        return bindings.upstream_cache_module()
    if request.param == "proposed":
        return _load(PROPOSED, "proposed_prompt_embed_cache")
    from vllm_omni.plugins import load_omni_general_plugins

    load_omni_general_plugins()  # the plugin rebinds the real module's names to this package's
    import vllm_omni.diffusion.cache.prompt_embed_cache as module

    return module


#: Each pipeline's encode count, kept outside it: an instrument, not state its encode reads (this
#: package keys an encode on the pipeline state it reads, and a counter on the instance would be such state).
_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Pipeline:
    @property
    def calls(self) -> int:
        return _CALLS.get(self, 0)

    def encode_prompt(self, prompt, device=None, num_images_per_prompt: int = 1, prompt_embeds=None):
        _CALLS[self] = self.calls + 1
        return torch.full((num_images_per_prompt, 2), float(len(prompt)))


def test_public_names_and_signatures(implementation: ModuleType) -> None:
    install = inspect.signature(implementation.install_prompt_embed_cache).parameters
    assert list(install)[:4] == ["pipeline", "max_size", "enabled", "model_tag"]
    assert (install["max_size"].default, install["enabled"].default, install["model_tag"].default) == (32, True, None)
    assert all(p.default is not p.empty for name, p in install.items() if name != "pipeline")
    resolve = inspect.signature(implementation.resolve_prompt_embed_cache_config).parameters
    assert list(resolve) == ["enable", "max_size"]
    assert list(inspect.signature(implementation.uninstall_prompt_embed_cache).parameters) == ["pipeline"]
    assert implementation._CACHE_MISS is not None


def test_store_contract(implementation: ModuleType) -> None:
    cache = implementation.PromptEmbedCache(max_size=2)
    miss = implementation._CACHE_MISS
    assert cache.get("a") is miss
    cache.put("a", None)  # a cached None is a hit
    assert cache.get("a") is None
    cache.put("b", 2)
    cache.get("a")  # "a" becomes most recent
    cache.put("c", 3)  # evicts "b"
    assert cache.get("b") is miss and cache.get("c") == 3
    cache.put("c", 4)
    assert cache.get("c") == 4
    stats = cache.stats()
    assert {"size", "max_size", "hits", "misses", "bypassed"} <= set(stats)
    assert (stats["size"], stats["max_size"], stats["hits"], stats["misses"]) == (2, 2, 4, 2)
    with cache._lock:  # how upstream's wrapper counts a bypass
        cache.bypassed += 1
    cache.clear()
    assert cache.stats()["size"] == 0 and cache.stats()["hits"] == 4 and cache.stats()["bypassed"] == 1
    for bad in (0, -1):
        with pytest.raises(ValueError):
            implementation.PromptEmbedCache(max_size=bad)


def test_wrapper_contract(implementation: ModuleType) -> None:
    assert implementation.install_prompt_embed_cache(object()) is None
    pipeline = _Pipeline()
    cache = implementation.install_prompt_embed_cache(pipeline, max_size=4, model_tag="t")
    assert implementation.install_prompt_embed_cache(pipeline, max_size=16) is cache and cache.max_size == 4
    first = pipeline.encode_prompt("a red fox")
    assert torch.equal(pipeline.encode_prompt(prompt="a red fox"), first)
    pipeline.encode_prompt("a red fox", prompt_embeds=torch.zeros(1))  # precomputed: bypassed
    assert (pipeline.calls, cache.stats()["hits"], cache.stats()["bypassed"]) == (2, 1, 1)
    cache.enabled = False
    pipeline.encode_prompt("a red fox")
    assert pipeline.calls == 3 and cache.stats()["hits"] == 1
    implementation.uninstall_prompt_embed_cache(pipeline)
    pipeline.encode_prompt("a red fox")
    assert pipeline.calls == 4 and getattr(pipeline, "_prompt_embed_cache", None) is None
    implementation.uninstall_prompt_embed_cache(_Pipeline())  # not wrapped: nothing to do


def test_config_contract(implementation: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    resolve = implementation.resolve_prompt_embed_cache_config
    assert resolve() == (False, 32)
    assert resolve(enable=True, max_size=8) == (True, 8)
    monkeypatch.setenv("OMNI_DIFFUSION_PROMPT_EMBED_CACHE", "off")
    monkeypatch.setenv("OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE", "7")
    assert resolve(enable=True, max_size=99) == (False, 7)


def test_token_id_tensors_hit_except_on_the_stock_module(implementation: ModuleType, request) -> None:
    """The behaviour the change is for: K fresh id tensors of one prompt, one encode."""

    class TokenIdPipeline:
        calls = 0

        def encode_prompt(self, prompt_ids, attention_mask=None):
            TokenIdPipeline.calls += 1
            return prompt_ids.float() * attention_mask

    pipeline = TokenIdPipeline()
    cache = implementation.install_prompt_embed_cache(pipeline)
    ids = torch.tensor([[5, 6, 7, 0]])
    for _ in range(8):
        pipeline.encode_prompt(ids.clone(), attention_mask=(ids != 0).clone())
    stock = request.node.callspec.params["implementation"] == "stock 0.30"
    assert TokenIdPipeline.calls == (8 if stock else 1)
    assert cache.stats()["bypassed"] == (8 if stock else 0)
