"""Through the real ``AsyncOmni`` engine: a token-ID Qwen-Image pipeline whose encode counts its calls on ``self``
keeps the cache (unit cases: ``test_instrumentation.py``).

The pipeline is the demo's token-ID Qwen-Image adapter (``tiny/token_id_pipeline.py``, after verl-omni's
``qwen_image_flow_grpo`` adapter) with a user's profiling added to ``encode_prompt``: a counter on ``self``
before encoding, a dict of counts bumped under a lock, and a list of timings appended after encoding.
2 prompts x 4 siblings with CFG, one request per forward: three distinct rows (two prompts, one negative
prompt), so three text-encoder runs.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from engine_support import counted, run, tiny_spec

from vllm_omni_prompt_cache.demo.rollout import engine_kwargs, send_rollout
from vllm_omni_prompt_cache.tiny.token_id_pipeline import TokenIdQwenImagePipeline
from vllm_omni_prompt_cache.vllm_omni.engine_client import open_engine

COUNTS_ON_SELF = "test_instrumentation_e2e.CountsOnSelfPipeline"


class CountsOnSelfPipeline(TokenIdQwenImagePipeline):
    """The token-ID adapter, its ``encode_prompt`` calls counted and timed on ``self``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.encode_counts: dict[str, int] = {}
        self.encode_timings: list[float] = []
        self._counts_lock = threading.Lock()

    def encode_prompt(
        self,
        prompt_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        num_images_per_prompt: int = 1,
        max_sequence_length: int = 1024,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        started = time.perf_counter()
        self.calls += 1
        with self._counts_lock:
            self.encode_counts["calls"] = self.encode_counts.get("calls", 0) + 1
        encoded = super().encode_prompt(prompt_ids, attention_mask, num_images_per_prompt, max_sequence_length)
        self.encode_timings.append(time.perf_counter() - started)
        return encoded


@pytest.mark.engine
def test_an_encode_that_counts_on_self_is_encoded_once_per_distinct_prompt() -> None:
    spec = tiny_spec()
    kwargs = {**engine_kwargs(spec, "ours", 16, None), "custom_pipeline_args": {"pipeline_class": COUNTS_ON_SELF}}

    async def rollout() -> Any:
        async with open_engine(kwargs) as engine:
            return (await counted(engine, lambda: send_rollout(engine, spec)))[1]

    counts = run(rollout())
    assert counts.encoder_runs == counts.encoder_rows == 3  # 2 prompts and 1 negative prompt, once each
    stats = counts.stats
    assert stats.bypassed == 0 and stats.hits == 2 * 2 * 4 - 3
