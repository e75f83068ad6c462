"""Request-batched forwards through the real AsyncOmni engine on CPU, with vLLM-Omni's stock
``QwenImagePipeline`` and text prompts: nothing of ours in the pipeline, rows are recognised.

2 prompts x 4 siblings with a shared negative prompt; ``max_num_seqs=4`` collates requests into
shared ``encode_prompt`` calls. The token-ID adapter's batched case runs in test_demo.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch
from engine_support import GROUP_SIZE, PROMPTS, MessageCollector, run

from vllm_omni_prompt_cache.demo.rollout import NEGATIVE_PROMPT
from vllm_omni_prompt_cache.tiny.qwen_image import checkpoint_dtype, ensure_tiny_qwen_image
from vllm_omni_prompt_cache.vllm_omni.engine_client import cache_stats, open_engine

pytestmark = pytest.mark.engine
REQUESTS = len(PROMPTS) * GROUP_SIZE
ROWS = 2 * REQUESTS  # a positive and a negative row per request
DISTINCT_ROWS = len(PROMPTS) + 1


async def text_rollout(max_num_seqs: int, cache: bool) -> dict[str, Any]:
    """Send the text rollout to a stock-pipeline engine; return latents and the rollout's cache stats."""
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    model_dir = ensure_tiny_qwen_image()
    kwargs = {
        "model": str(model_dir),
        "dtype": checkpoint_dtype(model_dir),
        "enable_prompt_embed_cache": cache,
        "prompt_embed_cache_size": 16,
        "max_num_seqs": max_num_seqs,
        "log_stats": False,
    }
    async with open_engine(kwargs) as engine:
        # The default policy: the plugin's routing stays out of the pools (stock's round-robin).
        assert all(pool._lb is None for pool in engine.engine.stage_pools)
        before = await cache_stats(engine)

        async def one(index: int) -> tuple[int, torch.Tensor]:
            params = OmniDiffusionSamplingParams(
                height=64, width=64, num_inference_steps=2, seed=100 + index, true_cfg_scale=4.0
            )
            params.return_trajectory_latents = True
            request = {"prompt": PROMPTS[index % len(PROMPTS)], "negative_prompt": NEGATIVE_PROMPT}
            final = None
            async for output in engine.generate(request, params, request_id=f"text-{index}"):
                final = output
            assert final is not None and not final.error, final
            return index, final.images[0]

        images = dict(await asyncio.gather(*(one(index) for index in range(REQUESTS))))
        after = await cache_stats(engine)
    return {"images": images, "stats": None if after is None else after.since(before)}


@pytest.fixture(scope="module")
def batched() -> dict[str, Any]:
    """The batched rollout, with the worker's stats line logged after every call and kept under "log"
    (one engine for the row counts and the log line; each had an engine of its own before)."""
    from vllm_omni_prompt_cache.vllm_omni import runner

    logger = logging.getLogger("vllm_omni_prompt_cache")
    collector, level = MessageCollector(), logger.level
    original = runner.STATS_LOG_INTERVAL_S
    runner.STATS_LOG_INTERVAL_S = 0.0  # log after every call
    logger.addHandler(collector)
    logger.setLevel(logging.INFO)
    try:
        result = run(text_rollout(max_num_seqs=4, cache=True))
    finally:
        runner.STATS_LOG_INTERVAL_S = original
        logger.removeHandler(collector)
        logger.setLevel(level)
    return {**result, "log": collector.messages}


def test_stock_text_pipeline_encodes_each_distinct_row_once_when_batched(batched) -> None:
    stats = batched["stats"]
    assert stats.rows_encoded == DISTINCT_ROWS
    assert stats.row_misses == DISTINCT_ROWS and stats.row_hits == ROWS - DISTINCT_ROWS
    assert stats.whole_call_reasons == {} and stats.bypassed == 0
    assert stats.hits + stats.misses < ROWS  # requests shared calls
    assert len(batched["images"]) == REQUESTS


def test_stock_text_pipeline_images_match_uncached_one_request_at_a_time() -> None:
    """At max_num_seqs 1 each call holds one row: the cached run must be bit-identical."""
    cached = run(text_rollout(max_num_seqs=1, cache=True))
    uncached = run(text_rollout(max_num_seqs=1, cache=False))
    assert cached["stats"].rows_encoded == DISTINCT_ROWS
    for index, image in uncached["images"].items():
        assert cached["images"][index].tobytes() == image.tobytes(), index


def test_the_worker_log_line_counts_rows(batched) -> None:
    """Reads the log of the ``batched`` fixture's engine (it started an identical engine of its own before)."""
    lines = [message for message in batched["log"] if "Prompt-embed cache: hit rate" in message]
    # Cumulative since the engine started: its warm-up request encoded one row too.
    assert lines and f"rows: {ROWS - DISTINCT_ROWS} hits, {DISTINCT_ROWS + 1} misses" in lines[-1]
    assert f"{DISTINCT_ROWS + 1} encoded" in lines[-1]
