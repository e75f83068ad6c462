"""The coverage matrix in docs/coverage.md holds: each claimed row re-runs and gives the same verdict."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("vllm_omni", reason="the coverage matrix runs vLLM-Omni's pipelines")

from vllm_omni_prompt_cache.coverage.__main__ import all_cases
from vllm_omni_prompt_cache.coverage.harness import Case, judge
from vllm_omni_prompt_cache.coverage.paths import build_path

DOC = Path(__file__).resolve().parents[1] / "docs" / "coverage.md"
ROW = re.compile(r"^\| `(?P<pipeline>\w+)` \| (?P<verdict>[^|]+) \| [^|]* \| (?P<whole>[^|]*) \| (?P<rows>[^|]*) \|")


def claimed() -> dict[str, tuple[str, str, str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            rows[match["pipeline"]] = (match["verdict"].strip(), match["whole"].strip(), match["rows"].strip())
    return rows


CASES = {case.pipeline: case for case in all_cases()}
CLAIMED = claimed()


def test_the_table_lists_every_case_and_at_least_twenty_pipelines() -> None:
    assert set(CLAIMED) == set(CASES)
    assert len(CLAIMED) >= 20


@pytest.mark.parametrize("pipeline", sorted(name for name, case in CASES.items() if isinstance(case, Case)))
def test_a_claimed_row_holds(pipeline: str) -> None:
    verdict = judge(CASES[pipeline])
    yes = {True: "yes", False: "no"}
    assert (verdict.verdict, yes[verdict.whole_call_hit], yes[verdict.rows]) == CLAIMED[pipeline], verdict.reason


def test_the_switch_reaches_every_pipelines_stage_on_either_builder() -> None:
    said = {pipeline: build_path(pipeline) for pipeline in CASES}
    assert all("switch reached" in line and "LOST" not in line for line in said.values()), said
    assert "registered `wan2_2_ti2v`, switch reached" in said["Wan22Pipeline"]  # the path that dropped it
