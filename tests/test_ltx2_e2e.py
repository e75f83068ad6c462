"""verl-omni's LTX-2.3 FlowGRPO adapter (stand-in) through the real AsyncOmni engine on CPU.

2 prompts x 4 siblings (own seeds), CFG on (guidance 4.0, verl-omni's LTX-2.3 recipe), sent as
verl-omni's rollout sends them: ``{"prompt_token_ids": [...], "negative_prompt_ids": [...]}``, both
tokenized by its LTX agent loop (raw text, ``<bos>`` added, no padding) and no masks. The recipe's
negative prompt is empty, so every request's negative ids are the same ``[<bos>]``. The adapter
serves one request per forward and calls ``_encode_token_ids`` twice in each, the prompt and then
the negative: 16 rows reach Gemma without a cache, 3 are distinct (2 prompts and the empty
negative). Left-padding to the one ``max_sequence_length`` every request carries does not split
them further. The stock ``encode_prompt`` then receives the injected embeddings and encodes
nothing. Two engines, cache off and on, same seeds. The adapter refuses request batching
(``supports_request_batch = False``), and so does the engine: with ``max_num_seqs`` 4 it does not start.
The LTX-2 family skips the engine's warm-up request, so nothing runs before the rollout: the cache
finds ``_encode_token_ids`` by watching Gemma in the rollout's first request.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_support import GROUP_SIZE, PROMPTS, Rollout, adapter_engine_kwargs, run, send_rollout
from renamed import renamed_module

from vllm_omni_prompt_cache.tiny import ltx2_adapter
from vllm_omni_prompt_cache.tiny.ltx2 import TINY_FRAME_RATE, TINY_FRAMES, TINY_HEIGHT, TINY_WIDTH, ensure_tiny_ltx2
from vllm_omni_prompt_cache.tiny.ltx2_adapter import LTX2_FLOW_GRPO_PIPELINE
from vllm_omni_prompt_cache.vllm_omni.engine_client import open_engine

pytestmark = pytest.mark.engine

CACHE_SIZE = 64
STEPS = 2  # LTX's floor
GUIDANCE_SCALE = 4.0  # verl-omni's LTX-2.3 recipe: CFG on, so every request encodes its negative too
PROMPT_LENGTH = 1024  # the recipe's data.max_prompt_length: the agent loop truncates to it
MAX_SEQUENCE_LENGTH = 128  # what every request pads to: the tiny tokenizer's length (the recipe sends 1024)
NEGATIVE_PROMPT = ""  # the LTX-2 example data's negative prompt
BASE_SEED = 1234
#: verl-omni's FlowGRPO knobs from its LTX-2.3 script; only the SDE path, left out here, reads them.
ALGO_ARGS = {
    "noise_level": 0.8,
    "sde_type": "cps",
    "sde_window_range": [0, 10],
    "sde_window_size": 3,
    "sde_contiguous": False,
    "sde_window_seed": 42,
    "logprobs": True,
}
REQUESTS = len(PROMPTS) * GROUP_SIZE
DISTINCT_ROWS = len(PROMPTS) + 1  # each prompt, and the shared empty negative
#: Rows encoded before the encode method is wrapped: the rollout's first request, whose prompt's encode
#: revealed it and whose negative ran inside the same forward (the LTX-2 family has no warm-up request).
DISCOVERY_ROWS = 2


def engine_kwargs(cache: bool, max_num_seqs: int = 1, pipeline: str = LTX2_FLOW_GRPO_PIPELINE) -> dict[str, Any]:
    """Return the ``AsyncOmni`` kwargs: the tiny LTX-2.3, the adapter, our counters, fp32, cache on or off."""
    return adapter_engine_kwargs(
        ensure_tiny_ltx2(), pipeline, cache=cache, max_num_seqs=max_num_seqs, cache_size=CACHE_SIZE
    )


def agent_loop_ids(tokenizer: Any, text: str) -> list[int]:
    """Return ``text``'s ids as verl-omni's LTX agent loop makes them (``apply_chat_template``)."""
    return tokenizer(text, padding=False, truncation=True, max_length=PROMPT_LENGTH, add_special_tokens=True)[
        "input_ids"
    ]


def requests() -> list[tuple[int, dict[str, Any], int]]:
    """Return ``(index, request dict, seed)``: one sibling of every prompt, then the next round."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_ltx2() / "tokenizer")
    prompt_ids = [agent_loop_ids(tokenizer, prompt) for prompt in PROMPTS]
    negative_ids = agent_loop_ids(tokenizer, NEGATIVE_PROMPT)
    order = [prompt for _ in range(GROUP_SIZE) for prompt in range(len(PROMPTS))]
    return [
        (index, {"prompt_token_ids": list(prompt_ids[prompt]), "negative_prompt_ids": list(negative_ids)}, seed)
        for index, (prompt, seed) in enumerate(zip(order, range(BASE_SEED, BASE_SEED + len(order)), strict=True))
    ]


#: The sampling every request carries, as verl-omni's LTX-2.3 script sets it.
SAMPLING = {
    "height": TINY_HEIGHT,
    "width": TINY_WIDTH,
    "num_frames": TINY_FRAMES,
    "frame_rate": TINY_FRAME_RATE,
    "num_inference_steps": STEPS,
    "guidance_scale": GUIDANCE_SCALE,
    "max_sequence_length": MAX_SEQUENCE_LENGTH,
    "output_type": "pt",  # as verl-omni's LTX-2.3 script asks for it
    "extra_args": ALGO_ARGS,
    "return_trajectory_latents": True,
}


