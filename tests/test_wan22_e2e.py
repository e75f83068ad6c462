"""verl-omni's Wan2.2 DanceGRPO adapter (stand-in) through the real AsyncOmni engine on CPU.

3 prompts x 4 siblings (own seeds), CFG with the empty negative prompt, sent as verl-omni's
rollout sends them: ``{"prompt_token_ids": [...], "negative_prompt_ids": []}``. One request per
forward, two ``encode_prompt`` calls each: 24 calls. The adapter turns the empty negative into
zeros *shaped like the prompt's ids*, so there is one distinct negative per distinct prompt
length: the prompts are picked with two lengths between them, and 3 + 2 = 5 calls are distinct.
Two engines, cache on and cache off, same seeds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from engine_support import GROUP_SIZE, Rollout, found_method, run, send_rollout
from renamed import renamed_module

from vllm_omni_prompt_cache.tiny import wan22_adapter
from vllm_omni_prompt_cache.tiny.qwen_image import SAMPLE_PROMPTS
from vllm_omni_prompt_cache.tiny.wan22 import TINY_FRAMES, TINY_HEIGHT, TINY_WIDTH, ensure_tiny_wan22
from vllm_omni_prompt_cache.tiny.wan22_adapter import WAN22_DANCE_GRPO_PIPELINE
from vllm_omni_prompt_cache.tiny.worker_extension import WORKER_EXTENSION

pytestmark = pytest.mark.engine

#: Token lengths 35, 36, 36 with the tiny tokenizer: two distinct zero-id negatives.
PROMPTS = (SAMPLE_PROMPTS[0], SAMPLE_PROMPTS[5], SAMPLE_PROMPTS[6])
CACHE_SIZE = 64
STEPS = 2
GUIDANCE_SCALE = 5.0  # > 1: CFG on, so every request encodes its negative too
BASE_SEED = 1234


def engine_kwargs(cache: bool, pipeline: str = WAN22_DANCE_GRPO_PIPELINE) -> dict[str, Any]:
    """Return the ``AsyncOmni`` kwargs: the tiny Wan2.2, the adapter, our counters, fp32, cache on or off."""
    kwargs: dict[str, Any] = {
        "model": str(ensure_tiny_wan22()),
        "custom_pipeline_args": {"pipeline_class": pipeline},
        "worker_extension_cls": WORKER_EXTENSION,
        "dtype": "float32",
        "log_stats": False,
    }
    # The documented switches. vLLM-Omni builds WanPipeline from its registered pipeline, a path that
    # drops these two silently on its own; the plugin carries them to the stage.
    kwargs["enable_prompt_embed_cache"] = cache
    kwargs["prompt_embed_cache_size"] = CACHE_SIZE
    return kwargs


def requests(prompt_ids: list[list[int]]) -> list[tuple[int, dict[str, Any], int]]:
    """Return ``(index, request dict, seed)``: one sibling of every prompt, then the next round."""
    order = [prompt for _ in range(GROUP_SIZE) for prompt in range(len(prompt_ids))]
    return [
        (index, {"prompt_token_ids": list(prompt_ids[prompt]), "negative_prompt_ids": []}, BASE_SEED + index)
        for index, prompt in enumerate(order)
    ]


def token_ids() -> list[list[int]]:
    """Return each prompt's ids as verl-omni's agent loop sends them: unpadded, with the eos token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_wan22() / "tokenizer")
    return [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]


#: The sampling every request carries, as verl-omni's DanceGRPO rollout sets it.
SAMPLING = {
    "height": TINY_HEIGHT,
    "width": TINY_WIDTH,
    "num_frames": TINY_FRAMES,
    "num_inference_steps": STEPS,
    "guidance_scale": GUIDANCE_SCALE,
    "output_type": "np",  # as verl-omni's rollout; "image" breaks vLLM-Omni's Wan post-processing
    "return_trajectory_latents": True,
}


async def wan22_rollout(cache: bool, pipeline: str = WAN22_DANCE_GRPO_PIPELINE) -> Rollout:
    return await send_rollout(engine_kwargs(cache, pipeline), requests(token_ids()), SAMPLING, "wan")


