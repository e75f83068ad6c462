"""A diffusion-worker extension that reports how often the text encoder really ran.

The demo and the tests pass ``worker_extension_cls=WORKER_EXTENSION`` to ``AsyncOmni``; then
``await engine.collective_rpc("text_encoder_counters")`` returns the counters of pipelines that
keep them (the token-ID pipeline does), whatever cache is installed or none. Cache statistics
come from the worker's own ``get_prompt_embed_cache_stats``, which the plugin adds. It subclasses
vLLM-Omni's ``CustomPipelineWorkerExtension`` because vLLM-Omni only adds that class itself when no
extension is given, and custom pipelines need it.
"""

from __future__ import annotations

from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension

WORKER_EXTENSION = "vllm_omni_prompt_cache.tiny.worker_extension.TextEncoderCountersExtension"


class TextEncoderCountersExtension(CustomPipelineWorkerExtension):
    """Adds the pipeline's text-encoder counters to the diffusion worker's RPC surface."""

    def text_encoder_counters(self) -> dict[str, float] | None:
        """Return how often and how long the text encoder ran, for pipelines that count it."""
        pipeline = getattr(getattr(self, "model_runner", None), "pipeline", None)
        counters = getattr(pipeline, "text_encoder_counters", None)
        return None if counters is None else counters()
