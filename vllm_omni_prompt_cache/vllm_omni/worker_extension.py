"""A diffusion-worker extension that exposes the prompt-embed cache over ``collective_rpc``.

Pass ``worker_extension_cls=WORKER_EXTENSION`` to ``AsyncOmni`` / ``Omni``; then
``await engine.collective_rpc("prompt_embed_cache_stats")`` returns each worker's statistics
(upstream's keys, plus ours when this package's cache is installed) even where the plugin is
switched off, and ``text_encoder_counters`` reports pipelines' own counters. It subclasses vLLM-Omni's
``CustomPipelineWorkerExtension`` because vLLM-Omni only adds that class itself when no
extension is given, and custom pipelines need it.
"""

from __future__ import annotations

from typing import Any

from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension

WORKER_EXTENSION = "vllm_omni_prompt_cache.vllm_omni.worker_extension.PromptCacheWorkerExtension"


class PromptCacheWorkerExtension(CustomPipelineWorkerExtension):
    """Adds cache statistics and text-encoder counters to the diffusion worker's RPC surface."""

    def prompt_embed_cache_stats(self) -> dict[str, Any] | None:
        """Return this worker's prompt-embed cache statistics, or None when no cache is installed."""
        runner = getattr(self, "model_runner", None)
        return None if runner is None else runner.get_prompt_embed_cache_stats()

    def text_encoder_counters(self) -> dict[str, float] | None:
        """Return how often and how long the text encoder ran, for pipelines that count it."""
        pipeline = getattr(getattr(self, "model_runner", None), "pipeline", None)
        counters = getattr(pipeline, "text_encoder_counters", None)
        return None if counters is None else counters()
