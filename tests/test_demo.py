"""The main job at a tiny size, end to end through the real AsyncOmni engine on CPU: kwargs -> worker ->
runner -> cache, for every mode at two ``max_num_seqs``.

One demo run (``vllm-omni-prompt-cache demo``: 2 prompts x 4 concurrent sibling requests, each with
its own seed, fresh token-ID tensors and a shared negative prompt, CFG on) starts one engine per mode
and ``max_num_seqs``; the tests read what it printed and wrote, and the results it computed on the way
(``run_mode``'s return values, recorded as the demo made them: nothing is replaced).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from engine_support import GROUP_SIZE, PROMPTS, run, tiny_spec

from vllm_omni_prompt_cache.cli import main
from vllm_omni_prompt_cache.demo import rollout
from vllm_omni_prompt_cache.demo.rollout import RolloutResult, run_mode

pytestmark = pytest.mark.engine
CALLS = 2 * len(PROMPTS) * GROUP_SIZE  # a positive and a negative encode_prompt call per request
ENCODED_KINDS = len(PROMPTS) + 1  # each prompt, plus the shared negative prompt


@dataclass
class DemoRun:
    argv: list[str]
    code: int
    printed: str
    out: Path
    results: dict[tuple[int, str], RolloutResult]  # by (max_num_seqs, mode)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    out = tmp_path_factory.mktemp("demo") / "report"
    argv = ["demo", "--model", str(tiny_spec().model_dir), "--prompts", str(len(PROMPTS))]
    argv += ["--group-size", str(GROUP_SIZE), "--steps", "2", "--max-num-seqs", "1,4", "--out", str(out)]
    results: dict[tuple[int, str], RolloutResult] = {}

    async def recorded_run_mode(spec, mode, **kwargs):  # the demo's own call, its result kept
        result = await run_mode(spec, mode, **kwargs)
        results[spec.max_num_seqs, mode] = result
        return result

    printed = out.parent / "printed.txt"
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(rollout, "run_mode", recorded_run_mode)
    try:
        with open(printed, "w") as sink:  # the demo prints to a duplicate of sys.stdout's descriptor
            monkeypatch.setattr(sys, "stdout", sink)
            code = main(argv)
    finally:
        monkeypatch.undo()
    return DemoRun(argv, code, printed.read_text(), out, results)


def test_demo_runs_three_modes_and_writes_a_report(demo) -> None:
    assert demo.code == 0
    for label in ("no cache", "vLLM-Omni 0.30 cache", "vllm-omni-prompt-cache"):  # the release make test installs
        assert label in demo.printed
    assert "Exactness at max_num_seqs 1: final latents bit-identical" in demo.printed
    assert "At max_num_seqs 4, final latents against no cache" in demo.printed
    assert "of the uncached rollout at max_num_seqs 1" in demo.printed

    numbers = json.loads((demo.out / "results.json").read_text())
    runs = {(run["max_num_seqs"], run["mode"]): run for run in numbers["runs"]}
    assert len(runs) == 6
    rows = CALLS  # a positive and a negative row per request
    for max_num_seqs in (1, 4):
        ours, stock, off = (runs[max_num_seqs, mode] for mode in ("ours", "stock", "off"))
        assert off["text_encoder_rows"] == stock["text_encoder_rows"] == rows
        # Two prompts and the shared negative prompt, once each at max_num_seqs 1. Batched, rows are cut as they reach
        # the encoder, padding included: a prompt padded to another batch's width is another row (0.2.x trimmed the
        # padding and encoded 3 here), and the encoder's first batched call is the rows' check, served uncached.
        check, kept = ours["cache_stats"]["layout_check_rows"], ours["cache_stats"]["rows_encoded"]
        assert ours["text_encoder_rows"] == kept + check and check <= max_num_seqs * (max_num_seqs > 1)
        assert kept == ENCODED_KINDS if max_num_seqs == 1 else ENCODED_KINDS <= kept <= rows
    assert runs[1, "off"]["text_encoder_runs"] == rows  # one row per call at max_num_seqs 1
    assert runs[1, "ours"]["cache_stats"]["hits"] == rows - ENCODED_KINDS
    assert runs[1, "stock"]["cache_stats"]["bypassed"] == rows
    assert runs[4, "off"]["text_encoder_runs"] < rows  # requests were batched into shared calls
    exactness = {check["max_num_seqs"]: check for check in numbers["exactness"]}
    assert exactness[1]["all_identical"] is True and exactness[1]["bit_identity_expected"] is True
    assert exactness[4]["bit_identity_expected"] is False
    assert exactness[4]["within_tolerance"] is True and exactness[4]["passed"] is True
    report = (demo.out / "report.md").read_text()
    command = f"vllm-omni-prompt-cache {' '.join(demo.argv)}"
    assert f"Command: `{command}`" in report
    assert numbers["command"] == command
    assert f"| 1 | vllm-omni-prompt-cache | {ENCODED_KINDS} | {ENCODED_KINDS} |" in report
    assert (demo.out / "time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_request_succeeds_with_images_of_the_requested_size(demo) -> None:
    assert len(demo.results) == 6
    for result in demo.results.values():
        assert result.requests == len(PROMPTS) * GROUP_SIZE
        assert result.image_sizes == {(64, 64)}
        assert len(result.latents) == result.requests


def test_ours_encodes_each_prompt_once_and_hits_for_every_sibling(demo) -> None:
    stats = demo.results[1, "ours"].stats
    assert (stats.misses, stats.hits, stats.bypassed) == (ENCODED_KINDS, CALLS - ENCODED_KINDS, 0)
    assert demo.results[1, "ours"].encoder_runs == ENCODED_KINDS


def test_stock_cache_bypasses_every_token_id_call(demo) -> None:
    """Documents the upstream bug this package fixes: tensors are never keyed."""
    stats = demo.results[1, "stock"].stats
    assert (stats.hits, stats.misses, stats.bypassed) == (0, 0, CALLS)
    assert stats.bypass_reasons == {}  # upstream's own statistics record no reasons
    assert demo.results[1, "stock"].encoder_runs == CALLS


def test_cache_off_runs_the_encoder_for_every_call(demo) -> None:
    assert demo.results[1, "off"].stats is None  # no cache installed
    assert demo.results[1, "off"].encoder_runs == CALLS


def test_latents_are_bit_identical_with_and_without_the_cache_across_engine_runs(demo) -> None:
    """Each mode ran in an engine of its own with the same seeds: identical latents also show that the
    same seeds give the same latents from one engine run to the next."""
    reference = demo.results[1, "off"].latents
    for mode in ("ours", "stock"):
        for index, latents in demo.results[1, mode].latents.items():
            assert torch.equal(latents, reference[index]), (mode, index)


def test_different_seeds_give_different_latents(demo) -> None:
    latents = demo.results[1, "ours"].latents
    assert not torch.equal(latents[0], latents[len(PROMPTS)])  # same prompt, next sibling


def test_spawned_worker_processes_use_the_cache_too() -> None:
    """The multiprocess executor: the worker is a separate process that loads the plugin itself."""
    spec = tiny_spec(group_size=2)
    result = run(run_mode(spec, "ours", cache_size=16, engine_overrides={"distributed_executor_backend": "mp"}))
    calls = 2 * len(PROMPTS) * 2
    assert (result.stats.misses, result.stats.hits) == (ENCODED_KINDS, calls - ENCODED_KINDS)
    assert result.worker_pid != os.getpid()
