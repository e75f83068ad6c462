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
CONTRACT = _load(UPSTREAM / "check" / "test_public_contract.py", "upstream_public_contract")
STEPS = SERIES.series_steps()


def _installed_package() -> Path:
    return Path(importlib.util.find_spec("vllm_omni").origin).parent


def _run_check(*arguments: str) -> subprocess.CompletedProcess:
    command = ["bash", str(CHECK), "--python", sys.executable, *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=1500, env=dict(os.environ))


@dataclass
class SeriesRun:
    result: subprocess.CompletedProcess
    lines: dict[str, str]  # "stock" or a step's label -> the line check.sh printed for it


@pytest.fixture(scope="module")
def series_run(tmp_path_factory: pytest.TempPathFactory) -> SeriesRun:
    """check.sh on a copy of the installed package: every PR, a 2 x 4 rollout at each step. Upstream's test
    files are not in this repository, so the PRs' edits of them are left out here (``upstream/README.md``
    shows the run with them)."""
    result = _run_check("--rollout", "2x4x2")
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
        assert re.search(r"; tests \d+ passed, failed 0", line), line
        for path in SERIES.file_patches(step.patch).keys() & SERIES.UPSTREAM_TEST_PATHS:  # named, not applied here
            assert f"edits upstream's {path} " in line and f"{Path(path).name} not given: not applied" in line, line


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


def test_no_upstream_test_is_run_as_an_expected_failure(tmp_path: Path) -> None:
    """A PR that retires a tested behaviour edits that test; the check holds no list of tests expected to fail,
    and a test that runs as one (an xfail marker in a file) is counted apart, which stops the step."""
    for path in (UPSTREAM / "check").glob("*.py"):
        assert "mark.xfail" not in path.read_text(), path
    report = tmp_path / "report.xml"
    report.write_text(
        '<testsuites><testsuite><testcase classname="t.TestA" name="test_a" file="t.py">'
        '<skipped type="pytest.xfail" message="expected"/></testcase>'
        '<testcase classname="t.TestA" name="test_b" file="t.py"/></testsuite></testsuites>'
    )
    counts, _, failures = SERIES._outcomes(report, tmp_path)
    assert counts == {"xfailed": 1, "passed": 1} and failures == []


def test_the_prs_that_retire_upstream_tests_edit_them_and_name_them() -> None:
    """PRs 1 and 3 change what upstream's tests pin: each edits those tests in upstream's own file, and its text
    names every test it removes or renames; PR 2's sleep tests join upstream's TestDiffusionWorkerSleep."""
    edited = {}
    for step in STEPS:
        pieces = SERIES.file_patches(step.patch)
        text = (step.patch.parent / "PR.md").read_text()
        for path in pieces.keys() & SERIES.UPSTREAM_TEST_PATHS:
            removed = re.findall(r"^-    def (test_\w+)\(", pieces[path], flags=re.M)
            added = re.findall(r"^\+    def (test_\w+)\(", pieces[path], flags=re.M)
            edited[step.number] = (Path(path).name, removed, added)
            assert all(name in text for name in removed + added), (step.label, removed, added)
    assert edited[1][0] == "test_prompt_embed_cache.py" and len(edited[1][1]) == 5
    assert edited[3][0] == "test_prompt_embed_cache.py" and len(edited[3][1]) == 1  # and its parameters
    assert edited[2][0] == "test_diffusion_worker.py" and not edited[2][1] and len(edited[2][2]) == 4
    worker_tests = SERIES.file_patches(STEPS[1].patch)["tests/diffusion/test_diffusion_worker.py"]
    assert "class TestDiffusionWorkerSleep" in worker_tests.split("\n+    def test_", 1)[0]  # the hunk's context
    assert not any(
        path.startswith("tests/") and path not in SERIES.UPSTREAM_TEST_PATHS
        for path in SERIES.file_patches(STEPS[1].patch)
    )  # no test file of its own