def videos(rollout: Rollout) -> dict[int, np.ndarray]:
    return {index: np.asarray(output.images[0]) for index, output in rollout.outputs.items() if output.images}


@pytest.fixture(scope="module")
def cached() -> Rollout:
    return run(wan22_rollout(cache=True))


@pytest.fixture(scope="module")
def uncached() -> Rollout:
    return run(wan22_rollout(cache=False))


def test_every_request_returns_a_video_of_the_requested_size(cached, uncached) -> None:
    for rollout in (cached, uncached):
        assert rollout.errors == {}
        assert len(videos(rollout)) == len(PROMPTS) * GROUP_SIZE
        for index, video in videos(rollout).items():
            assert video.shape == (1, TINY_FRAMES, TINY_HEIGHT, TINY_WIDTH, 3), index


def test_each_distinct_prompt_and_zero_id_negative_is_encoded_once(cached, uncached) -> None:
    lengths = {len(ids) for ids in token_ids()}
    assert len(lengths) == 2, f"the prompts must tokenize to two lengths, got {lengths}"
    distinct = len(PROMPTS) + len(lengths)  # each prompt, and one zero-id negative per prompt length
    calls = 2 * len(PROMPTS) * GROUP_SIZE
    # The engine's warm-up request ("dummy run") returns before encoding: nothing to subtract.
    assert cached.rows_at_start == 0 and uncached.rows_at_start == 0
    stats = cached.stats
    assert cached.encoder_runs == distinct, f"{cached.encoder_runs} encoder runs for {distinct} distinct calls: {stats}"
    assert stats is not None and stats.enabled and cached.stats_at_start.misses == 0, stats
    assert (stats.misses, stats.hits, stats.bypassed) == (distinct, calls - distinct, 0), stats
    # Cache off: no cache installed, and every call reaches the text encoder.
    assert uncached.stats is None
    assert uncached.encoder_runs == calls


def test_cached_outputs_are_bit_identical_to_uncached(cached, uncached) -> None:
    assert cached.latents.keys() == uncached.latents.keys() == videos(cached).keys()
    for index in cached.latents:
        assert torch.equal(cached.latents[index], uncached.latents[index]), index
        assert np.array_equal(videos(cached)[index], videos(uncached)[index]), index
    # Siblings of one prompt differ (their own seeds), so the equalities above compare real outputs.
    assert not torch.equal(cached.latents[0], cached.latents[len(PROMPTS)])


@pytest.fixture(scope="module")
def renamed() -> Rollout:
    """The adapter copied into a fresh module, its class and its token-ID encode under names nobody listed
    (the stock text ``encode_prompt`` it inherits stays, unused by its forward)."""
    module = renamed_module(
        wan22_adapter,
        {"DanceGrpoWan22Pipeline": "Wy2VideoAdapter", "encode_prompt": "embed_dance_ids"},
        "wy2_video_adapter",
    )
    return run(wan22_rollout(cache=True, pipeline=f"{module.__name__}.Wy2VideoAdapter"))


def test_renamed_the_adapter_gets_the_cache_by_what_its_encode_does(uncached, cached, renamed) -> None:
    """Named, the adapter encodes through encode_prompt; renamed, through a method nobody listed, found by
    watching the encoder: the warm-up request takes the stock text path, so the rollout's first encode
    reveals it. Each distinct call is a miss once either way; the found method's first hit is encoded
    again to check the inference (an audit)."""
    name = found_method(renamed.stats.methods)  # counts since the rollout began, as named's
    found = renamed.stats.methods[name]
    named = cached.stats.methods["encode_prompt"]
    assert found["misses"] == named["misses"]
    audits = found["audits"]
    assert audits == 0 and found["audit_mismatches"] == 0  # a hit answers the encoder's call: no first-hit check
    # The encoder's calls are cached before the method is found (wrapped, it is only counted): nothing more runs.
    assert renamed.encoder_runs == cached.encoder_runs
    for index, latents in uncached.latents.items():
        assert torch.equal(renamed.latents[index], latents), index