async def ltx2_rollout(cache: bool, pipeline: str = LTX2_FLOW_GRPO_PIPELINE) -> Rollout:
    return await send_rollout(engine_kwargs(cache, pipeline=pipeline), requests(), SAMPLING, "ltx2")


def videos(rollout: Rollout) -> dict[int, torch.Tensor]:
    return {index: output.images[0] for index, output in rollout.outputs.items() if output.images}


def audios(rollout: Rollout) -> dict[int, torch.Tensor]:
    return {index: output.multimodal_output.get("audio") for index, output in rollout.outputs.items()}


@pytest.fixture(scope="module")
def uncached() -> Rollout:
    return run(ltx2_rollout(cache=False))


@pytest.fixture(scope="module")
def cached() -> Rollout:
    return run(ltx2_rollout(cache=True))


def test_every_request_returns_a_video_and_its_audio(uncached, cached) -> None:
    for rollout in (uncached, cached):
        assert rollout.errors == {}
        assert videos(rollout).keys() == audios(rollout).keys() == rollout.latents.keys() == set(range(REQUESTS))
        for index in range(REQUESTS):
            assert videos(rollout)[index].shape == (1, TINY_FRAMES, 3, TINY_HEIGHT, TINY_WIDTH), index
            audio = audios(rollout)[index]  # [1, channels, samples] at the vocoder's 48 kHz
            assert audio is not None and audio.ndim == 3 and audio.shape[0] == 1 and audio.shape[-1] > 0, index


def test_without_a_cache_every_prompt_and_negative_row_reaches_the_encoder(uncached) -> None:
    assert uncached.rows_at_start == 0  # no warm-up request for the LTX-2 family
    assert uncached.stats is None
    assert (uncached.encoder_runs, uncached.encoder_rows) == (2 * REQUESTS, 2 * REQUESTS)


def test_with_the_cache_each_distinct_row_is_encoded_once(cached) -> None:
    stats = cached.stats
    assert stats is not None and stats.enabled, stats
    token_calls = stats.methods.get("_encode_token_ids", {})
    # Found by watching the encoder in request 0 (its two rows ran before it was wrapped); then each
    # distinct row once. No first hit is encoded again (an audit): a hit answers the encoder's call, nothing to check.
    assert token_calls.get("audits") == 0 and token_calls.get("audit_mismatches") == 0, stats
    # The encoder's calls are cached from the first request on, before the method is found: the rows that
    # revealed it (DISCOVERY_ROWS, encoded uncached before 0.3.0) are entries like any other.
    rows = DISTINCT_ROWS + token_calls["audits"]
    assert (cached.encoder_runs, cached.encoder_rows) == (rows, rows), stats
    assert (token_calls.get("misses"), token_calls.get("hits")) == (DISTINCT_ROWS, 2 * REQUESTS - DISTINCT_ROWS), stats
    # Each request's stock encode_prompt got the injected embeddings and passed them through.
    assert stats.bypassed == REQUESTS, stats


def test_cached_outputs_are_bit_identical_to_uncached(uncached, cached) -> None:
    for index in range(REQUESTS):
        assert torch.equal(cached.latents[index], uncached.latents[index]), index
        assert torch.equal(videos(cached)[index], videos(uncached)[index]), index
        assert torch.equal(audios(cached)[index], audios(uncached)[index]), index
    # Siblings of one prompt differ (their own seeds), so the equalities above compare real outputs.
    assert not torch.equal(uncached.latents[0], uncached.latents[len(PROMPTS)])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the failed start's thread
def test_the_engine_refuses_request_batching_for_the_adapter() -> None:
    async def start() -> None:
        async with open_engine(engine_kwargs(cache=True, max_num_seqs=4)):
            pass

    with pytest.raises(RuntimeError, match="does not support request-level batching"):
        run(start())


@pytest.fixture(scope="module")
def renamed() -> Rollout:
    """The adapter copied into a fresh module, its class and its encode method under names nobody listed."""
    module = renamed_module(
        ltx2_adapter,
        {"LTX23PipelineWithLogProb": "Qv8VideoAdapter", "_encode_token_ids": "_embed_request_ids"},
        "qv8_video_adapter",
    )
    return run(ltx2_rollout(cache=True, pipeline=f"{module.__name__}.Qv8VideoAdapter"))


def test_renamed_the_adapter_gets_the_cache_by_what_its_encode_does(uncached, cached, renamed) -> None:
    """The adapter under names nobody listed counts exactly as named: found the same way (forward and
    _inject_precomputed_prompt_embeds are tried first and refuted: a request object is no key)."""
    found, named = renamed.stats.methods["_embed_request_ids"], cached.stats.methods["_encode_token_ids"]
    counted = ("hits", "misses", "audits", "audit_mismatches")
    assert {key: found[key] for key in counted} == {key: named[key] for key in counted}, renamed.stats
    assert renamed.encoder_rows == cached.encoder_rows == DISTINCT_ROWS + found["audits"]
    for index in range(REQUESTS):
        assert torch.equal(renamed.latents[index], uncached.latents[index]), index
        assert torch.equal(videos(renamed)[index], videos(uncached)[index]), index
