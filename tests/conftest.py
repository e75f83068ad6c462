"""Test-wide set-up: where no GPU is visible, the engine tests run vLLM-Omni on our CPU platform.

The platform is chosen when vLLM is first imported, so the opt-in is decided here, before any
test module imports vLLM. On a machine with CUDA it stays off and the engine tests use the GPU
(the CPU-platform tests skip there). An explicit VLLM_OMNI_PROMPT_CACHE_CPU_PLATFORM wins.
"""

from __future__ import annotations

import functools
import gc
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # Several workers share the cores: one thread each (and in each process they start), or the
    # OpenMP pools of two workers spin against each other. Set before torch is first imported.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from vllm_omni_prompt_cache.cpu_platform.entry_points import opt_in_where_no_gpu

opt_in_where_no_gpu()
ROOT = Path(__file__).resolve().parent.parent
# Keep the engine's own logs readable in failures: no colour codes, no usage stats.
os.environ.setdefault("VLLM_LOGGING_COLOR", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


#: A fixture of one of these scopes, defined in a test module, is shared by several of its tests.
SHARED_FIXTURE = re.compile(r"@pytest\.fixture\([^)]*scope=\"(module|class|package)\"")


@functools.cache
def shares_fixtures(module: str) -> bool:
    """Return whether the test module at ``module`` (a path from the root) defines a shared fixture."""
    return bool(SHARED_FIXTURE.search((ROOT / module).read_text()))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Hand out a module that defines a shared fixture (an engine, a server) whole, to one worker, and every
    other test on its own, in collection order: a shared fixture is then made once, and single tests fill
    both cores to the end. (pytest-xdist's ``loadgroup`` would do it from markers, but its marker handling
    does not reach the scheduler under pytest 9.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesWithSharedFixtures(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return module if shares_fixtures(module) else nodeid

    return ModulesWithSharedFixtures(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the modules with the most engine tests first, keeping each module's own order: the
    scheduler above hands work out in this order, so the long engine modules start first."""
    engine_tests: dict[str, int] = {}  # by module, in collection order
    for item in items:
        module = item.nodeid.split("::")[0]
        engine_tests[module] = engine_tests.get(module, 0) + (item.get_closest_marker("engine") is not None)
    order = {module: (-count, index) for index, (module, count) in enumerate(engine_tests.items())}
    items.sort(key=lambda item: order[item.nodeid.split("::")[0]])


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the main process (or the only one): every report reached it
        release_record.write()


#: The key of a release fact among a test report's user properties, which pytest-xdist's workers send
#: to the main process with the report.
RELEASE_FACT = "release fact"


@pytest.fixture
def record_release_fact(request: pytest.FixtureRequest):
    """Keep a fact a release test measured (counts of a rollout) for the support table (see noxfile.py)."""

    def record(name: str, value: object) -> None:
        request.node.user_properties.append((RELEASE_FACT, (name, value)))

    return record


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    release_record.outcome(report)


class _ReleaseRecord:
    """What the release matrix keeps of a run: versions, features, facts and outcomes, written as JSON
    where ``PROMPT_CACHE_RELEASE_RECORD`` names a file (``nox -s releases`` sets it)."""

    def __init__(self) -> None:
        self.facts: dict[str, object] = {}
        self.outcomes: dict[str, str] = {}

    def outcome(self, report: pytest.TestReport) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome
        for key, value in report.user_properties:
            if key == RELEASE_FACT:
                name, fact = value
                self.facts[name] = fact

    def write(self) -> None:
        path = os.environ.get("PROMPT_CACHE_RELEASE_RECORD")
        if not path:
            return
        import importlib.metadata
        import json

        from vllm_omni_prompt_cache.vllm_omni import hook_points

        missing = hook_points.missing_by_feature()
        features = {
            feature: {
                "on": not missing[feature] and not missing[hook_points.CACHE],
                "missing": [str(point) for point in missing[feature]],
            }
            for feature in hook_points.FEATURES
        }
        versions = {name: importlib.metadata.version(name) for name in ("vllm-omni", "vllm", "torch")}
        record = {
            "versions": versions,
            "features": features,
            "settings_route": getattr(hook_points.found_choice(hook_points.KWARGS_BUILDER), "dotted", None),
            "facts": self.facts,
            "outcomes": self.outcomes,
        }
        with open(path, "w") as file:
            json.dump(record, file, indent=1)  # in FEATURES' order: the support table keeps it


release_record = _ReleaseRecord()


@pytest.fixture(autouse=True)
def no_audit_failures_carry_over() -> Iterator[None]:
    """A class an audit turns off stays so in the process: start each test afresh."""
    from vllm_omni_prompt_cache.store import audit

    audit.FAILED_CLASSES.clear()
    yield
    audit.FAILED_CLASSES.clear()


@pytest.fixture
def accept_device_reporting_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the key encoder read ``device_reporting.ReportsCudaDevice`` as it reads a plain tensor."""
    from device_reporting import ReportsCudaDevice

    from vllm_omni_prompt_cache.keys import call_key as keys

    monkeypatch.setattr(keys, "_PLAIN_TENSOR_TYPES", (*keys._PLAIN_TENSOR_TYPES, ReportsCudaDevice))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported (vLLM, torch, transformers: about a million objects) out of the
    garbage collector's passes. vLLM-Omni runs ``gc.collect()`` at every model load (three times, in
    vLLM's memory profiler), every engine shutdown and every sleep; over that heap each pass took about
    0.5 s here (docs/benchmarks.md), half of an in-process engine test's time. Objects the tests create
    are collected as before; only cycles among the frozen imports are never freed."""
    gc.freeze()
