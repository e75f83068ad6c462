"""A diffusion-worker extension that reports how often the text encoder really ran, and how it moved.

The demo and the tests pass ``worker_extension_cls=WORKER_EXTENSION`` to ``AsyncOmni``; then
``await engine.collective_rpc("text_encoder_counters")`` returns the counters of pipelines that
keep them (the token-ID pipeline does), whatever cache is installed or none. Cache statistics
come from the worker's own ``get_prompt_embed_cache_stats``, which the plugin adds. It subclasses
vLLM-Omni's ``CustomPipelineWorkerExtension`` because vLLM-Omni only adds that class itself when no
extension is given, and custom pipelines need it.
"""

from __future__ import annotations

from typing import Any

from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension

from vllm_omni_prompt_cache.encoders.residency import EncoderMoves, module_nbytes
from vllm_omni_prompt_cache.encoders.text_encoders import text_encoders
from vllm_omni_prompt_cache.vllm_omni.offload import observe_module_offload

WORKER_EXTENSION = "vllm_omni_prompt_cache.tiny.worker_extension.TextEncoderCountersExtension"


class TextEncoderCountersExtension(CustomPipelineWorkerExtension):
    """Adds the pipeline's text-encoder counters to the diffusion worker's RPC surface."""

    def text_encoder_counters(self) -> dict[str, float] | None:
        """Return how often and how long the text encoder ran, for pipelines that count it."""
        pipeline = getattr(getattr(self, "model_runner", None), "pipeline", None)
        counters = getattr(pipeline, "text_encoder_counters", None)
        return None if counters is None else counters()

    def text_encoder_moves(self) -> dict[str, Any] | None:
        """Return the text encoders' moves so far (counts as ``stats()`` names them, ``encoder_device_bytes``,
        ``placer``), whatever cache is installed or none; None when nothing moves them.

        With this package's cache they are the cache's own counts. Without it (no cache, vLLM-Omni's
        cache) vLLM-Omni's module offload is observed from the first call on, as if the engine's
        last forward had just run (it has: the start-up warm-up).
        """
        pipeline = getattr(getattr(self, "model_runner", None), "pipeline", None)
        moves = getattr(getattr(pipeline, "_prompt_embed_cache", None), "moves", None)
        if moves is None and pipeline is not None:
            moves = getattr(pipeline, "_text_encoder_moves", None)
            if moves is None:
                moves = EncoderMoves()
                if observe_module_offload(pipeline, moves, after_a_forward=True) is None:
                    return None
                object.__setattr__(pipeline, "_text_encoder_moves", moves)
        if moves is None:
            return None
        return {
            **{count.name: value for count, value in moves.counts().items()},  # as CacheStats names them
            "encoder_device_bytes": moves.device_bytes(),
            "placer": moves.placer,
        }

    def runner_prompt_embed_cache_stats(self) -> dict[str, Any] | None:
        """Return the runner's own ``get_prompt_embed_cache_stats()``: whatever cache vLLM-Omni's runner
        installed (this package's plugin adds the same method to the worker; stock vLLM-Omni does not)."""
        runner = getattr(self, "model_runner", None)
        return None if runner is None else runner.get_prompt_embed_cache_stats()

    def text_encoder_bytes(self) -> int:
        """Return the bytes of the pipeline's text encoders' parameters and buffers."""
        pipeline = getattr(getattr(self, "model_runner", None), "pipeline", None)
        return sum(module_nbytes(module) for module in text_encoders(pipeline).values()) if pipeline else 0

    def device_memory(self, reset_peak: bool = False) -> dict[str, int] | None:
        """Return this worker's CUDA memory (``allocated`` and ``reserved`` by torch now, ``peak`` allocated
        since the last reset, ``free`` on the device) and reset the peak when asked; None without CUDA.
        ``free`` also sees memory outside torch's allocator (vLLM's sleep-mode pool)."""
        import torch

        if not torch.cuda.is_available():
            return None
        seen = {
            "allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
            "peak": torch.cuda.max_memory_allocated(),
            "free": torch.cuda.mem_get_info()[0],
        }
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()
        return seen
