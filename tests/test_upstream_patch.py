"""The upstream series in ``upstream/series``: ``upstream/check.sh`` on a copy of the installed vLLM-Omni
(each PR applied on its predecessor, its tests and a rollout through the real engine at every step), the
PR texts, and upstream's public contract, which the stock module, every step and this plugin keep."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("vllm_omni", reason="the upstream series is checked against the vllm-omni extra")

from vllm_omni_prompt_cache.vllm_omni import bindings

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = ROOT / "upstream"
CHECK = UPSTREAM / "check.sh"
RESULTS = ROOT / "benchmarks" / "results" / "upstream_series.md"


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


SERIES = _load(UPSTREAM / "check" / "run_series.py", "upstream_run_series")
CHECK_PLUGIN = _load(UPSTREAM / "check" / "check_plugin.py", "upstream_check_plugin")
CONTRACT = _load(UPSTREAM / "check" / "test_public_contract.py", "upstream_public_contract")
STEPS = SERIES.series_steps()
STEP_OF_CHANGED = {name: number for number, tests in CHECK_PLUGIN.CHANGED["vLLM-Omni 0.30"].items() for name in tests}


def _installed_package() -> Path:
    return Path(importlib.util.find_spec("vllm_omni").origin).parent


def _run_check(*arguments: str) -> subprocess.CompletedProcess:
    command = ["bash", str(CHECK), "--python", sys.executable, *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=1500, env=dict(os.environ))


def _stand_in_upstream_tests(body_of: dict[str, str]) -> str:
    """A file shaped like upstream's 0.30 test file: the tests the check expects a PR to change, each
    with a body that holds before that PR and fails on an assertion from it on (or the body given).
    Not upstream's code: only its test names, by which the check recognises the version."""
    before = {
        1: "assert _hashable(torch.zeros(2)) is _NOT_HASHABLE",
        3: "assert _hashable(value) == value if value is not None else _hashable(np.float64(1.5)) == 1.5",
    }
    lines = [
        "import numpy as np",
        "import pytest",
        "import torch",
        "from vllm_omni.diffusion.cache.prompt_embed_cache import _NOT_HASHABLE, _hashable",
    ]
    classes: dict[str, list[str]] = {}
    for name, step in STEP_OF_CHANGED.items():
        cls, test = name.split("::")
        test = test.split("[")[0]
        if f"def {test}(" in "".join(classes.get(cls, [])):
            continue
        parametrize = "    @pytest.mark.parametrize('value', [0, 1, -5, 3.14, True, False])\n" if "[" in name else ""
        args = "self, value" if "[" in name else "self, value=None"
        body = body_of.get(test, before[step])
        classes.setdefault(cls, []).append(f"{parametrize}    def {test}({args}):\n        {body}\n")
    for cls, tests in classes.items():
        lines.append(f"\n\nclass {cls}:\n" + "\n".join(tests))
    return "\n".join(lines) + "\n"


@dataclass
class SeriesRun:
    result: subprocess.CompletedProcess
    lines: dict[str, str]  # "stock" or a step's label -> the line check.sh printed for it


@pytest.fixture(scope="module")
def series_run(tmp_path_factory: pytest.TempPathFactory) -> SeriesRun:
    """check.sh on a copy of the installed package: every PR, a 2 x 4 rollout at each step, and a
    stand-in of upstream's test file whose listed tests must turn into expected failures on time."""
    stand_in = tmp_path_factory.mktemp("upstream") / "test_prompt_embed_cache.py"
    stand_in.write_text(_stand_in_upstream_tests({}))
    result = _run_check("--rollout", "2x4x2", "--upstream-tests", str(stand_in))
    lines = {}
    for line in result.stdout.splitlines():
        match = re.match(r"vLLM-Omni [^,]+, (stock|PR \d+ [a-z-]+): ", line)
        if match:
            lines[match.group(1)] = line
    return SeriesRun(result, lines)