def test_a_patch_leaves_out_its_edits_of_upstream_files_the_tree_lacks(tmp_path: Path) -> None:
    root = SERIES.build_tree(_installed_package(), tmp_path / "tree", [])
    said = SERIES.apply(STEPS[0], root)
    assert said.startswith("applied, no fuzz, edits upstream's tests/diffusion/cache/test_prompt_embed_cache.py +")
    assert said.endswith("(test_prompt_embed_cache.py not given: not applied)")
    assert not (root / "tests" / "diffusion" / "cache" / "test_prompt_embed_cache.py").exists()
    assert (root / "tests" / "diffusion" / "cache" / "test_prompt_embed_cache_tensor_keys.py").is_file()


def test_a_patch_already_in_the_tree_is_reported_and_never_undone(tmp_path: Path) -> None:
    """patch --batch alone would take an applied patch for a reversed one and undo it."""
    root = SERIES.build_tree(_installed_package(), tmp_path / "tree", [STEPS[0]])
    module = (root / SERIES.MODULE).read_bytes()
    assert SERIES.apply(STEPS[0], root) == "already in this tree (its reverse applies), skipped"
    assert (root / SERIES.MODULE).read_bytes() == module


def test_the_recorded_run_checked_the_committed_patches() -> None:
    """The PR texts quote benchmarks/results/upstream_series.md: it names each patch by digest, and its line
    counts are those of the patches as committed."""
    recorded = RESULTS.read_text()
    for step in STEPS:
        assert f"PR {step.number} {SERIES.patch_digest(step.patch)}" in recorded, step.label
        lines = SERIES.changed_lines(step.patch)
        added, removed = (sum(counts[i] for counts in lines.values()) for i in (0, 1))
        module_added, module_removed = lines.get(SERIES.MODULE, (0, 0))
        for line in (line for line in recorded.splitlines() if f", {step.label}: " in line):
            assert f"module +{module_added} -{module_removed} " in line and f"all files +{added} -{removed}" in line


def test_only_the_named_class_of_a_newer_upstream_file_runs() -> None:
    """vLLM-Omni main's worker tests import names the wheels lack: the check keeps one class, what it uses."""
    source = (
        "import pytest\nfrom m import A, B, unused_by_class\n\npytestmark = [pytest.mark.cpu]\n\n\n"
        "def helper():\n    return A\n\n\n@pytest.fixture\ndef thing():\n    return helper()\n\n\n"
        "def test_module_level():\n    assert unused_by_class\n\n\n"
        "class FakeRunner:\n    pass\n\n\n"
        "class TestOther:\n    def test_other(self):\n        assert B\n\n\n"
        "class TestKept:\n    def test_kept(self, thing):\n        assert thing is A and FakeRunner\n"
    )
    kept = SERIES.only_class(source, "TestKept")
    tree = ast.parse(kept)
    assert [getattr(node, "name", None) for node in tree.body if not isinstance(node, ast.Assign)] == [
        None,
        None,
        "helper",
        "thing",
        "FakeRunner",  # a helper class stays
        "TestKept",
    ]
    assert "from m import A\n" in kept and "unused_by_class" not in kept and "TestOther" not in kept
    with pytest.raises(SERIES.StepFailed, match="no class TestMissing"):
        SERIES.only_class(source, "TestMissing")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--rollout", "abc"], "--rollout 'abc': expected PROMPTSxSIBLINGS"),
        (["--rollout", "0x16"], "--rollout '0x16'"),
        (["--upto", "9"], "--upto 9: the series has PRs 1.."),
        (["--upstream-tests", "/no/such/file.py"], "--upstream-tests /no/such/file.py: no such file"),
        (
            ["--upstream-tests", __file__],
            "expected one of upstream's test_prompt_embed_cache.py, test_diffusion_worker.py",
        ),
    ],
)
def test_check_refuses_bad_arguments(arguments: list[str], message: str) -> None:
    result = _run_check(*arguments)
    assert result.returncode == 2 and message in result.stderr, result.stderr


