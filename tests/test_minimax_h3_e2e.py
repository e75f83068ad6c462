"""verl-omni's MiniMax-H3 adapter pattern (stand-in) through the real AsyncOmni engine on CPU.

The adapter stashes each request's token ids on the pipeline and calls ``encode_prompt(task="t2va",
prompt="[pretokenized]")``, with the same arguments for every prompt, swapping its tokenizer for
one that answers the placeholder with the stashed ids (:mod:`vllm_omni_prompt_cache.tiny.minimax_h3_adapter`).
A cache keyed on arguments alone serves the first prompt's embedding to every other. Requests A, A,
B, A (their own seeds), one per forward, as the adapter serves them; the same under a renamed copy
of the adapter. Cache off and on; the cache must encode A and B once each (and check its first hit
once), and every latent must equal the uncached engine's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_support import PROMPTS, adapter_engine_kwargs, counted, final_output, run
from renamed import renamed_module

from vllm_omni_prompt_cache.tiny import minimax_h3_adapter
from vllm_omni_prompt_cache.tiny.minimax_h3_adapter import MINIMAX_H3_PIPELINE, TOKEN_ID_NATIVE_KEY
from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image, load_tokenizer, prompt_token_ids
from vllm_omni_prompt_cache.vllm_omni.engine_client import open_engine

pytestmark = pytest.mark.engine

ORDER = (0, 0, 1, 0)  # A, A, B, A
BASE_SEED = 1234


async def send(cache: bool, pipeline: str = MINIMAX_H3_PIPELINE) -> dict[str, Any]:
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    model_dir = ensure_tiny_qwen_image()
    tokenizer = load_tokenizer(model_dir)
    ids = [prompt_token_ids(tokenizer, prompt) for prompt in PROMPTS]
    kwargs = adapter_engine_kwargs(model_dir, pipeline, cache=cache, max_num_seqs=1, cache_size=16)
    async with open_engine(kwargs) as engine:

        async def rollout() -> list[Any]:
            outputs = []
            for index, prompt in enumerate(ORDER):  # one after another: A, A, B, A reach the pipeline in order
                params = OmniDiffusionSamplingParams(
                    height=64,
                    width=64,
                    num_inference_steps=2,
                    seed=BASE_SEED + index,
                    return_trajectory_latents=True,
                    extra_args={TOKEN_ID_NATIVE_KEY: True},
                )
                request = {"prompt": PROMPTS[prompt], "prompt_token_ids": list(ids[prompt])}
                outputs.append(await final_output(engine, request, params, f"h3-{index}"))
            return outputs

        outputs, counts = await counted(engine, rollout)
    return {"latents": [output.trajectory_latents for output in outputs], "counts": counts}


@pytest.fixture(scope="module")
def uncached() -> dict[str, Any]:
    return run(send(cache=False))


@pytest.fixture(scope="module")
def cached() -> dict[str, Any]:
    return run(send(cache=True))


@pytest.fixture(scope="module")
def renamed() -> dict[str, Any]:
    module = renamed_module(
        minimax_h3_adapter,
        {"MiniMaxH3PipelineWithLogProb": "Kx3VideoAudioAdapter", "_h3_prompt_ids": "_stashed_request_ids"},
        "kx3_video_audio_adapter",
    )
    return run(send(cache=True, pipeline=f"{module.__name__}.Kx3VideoAudioAdapter"))


def test_without_a_cache_every_request_encodes(uncached) -> None:
    assert uncached["counts"].encoder_rows == len(ORDER)
    # The prompts differ, so the latents of A and B differ even where their seeds would not.
    assert not torch.equal(uncached["latents"][0], uncached["latents"][2])


@pytest.mark.parametrize("variant", ["cached", "renamed"])
def test_each_prompt_is_encoded_once_and_no_request_gets_another_prompts_embedding(variant, uncached, request) -> None:
    result = request.getfixturevalue(variant)
    counts = result["counts"]
    stats = counts.stats.methods["encode_prompt"]
    # A and B once each, and the first hit encoded again to check what its key was inferred to hold.
    assert (stats["misses"], stats["hits"], stats["audits"], stats["audit_mismatches"]) == (2, 2, 0, 0), stats
    assert counts.encoder_rows == 2 + stats["audits"]
    wrong = [
        index for index, latents in enumerate(result["latents"]) if not torch.equal(latents, uncached["latents"][index])
    ]
    assert wrong == []