@pytest.mark.engine
def test_check_applies_and_tests_every_pr_on_its_predecessor(series_run: SeriesRun) -> None:
    result = series_run.result
    assert result.returncode == 0, (result.stdout + result.stderr)[-8000:]
    assert list(series_run.lines) == ["stock", *(step.label for step in STEPS)]
    version = importlib.metadata.version("vllm-omni")
    for step in STEPS:
        line = series_run.lines[step.label]
        assert line.startswith(f"vLLM-Omni {version}, {step.label}: applied, no fuzz"), line
        assert re.search(r"; tests \d+ passed", line) and " failed" not in line, line
        changed = sum(1 for name, number in STEP_OF_CHANGED.items() if number <= step.number)
        if changed:
            assert f"{changed} xfailed" in line and f"0.30 version, {changed} tests changed" in line, line
        else:
            assert "xfailed" not in line, line


@pytest.mark.engine
def test_the_first_pr_alone_brings_the_rollout_to_one_encode_per_prompt(series_run: SeriesRun) -> None:
    """2 prompts x 4 siblings with a shared negative prompt: 16 encodes uncached, 3 distinct texts."""
    stock = series_run.lines["stock"]
    assert "no cache 16 encodes; stock cache rollout: 16 encodes, 0 hits, 0 misses, 16 bypassed" in stock, stock
    first = series_run.lines[STEPS[0].label]
    assert "rollout: 3 encodes (before this PR 16), 13 hits, 3 misses, 0 bypassed" in first, first
    for step in STEPS:
        assert "latents identical to no cache 8/8" in series_run.lines[step.label]


@pytest.mark.engine
def test_sleep_empties_the_cache_from_the_second_pr_on(series_run: SeriesRun) -> None:
    entries_after_sleep = {
        step.number: re.search(r"sleep\(level=1\): (\d+) -> (\d+) entries", series_run.lines[step.label]).groups()
        for step in STEPS
    }
    kept, _ = entries_after_sleep[1]
    assert entries_after_sleep[1] == (kept, kept) and int(kept) > 0  # PR 1 alone: sleep keeps the entries
    assert all(after == "0" for number, (_, after) in entries_after_sleep.items() if number >= 2)


