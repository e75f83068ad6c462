"""Shared pieces of the tests that run the real vLLM-Omni engine on CPU."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="the engine tests need the vllm-omni extra")

from vllm_omni_prompt_cache.demo.rollout import RolloutSpec
from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image
from vllm_omni_prompt_cache.tiny.worker_extension import TextEncoderCountersExtension

PROMPTS = ("a red fox in the snow", "a lighthouse above a stormy sea")
GROUP_SIZE = 4


def tiny_spec(**overrides: Any) -> RolloutSpec:
    """The e2e rollout: 2 prompts x 4 siblings, 64x64, 2 steps, CFG with a shared negative prompt."""
    values: dict[str, Any] = {"model_dir": ensure_tiny_qwen_image(), "prompts": PROMPTS, "group_size": GROUP_SIZE}
    values.update(overrides)
    return RolloutSpec(**values)


def run(coroutine: Any) -> Any:
    """Run a coroutine to completion on a fresh event loop (engines bind to the loop they start on)."""
    return asyncio.run(coroutine)


RELOADING_EXTENSION = "engine_support.WeightReloadingExtension"


class WeightReloadingExtension(TextEncoderCountersExtension):
    """Reloads weights through ``pipeline.load_weights``, as RL frameworks sync new weights."""

    def reload_weights(self, component: str) -> int:
        pipeline = self.model_runner.pipeline
        module = getattr(pipeline, component)
        weights = [(f"{component}.{name}", p.detach().clone()) for name, p in module.named_parameters()]
        pipeline.load_weights(weights)
        return len(weights)
