"""verl-omni's SD3.5 FlowGRPO adapter (stand-in) through the real AsyncOmni engine on CPU.

2 prompts x 4 siblings (own seeds), CFG with no negative ids, sent as verl-omni's rollout sends
them: ``{"prompt_token_ids": [...], "extra_prompt_ids": {"clip": [...], "t5": [...]}}``. Every
forward encodes its prompts through ``encode_prompt_from_token_ids`` and, under CFG, its negatives
through the text ``encode_prompt(prompt=[""] * batch, ...)``: 8 prompt rows and 8 negative rows
reach CLIP-L without a cache, 3 are distinct (2 prompts and ""). The adapter batches requests
(``supports_request_batch``): four engines, cache off and on, at ``max_num_seqs`` 1 and 4, same
seeds. Batched, the cache checks each encode method's first batched call against its rows once
(uncached); those rows are the only extra encoding. The engine's warm-up request ("dummy run",
guidance 0, text path) is counted before the rollout and left out.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_support import GROUP_SIZE, PROMPTS, Rollout, adapter_engine_kwargs, found_method, run, send_rollout
from renamed import renamed_module

from vllm_omni_prompt_cache.tiny import sd3_adapter
from vllm_omni_prompt_cache.tiny.sd3 import ensure_tiny_sd3, load_tokenizers, rollout_request
from vllm_omni_prompt_cache.tiny.sd3_adapter import SD3_FLOW_GRPO_PIPELINE

pytestmark = pytest.mark.engine

CACHE_SIZE = 64
SIZE = 64
STEPS = 2
GUIDANCE_SCALE = 4.5  # > 1: CFG on, so every forward encodes its negatives too
BASE_SEED = 1234
#: verl-omni's FlowGRPO knobs (its SD3 OCR script's values); only the SDE path, left out here, reads them.
ALGO_ARGS = {"noise_level": 0.8, "sde_type": "cps", "sde_window_size": 3, "sde_window_range": [0, 5], "logprobs": True}
REQUESTS = len(PROMPTS) * GROUP_SIZE
DISTINCT_ROWS = len(PROMPTS) + 1  # each prompt, and the empty negative
#: Rows encoded before the token path's method is wrapped: the first token-ID request's prompt row.
DISCOVERY_ROWS = 1


def engine_kwargs(cache: bool, max_num_seqs: int, pipeline: str = SD3_FLOW_GRPO_PIPELINE) -> dict[str, Any]:
    """Return the ``AsyncOmni`` kwargs: the tiny SD3.5, the adapter, our counters, fp32, cache on or off."""
    kwargs = adapter_engine_kwargs(
        ensure_tiny_sd3(), pipeline, cache=cache, max_num_seqs=max_num_seqs, cache_size=CACHE_SIZE
    )
    if max_num_seqs > 1:
        kwargs["request_batch_max_wait_ms"] = 10  # as verl-omni's SD3 scripts
    return kwargs


def requests() -> list[tuple[int, dict[str, Any], int]]:
    """Return ``(index, request dict, seed)``: one sibling of every prompt, then the next round."""
    tokenizers = load_tokenizers(ensure_tiny_sd3())
    order = [prompt for _ in range(GROUP_SIZE) for prompt in range(len(PROMPTS))]
    return [
        (index, rollout_request(tokenizers, PROMPTS[prompt]), BASE_SEED + index) for index, prompt in enumerate(order)
    ]


#: The sampling every request carries, as verl-omni's SD3 rollout sets it.
SAMPLING = {
    "height": SIZE,
    "width": SIZE,
    "num_inference_steps": STEPS,
    "guidance_scale": GUIDANCE_SCALE,
    "max_sequence_length": 256,
    "output_type": "image",
    "extra_args": ALGO_ARGS,
    "return_trajectory_latents": True,
}


async def sd3_rollout(
    cache: bool, max_num_seqs: int, text_twins: bool = False, pipeline: str = SD3_FLOW_GRPO_PIPELINE
) -> Rollout:
    """The rollout through one engine; ``text_twins``: then each prompt's first request again as text
    (``{"prompt": ...}``, same seed), uncounted, in ``later``."""
    twins = [(i, {"prompt": PROMPTS[i]}, BASE_SEED + i) for i in range(len(PROMPTS))] if text_twins else []
    return await send_rollout(engine_kwargs(cache, max_num_seqs, pipeline), requests(), SAMPLING, "sd3", later=twins)


def image_sizes(rollout: Rollout) -> dict[int, list[tuple[int, int]]]:
    return {index: [image.size for image in output.images] for index, output in rollout.outputs.items()}


@pytest.fixture(scope="module")
def uncached() -> Rollout:
    return run(sd3_rollout(cache=False, max_num_seqs=1, text_twins=True))


@pytest.fixture(scope="module")
def cached() -> Rollout:
    return run(sd3_rollout(cache=True, max_num_seqs=1))


@pytest.fixture(scope="module")
def uncached_batched() -> Rollout:
    return run(sd3_rollout(cache=False, max_num_seqs=4))


@pytest.fixture(scope="module")
def cached_batched() -> Rollout:
    return run(sd3_rollout(cache=True, max_num_seqs=4))


def test_every_request_returns_an_image(uncached, cached, uncached_batched, cached_batched) -> None:
    for rollout in (uncached, cached, uncached_batched, cached_batched):
        assert rollout.errors == {}
        assert image_sizes(rollout) == {index: [(SIZE, SIZE)] for index in range(REQUESTS)}
        assert rollout.latents.keys() == image_sizes(rollout).keys()


def test_without_a_cache_every_prompt_and_negative_row_reaches_the_encoder(uncached, uncached_batched) -> None:
    # The warm-up encoded "dummy run" once, through the text path (guidance 0: no negative).
    assert uncached.rows_at_start == uncached_batched.rows_at_start == 1
    assert uncached.stats is None and uncached_batched.stats is None
    assert (uncached.encoder_runs, uncached.encoder_rows) == (2 * REQUESTS, 2 * REQUESTS)
    # Batched: fewer, larger calls, the same rows.
    assert uncached_batched.encoder_rows == 2 * REQUESTS


def test_with_the_cache_each_distinct_row_is_encoded_once(cached, cached_batched) -> None:
    stats = cached.stats
    assert stats is not None and stats.enabled, stats
    # The warm-up request encodes text through encode_prompt; the token path is first taken by the rollout's first
    # request, whose encoder calls (CLIP-L, CLIP-G, T5) share encode_prompt_from_token_ids as their deepest method:
    # found there (counted under the helpers its first calls went through until then), and its calls counted as
    # its own from the next request on. The encoder's calls are cached from the first on: each distinct row once,
    # nothing more (0.2.x encoded the revealing request's row and the first observed call's again: 5 rows).
    assert found_method(stats.methods) == "encode_prompt_from_token_ids", stats.methods
    found = stats.methods["encode_prompt_from_token_ids"]
    assert cached.encoder_rows == DISTINCT_ROWS, stats
    assert REQUESTS - DISCOVERY_ROWS <= found["misses"] + found["hits"] <= REQUESTS, stats
    assert found["misses"] <= len(PROMPTS), stats
    assert (stats.methods["encode_prompt"]["misses"], stats.methods["encode_prompt"]["hits"]) == (1, REQUESTS - 1)
    # Batched: each text encoder's first batched call (CLIP-L, CLIP-G, T5) is checked against its rows, uncached, once.
    stats = cached_batched.stats
    assert stats is not None and stats.layout_mismatches == 0, stats
    assert stats.layout_checks <= 3, stats.methods
    # What reached CLIP-L (the counted encoder): the distinct rows, the checks' batches, and rows padded to another
    # batch's width (another row: batches of max_num_seqs 4 requests mix prompts of other lengths).
    assert cached_batched.encoder_rows <= DISTINCT_ROWS + stats.layout_check_rows + 2 * 4, stats


def test_token_ids_give_the_text_paths_latents(uncached) -> None:
    # The ids path pads as the stock text path tokenizes, so each prompt's embeddings, and the
    # latents denoised from them with the same seed, are bit for bit the text request's.
    assert uncached.later.keys() == set(range(len(PROMPTS)))
    for index, output in uncached.later.items():
        assert torch.equal(output.trajectory_latents, uncached.latents[index]), index


def test_cached_latents_match_uncached(uncached, cached, uncached_batched, cached_batched) -> None:
    for index, latents in uncached.latents.items():
        assert torch.equal(cached.latents[index], latents), index
    # Batched: which requests share a forward depends on timing, and a batch's matmuls round
    # differently: within 1e-5 of each request's largest value.
    for index, latents in uncached_batched.latents.items():
        gap = (cached_batched.latents[index] - latents).abs().max() / latents.abs().max()
        assert gap <= 1e-5, (index, gap.item())
    # Siblings of one prompt differ (their own seeds), so the equalities above compare real outputs.
    assert not torch.equal(uncached.latents[0], uncached.latents[len(PROMPTS)])


@pytest.fixture(scope="module")
def renamed() -> Rollout:
    """The adapter copied into a fresh module, its classes and its token-ID encode method under names nobody listed."""
    module = renamed_module(
        sd3_adapter,
        {
            "StableDiffusion3PipelineWithLogProb": "Tz5ImageAdapter",
            "SD3TokenIdPromptMixin": "Tz5TokenMixin",
            "encode_prompt_from_token_ids": "embed_clip_t5_ids",
        },
        "tz5_image_adapter",
    )
    return run(sd3_rollout(cache=True, max_num_seqs=1, pipeline=f"{module.__name__}.Tz5ImageAdapter"))


def test_renamed_the_adapter_gets_the_cache_by_what_its_encode_does(uncached, cached, renamed) -> None:
    """Renamed, the token method is found the same way; its rows have no layout proven for its name, so
    one request per forward is keyed whole and no row is encoded twice."""
    assert found_method(renamed.stats.methods) == "embed_clip_t5_ids", renamed.stats.methods
    found = renamed.stats.methods["embed_clip_t5_ids"]
    assert REQUESTS - DISCOVERY_ROWS <= found["misses"] + found["hits"] <= REQUESTS and found["misses"] <= len(PROMPTS)
    assert renamed.encoder_rows == DISTINCT_ROWS + found["audits"], renamed.stats
    assert found["audits"] == 0 and found["audit_mismatches"] == 0  # a hit answers the encoder's calls: no check
    for index, latents in uncached.latents.items():
        assert torch.equal(renamed.latents[index], latents), index