# Run in the tree by test_the_second_pr_stands_on_the_stock_module_alone. The allocator and the platform's memory
# queries need CUDA: doubles stand in for them. The worker, the runner's clear and the cache are the tree's own.
_SLEEP_WITH_DOUBLES = """
import sys
from types import SimpleNamespace

import torch

from vllm_omni.diffusion.cache.prompt_embed_cache import install_prompt_embed_cache
from vllm_omni.diffusion.worker import diffusion_worker
from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
from vllm_omni.diffusion.worker.diffusion_worker import DiffusionWorker

assert diffusion_worker.__file__.startswith(sys.argv[1]), diffusion_worker.__file__
events = []


class Pipeline:
    def encode_prompt(self, prompt):
        return torch.ones(1, 4)


class Allocator:
    def get_current_usage(self):
        return 0

    def sleep(self, offload_tags=()):
        events.append(("allocator sleeps", runner.prompt_embed_cache.stats()["size"]))


class Memory:
    def get_free_memory(self, *args):
        return 0

    def get_device_total_memory(self, *args):
        return 0

    def empty_cache(self):
        pass

    def synchronize(self):
        pass


diffusion_worker._get_cumem_allocator_class = lambda: SimpleNamespace(get_instance=Allocator)
diffusion_worker.current_omni_platform = Memory()
runner = DiffusionModelRunner.__new__(DiffusionModelRunner)
runner.prompt_embed_cache = install_prompt_embed_cache(Pipeline())
runner._kv_receive_progress = None
worker = DiffusionWorker.__new__(DiffusionWorker)
worker.rank, worker.device, worker.od_config = 0, torch.device("cpu"), SimpleNamespace()
worker.model_runner, worker._sleep_saved_buffers = runner, {}
runner.prompt_embed_cache.put("cat", torch.ones(1))
worker.sleep(level=1)
print("cache size when the allocator slept:", events[-1][1])


def failing_clear():
    raise OSError("device lost")


runner.clear_prompt_embed_cache = failing_clear
try:
    worker.sleep(level=1)
except RuntimeError as error:
    print("a failed clear:", error, "| cause:", type(error.__cause__).__name__, "| allocator sleeps:", len(events))
"""


@pytest.mark.parametrize("steps", [[], [2]], ids=["stock", "PR 2 alone"])
def test_the_second_pr_stands_on_the_stock_module_alone(tmp_path: Path, steps: list[int]) -> None:
    """The clear before sleep (#6952's change, superseded by PR 2) applies and works without PR 1; the stock
    worker sleeps with the cache full."""
    root = SERIES.build_tree(_installed_package(), tmp_path / "tree", [STEPS[number - 1] for number in steps])
    environment = dict(os.environ, VLLM_OMNI_PROMPT_CACHE_PLUGIN="0", PYTHONPATH=str(root))
    command = [sys.executable, "-c", _SLEEP_WITH_DOUBLES, str(root)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=root, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    if not steps:
        assert "cache size when the allocator slept: 1" in result.stdout, result.stdout
        assert "a failed clear" not in result.stdout  # the stock worker never calls it
        return
    assert "cache size when the allocator slept: 0" in result.stdout, result.stdout
    assert (
        "a failed clear: Sleep aborted: clearing the prompt-embedding cache failed: device lost | cause: OSError"
        " | allocator sleeps: 1"
    ) in result.stdout, result.stdout


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
    assert third_party == {"numpy", "torch", "vllm", "blake3"}  # one digest, blake3, in every install
    requirements = [Requirement(requirement) for requirement in importlib.metadata.requires("vllm")]
    required = {r.name for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})}
    assert third_party - {"vllm"} <= required


def test_each_pr_text_follows_the_template() -> None:
    for step in STEPS:
        text = (step.patch.parent / "PR.md").read_text()
        headings = re.findall(r"^## (.+)$", text, flags=re.M)
        assert headings[:3] == ["Purpose", "Test Plan", "Test Result"], (step.label, headings)
        assert text.startswith("# ["), step.label  # a title with one of vLLM-Omni's prefixes


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