def test_a_changed_upstream_test_that_passes_or_errors_fails_the_check(tmp_path: Path) -> None:
    stand_in = tmp_path / "test_prompt_embed_cache.py"
    stand_in.write_text(
        _stand_in_upstream_tests(
            {
                "test_tensor_is_not_hashable": "pass",  # passes where PR 1 changed its meaning
                # holds on the stock module, errors (not an assertion) once tensors are keyed
                "test_numpy_ndarray_is_not_hashable": (
                    "assert _hashable(torch.zeros(2)) is _NOT_HASHABLE or __import__('no_such_module')"
                ),
            }
        )
    )
    result = _run_check("--upto", "1", "--rollout", "none", "--upstream-tests", str(stand_in))
    assert result.returncode == 1, result.stdout[-3000:]
    failed = {line.split()[1].split("::")[-1] for line in result.stdout.splitlines() if line.startswith("FAILED ")}
    assert failed == {"test_tensor_is_not_hashable", "test_numpy_ndarray_is_not_hashable"}, result.stdout[-3000:]
    assert "[XPASS(strict)] meaning changed" in result.stdout
    assert "ModuleNotFoundError: No module named 'no_such_module'" in result.stdout


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--rollout", "abc"], "--rollout 'abc': expected PROMPTSxSIBLINGS"),
        (["--rollout", "0x16"], "--rollout '0x16'"),
        (["--upto", "9"], "--upto 9: the series has PRs 1.."),
        (["--upstream-tests", "/no/such/file.py"], "--upstream-tests /no/such/file.py: no such file"),
    ],
)
def test_check_refuses_bad_arguments(arguments: list[str], message: str) -> None:
    result = _run_check(*arguments)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_the_second_pr_applies_and_passes_without_the_first(tmp_path: Path) -> None:
    """The clear before sleep is #6952's change: it must stand on the stock module alone."""
    root = SERIES.build_tree(_installed_package(), tmp_path / "tree", [STEPS[1]])
    environment = dict(os.environ, VLLM_OMNI_PROMPT_CACHE_PLUGIN="0", PYTHONPATH=str(root))
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-W",
        "ignore::pytest.PytestUnknownMarkWarning",
    ]
    result = subprocess.run([*command, "tests"], capture_output=True, text=True, cwd=root, env=environment, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(r"\b4 passed\b", result.stdout), result.stdout[-1000:]


def test_the_installed_package_is_never_changed(tmp_path: Path) -> None:
    installed = _installed_package() / "diffusion" / "cache" / "prompt_embed_cache.py"
    before = installed.read_bytes()
    module = SERIES.step_module(_installed_package(), tmp_path, len(STEPS))
    assert module.read_bytes() != before and installed.read_bytes() == before


def test_the_first_pr_is_small() -> None:
    """The fix alone: well under 200 changed lines in the module (the issue's aim)."""
    added, removed = SERIES.changed_lines(STEPS[0].patch)[SERIES.MODULE]
    assert added + removed < 200


def test_every_step_needs_nothing_vllm_does_not_install(tmp_path: Path) -> None:
    from packaging.requirements import Requirement

    tree = ast.parse(SERIES.step_module(_installed_package(), tmp_path, len(STEPS)).read_text())
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


def test_each_pr_text_follows_the_template_and_lists_the_upstream_tests_it_changes() -> None:
    for step in STEPS:
        text = (step.patch.parent / "PR.md").read_text()
        headings = re.findall(r"^## (.+)$", text, flags=re.M)
        assert headings[:3] == ["Purpose", "Test Plan", "Test Result"], (step.label, headings)
        assert text.startswith("# ["), step.label  # a title with one of vLLM-Omni's prefixes
        for version in CHECK_PLUGIN.CHANGED.values():
            for name in version.get(step.number, {}):
                assert name.split("[")[0] in text, (step.label, name)


def test_pr_texts_quote_only_what_the_recorded_check_printed() -> None:
    """Each PR text's Test Result quotes check.sh lines; each must be a line of the recorded full run."""
    recorded = RESULTS.read_text()
    for step in STEPS:
        text = (step.patch.parent / "PR.md").read_text()
        result = text.split("## Test Result", 1)[1]
        quoted = [line for block in re.findall(r"```text\n(.*?)```", result, flags=re.S) for line in block.splitlines()]
        assert quoted, step.label
        for line in quoted:
            assert line in recorded, (step.label, line)


# Upstream's public contract, held by every implementation a pipeline may be given.

_IMPLEMENTATIONS = ["stock", *(f"PR {step.number}" for step in STEPS), "plugin"]


@pytest.fixture(params=_IMPLEMENTATIONS)
def implementation(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    if request.param == "stock":
        return bindings.upstream_cache_module()
    if request.param == "plugin":
        from vllm_omni.plugins import load_omni_general_plugins

        load_omni_general_plugins()  # the plugin rebinds the real module's names to this package's
        import vllm_omni.diffusion.cache.prompt_embed_cache as module

        return module
    number = int(request.param.split()[1])
    path = SERIES.step_module(_installed_package(), tmp_path_factory.mktemp(f"pr{number}"), number)
    return _load(path, f"upstream_series_pr{number}_prompt_embed_cache")


@pytest.fixture
def tensor_keys(request: pytest.FixtureRequest) -> bool:
    return request.node.callspec.params["implementation"] != "stock"


test_public_names_and_signatures = CONTRACT.test_public_names_and_signatures
test_store_contract = CONTRACT.test_store_contract
test_wrapper_contract = CONTRACT.test_wrapper_contract
test_an_encode_that_counts_its_calls_on_self_is_cached = CONTRACT.test_an_encode_that_counts_its_calls_on_self_is_cached
test_config_contract = CONTRACT.test_config_contract
test_token_id_tensors_hit_where_tensors_are_keyed = CONTRACT.test_token_id_tensors_hit_where_tensors_are_keyed
_no_cache_env = CONTRACT._no_cache_env
