"""The adapters our users run, through the real AsyncOmni engine on CPU: rows for code nobody declared.

2 prompts x 4 siblings, CFG with one shared negative prompt: 16 rows reach ``encode_prompt``, 3 are
distinct. The pipelines are :mod:`vllm_omni_prompt_cache.tiny.verl_omni_adapters`: verl-omni's
Qwen-Image adapter as it calls ``encode_prompt`` (tensor ids, and lists), and an RL team's adapter
with other parameter names. None declares anything: rows are cut where the ids reach the text encoder,
and the encoder's rows are compared with its first batched call on first use. That check is the only
extra encoding: the distinct rows of that call encoded alone, counted as ``layout_check_rows``.
"""

from __future__ import annotations

import pytest
import torch
from engine_support import GROUP_SIZE, PROMPTS, found_method, run, tiny_spec
from renamed import renamed_module

from vllm_omni_prompt_cache.demo.rollout import run_mode
from vllm_omni_prompt_cache.tiny import verl_omni_adapters
from vllm_omni_prompt_cache.tiny.verl_omni_adapters import LIST_IDS_PIPELINE, TEAM_PIPELINE, VERL_OMNI_PIPELINE

pytestmark = pytest.mark.engine
ROWS = 2 * len(PROMPTS) * GROUP_SIZE
DISTINCT_ROWS = len(PROMPTS) + 1


def rollout(pipeline: str, *, max_num_seqs: int = 1, step_execution: bool = False, **overrides):
    spec = tiny_spec(max_num_seqs=max_num_seqs, step_execution=step_execution)
    # The engine starts a batch once no request has arrived for a fifth of this wait: at 10 ms, 2 ms, under
    # the GIL's 5 ms switch interval, so a loaded machine could split the rollout's first batch and the
    # counts below would follow the split. 250 ms (a 50 ms window) keeps the batches the rollout sends.
    engine = {"custom_pipeline_args": {"pipeline_class": pipeline}, "request_batch_max_wait_ms": 250, **overrides}
    return run(run_mode(spec, "ours", cache_size=32, engine_overrides=engine))


@pytest.fixture(scope="module")
def uncached() -> dict[int, torch.Tensor]:
    """Final latents of verl-omni's adapter with no cache, one request per forward."""
    spec = tiny_spec()
    engine = {"custom_pipeline_args": {"pipeline_class": VERL_OMNI_PIPELINE}}
    return run(run_mode(spec, "off", cache_size=32, engine_overrides=engine)).latents


def assert_three_rows(result) -> None:
    stats = result.stats
    assert stats.rows_encoded == DISTINCT_ROWS, stats
    assert stats.row_misses == DISTINCT_ROWS and stats.row_bypassed == 0
    assert stats.row_hits + stats.row_misses == ROWS, stats
    assert stats.layout_mismatches == 0
    # What reached the text encoder: the cache's rows, and the checks' uncached calls.
    assert result.encoder_rows == DISTINCT_ROWS + stats.layout_check_rows


@pytest.mark.parametrize(
    ("max_num_seqs", "step_execution"),
    # One request per forward is verl-omni's set-up on its pinned release: the release matrix runs it.
    [pytest.param(1, False, marks=pytest.mark.release), (4, False), (8, False), (4, True)],
)
def test_verl_omni_adapter_encodes_each_distinct_row_once(
    max_num_seqs, step_execution, uncached, record_release_fact
) -> None:
    result = rollout(VERL_OMNI_PIPELINE, max_num_seqs=max_num_seqs, step_execution=step_execution)
    if max_num_seqs == 1 and not step_execution:
        identical = sum(torch.equal(result.latents[index], latents) for index, latents in uncached.items())
        record_release_fact(
            "verl-omni rollout at max_num_seqs 1: rows reaching encode_prompt, rows encoded, latents identical",
            f"{ROWS}, {result.stats.rows_encoded}, {identical}/{len(uncached)}",
        )
    assert_three_rows(result)
    if max_num_seqs == 1 or step_execution:
        # One request per encode_prompt call: nothing to check in the rollout (step execution's 1-D
        # ids were checked once, on the engine's warm-up request, which the stats leave out).
        assert result.stats.layout_checks == 0 and result.stats.whole_call_reasons == {}
    if max_num_seqs == 1:  # and the denoising is the uncached run's: exact
        for index, latents in uncached.items():
            assert torch.equal(result.latents[index], latents), index
    elif step_execution:  # steps of several requests share a forward: as close as that allows
        for index, latents in uncached.items():
            torch.testing.assert_close(result.latents[index], latents, rtol=1e-4, atol=1e-4)
    else:
        # The first batched call was checked (and served uncached); the rest were rows.
        assert result.stats.layout_checks == 1 and result.stats.layout_check_rows <= max_num_seqs
        assert result.stats.layout_check_max_gap < 1e-4
        for index, latents in uncached.items():
            torch.testing.assert_close(result.latents[index], latents, rtol=1e-4, atol=1e-4)


def test_verl_omni_adapter_with_list_ids_encodes_each_distinct_row_once() -> None:
    result = rollout(LIST_IDS_PIPELINE, max_num_seqs=4)
    assert_three_rows(result)
    assert result.stats.layout_checks == 1


@pytest.mark.parametrize("max_num_seqs", [1, 4, 8])
def test_an_adapter_nobody_registered_gets_rows_checked(max_num_seqs) -> None:
    result = rollout(TEAM_PIPELINE, max_num_seqs=max_num_seqs)
    stats = result.stats
    if max_num_seqs == 1:  # one row per call: whole-call keys already encode each distinct row once
        assert stats.layout_checks == 0 and result.encoder_rows == DISTINCT_ROWS
        assert stats.misses == DISTINCT_ROWS and stats.hits == ROWS - DISTINCT_ROWS
        return
    # The first batched call, served uncached, had its rows encoded alone and compared with it.
    assert stats.layout_checks == 1 and stats.layout_mismatches == 0
    assert 2 <= stats.layout_check_rows <= max_num_seqs
    assert stats.rows_encoded == DISTINCT_ROWS and stats.whole_call_reasons == {}
    assert result.encoder_rows == DISTINCT_ROWS + stats.layout_check_rows


def test_renamed_the_adapter_gets_the_cache_by_what_its_encode_does(uncached) -> None:
    """The adapter copied into a fresh module, its class and its encode method under names nobody listed: the
    engine's warm-up reveals the method, and the rollout encodes each distinct row once, as named."""
    module = renamed_module(
        verl_omni_adapters,
        {"VerlOmniQwenImagePipeline": "Rq4ImageAdapter", "encode_prompt": "embed_request_ids"},
        "rq4_image_adapter",
    )
    result = rollout(f"{module.__name__}.Rq4ImageAdapter")
    # The encoder's deepest caller: the token pipeline's embed_token_ids, which the renamed method calls.
    found = result.stats.methods[found_method(result.stats.methods)]
    assert (found["misses"], found["hits"] + found["misses"]) == (DISTINCT_ROWS, ROWS), result.stats
    assert result.encoder_rows == DISTINCT_ROWS + found["audits"], result.stats
    for index, latents in uncached.items():
        assert torch.equal(result.latents[index], latents), index
