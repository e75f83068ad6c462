"""End to end through the real AsyncOmni engine on CPU: kwargs -> worker -> runner -> cache.

2 prompts x 4 concurrent sibling requests, each with its own seed, fresh token-ID tensors and a
shared negative prompt (CFG on). One engine per cache mode; each starts in about 3 s here.
"""

from __future__ import annotations

import os

import pytest
import torch
from engine_support import GROUP_SIZE, PROMPTS, run, tiny_spec

from vllm_omni_prompt_cache.demo.rollout import run_mode

pytestmark = pytest.mark.engine
CALLS = 2 * len(PROMPTS) * GROUP_SIZE  # a positive and a negative encode_prompt call per request
ENCODED_KINDS = len(PROMPTS) + 1  # each prompt, plus the shared negative prompt


@pytest.fixture(scope="module")
def results() -> dict:
    spec = tiny_spec()
    return {mode: run(run_mode(spec, mode, cache_size=16)) for mode in ("ours", "stock", "off")}


def test_every_request_succeeds_with_images_of_the_requested_size(results) -> None:
    for result in results.values():
        assert result.requests == len(PROMPTS) * GROUP_SIZE
        assert result.image_sizes == {(64, 64)}
        assert len(result.latents) == result.requests


def test_ours_encodes_each_prompt_once_and_hits_for_every_sibling(results) -> None:
    stats = results["ours"].stats
    assert (stats.misses, stats.hits, stats.bypassed) == (ENCODED_KINDS, CALLS - ENCODED_KINDS, 0)
    assert results["ours"].encoder_runs == ENCODED_KINDS


def test_stock_cache_bypasses_every_token_id_call(results) -> None:
    """Documents the upstream bug this package fixes: tensors are never keyed."""
    stats = results["stock"].stats
    assert (stats.hits, stats.misses, stats.bypassed) == (0, 0, CALLS)
    assert stats.bypass_reasons == {}  # upstream's own statistics record no reasons
    assert results["stock"].encoder_runs == CALLS


def test_cache_off_runs_the_encoder_for_every_call(results) -> None:
    assert results["off"].stats is None  # no cache installed
    assert results["off"].encoder_runs == CALLS


def test_latents_are_bit_identical_with_and_without_the_cache(results) -> None:
    reference = results["off"].latents
    for mode in ("ours", "stock"):
        for index, latents in results[mode].latents.items():
            assert torch.equal(latents, reference[index]), (mode, index)


def test_same_seeds_give_identical_latents_across_engine_runs(results) -> None:
    again = run(run_mode(tiny_spec(), "ours", cache_size=16))
    for index, latents in again.latents.items():
        assert torch.equal(latents, results["ours"].latents[index])


def test_different_seeds_give_different_latents(results) -> None:
    latents = results["ours"].latents
    assert not torch.equal(latents[0], latents[len(PROMPTS)])  # same prompt, next sibling


def test_spawned_worker_processes_use_the_cache_too() -> None:
    """The multiprocess executor: the worker is a separate process that loads the plugin itself."""
    spec = tiny_spec(group_size=2)
    result = run(run_mode(spec, "ours", cache_size=16, engine_overrides={"distributed_executor_backend": "mp"}))
    calls = 2 * len(PROMPTS) * 2
    assert (result.stats.misses, result.stats.hits) == (ENCODED_KINDS, calls - ENCODED_KINDS)
    assert result.worker_pid != os.getpid()
