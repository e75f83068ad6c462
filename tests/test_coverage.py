"""The coverage matrix in docs/coverage.md holds: each claimed row re-runs and gives the same verdict,
and its rows are exactly the classes the installed vLLM-Omni ships with an encode method the cache wraps.

The cases run in a subprocess, as the script does: several text stacks need vLLM's tensor-parallel
layers, whose one-rank process group would outlive them and break the in-process engines of later
tests. The same process enumerates the classes (``prompt_cache_coverage/classes.py``), after the cases. The
matrix is a developer's tool outside the wheel: it imports from the repository root.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm_omni", reason="the coverage matrix runs vLLM-Omni's pipelines")

from prompt_cache_coverage.__main__ import all_cases
from prompt_cache_coverage.harness import NotBuilt

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "coverage.md"
ROW = re.compile(r"^\| `(?P<pipeline>\w+)` \| (?P<verdict>[^|]+) \| [^|]* \| (?P<whole>[^|]*) \| (?P<rows>[^|]*) \|")


def claimed() -> dict[str, tuple[str, str, str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            rows[match["pipeline"]] = (match["verdict"].strip(), match["whole"].strip(), match["rows"].strip())
    return rows


CLAIMED = claimed()
PIPELINES = sorted(case.pipeline for case in all_cases())


def judge_every_case() -> subprocess.CompletedProcess:
    """Judge every case afresh and resolve every build path, in a process of their own."""
    return subprocess.run(
        [sys.executable, "-m", "prompt_cache_coverage", "--json"],
        cwd=ROOT,  # where prompt_cache_coverage imports from
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, VLLM_OMNI_PROMPT_CACHE_CPU_PLATFORM="1"),
    )


@pytest.fixture(scope="module")
def measured() -> dict:
    """Every case judged afresh, and every build path resolved, in a process of their own."""
    result = judge_every_case()
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_table_lists_every_case_and_at_least_twenty_pipelines() -> None:
    assert len(set(PIPELINES)) == len(PIPELINES), "a class with two cases"
    assert sorted(CLAIMED) == PIPELINES
    assert len(CLAIMED) >= 20


def test_every_class_vllm_omni_ships_has_a_case_and_every_case_a_class(measured) -> None:
    enumerated = measured["enumerated"]["classes"]
    missing = sorted(set(enumerated) - set(PIPELINES))
    assert not missing, f"classes with neither a Case nor a NotBuilt: {[enumerated[name] for name in missing]}"
    assert not sorted(set(PIPELINES) - set(enumerated)), "cases naming no class the installed vLLM-Omni ships"


def test_every_not_built_class_says_why() -> None:
    unexplained = [case.pipeline for case in all_cases() if isinstance(case, NotBuilt) and not case.reason.strip()]
    assert not unexplained


def test_no_module_the_enumeration_could_not_import_defines_an_encode_method(measured) -> None:
    unimportable = measured["enumerated"]["unimportable"]
    hiding = {module: broken for module, broken in unimportable.items() if broken["encode_methods"]}
    assert not hiding, f"modules that did not import here would add classes: {hiding}"
    assert len(unimportable) <= 3, f"more model modules fail to import than expected: {sorted(unimportable)}"


def test_every_claimed_row_holds(measured) -> None:
    yes = {True: "yes", False: "no"}
    found = {}
    for verdict in measured["verdicts"]:
        built = verdict["verdict"] != "not built"
        found[verdict["pipeline"]] = (
            verdict["verdict"],
            yes[verdict["whole_call_hit"]] if built else "",
            yes[verdict["rows"]] if built else "",
        )
    assert found == CLAIMED


def test_the_switch_reaches_every_pipelines_stage_on_either_builder(measured) -> None:
    said = measured["paths"]
    assert sorted(said) == PIPELINES
    segments = [segment for line in said.values() for segment in line.split("; ")]  # one per architecture
    assert all(segment.endswith("switch reached") for segment in segments), said
    assert "registered `wan2_2_ti2v`, switch reached" in said["Wan22Pipeline"]  # the path that dropped it


def test_the_summary_line_counts_the_table(measured) -> None:
    from prompt_cache_coverage.__main__ import BEGIN, summary
    from prompt_cache_coverage.harness import Verdict

    written = DOC.read_text().split(BEGIN, 1)[1].strip().splitlines()[0]
    assert written == summary([Verdict(**verdict) for verdict in measured["verdicts"]])
