"""When the diffusion worker's cache must be emptied, and what the worker reports about it.

A cached embedding is only valid for the text-encoder weights that produced it. In vLLM-Omni
those weights change, or their memory goes away, on these paths:

* ``DiffusionWorker.sleep`` (also reached through ``handle_sleep_task``), before the memory pools
  are released. Level 1 offloads the weights and brings the same ones back on wake: the entries
  stay valid, so they move to the host tier when there is one. Level 2 discards the weights, and
  whatever is loaded after the wake is unknown here: every tier is cleared, and the directory
  tier fingerprints the weights again before its next use (the same checkpoint finds its files);
* ``pipeline.load_weights(...)`` with text-encoder weights (how RL frameworks sync new weights):
  cleared after the load;
* a weight-transfer session (``DiffusionWorker.start_weight_update`` ... ``finish_weight_update``,
  0.32 and later), whose engines may write parameters without ``load_weights`` and without
  saying which: cleared when it starts and when it ends, the directory tier suspended in between
  (it fingerprints the weights again before its next use);
* LoRA: ``DiffusionLoRAManager.add_adapter`` / ``remove_adapter`` / ``set_active_adapter``
  (through ``_activate_adapter``, ``_deactivate_all_adapters``, and ``_reset_lora_layers`` where the
  release suspends adapters) when the
  manager's LoRA layers include text-encoder modules and the bound state actually changed (LoRA
  weights live beside the module weights the fingerprint hashes, so the directory tier is also
  turned off for that pipeline);
* ``DiffusionWorker.load_model`` / ``re_init_pipeline`` build a new pipeline, which gets a new,
  empty cache.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from vllm_omni_prompt_cache.encoders.residency import PLACEMENT_ATTRIBUTE
from vllm_omni_prompt_cache.encoders.text_encoders import embedding_sources
from vllm_omni_prompt_cache.store.prompt_embed_cache import PromptEmbedCache
from vllm_omni_prompt_cache.vllm_omni.hook_points import LORA_STATE_CHANGERS, WEIGHT_UPDATE_SESSION
from vllm_omni_prompt_cache.vllm_omni.imports import replace_once

logger = logging.getLogger("vllm_omni_prompt_cache")

#: Where 0.28 and later reset suspended adapters (0.27 suspends none).
_SUSPENSION_RESET = "_reset_lora_layers"


def _directory_tier(pipeline: Any) -> Any:
    """Return the directory tier of the pipeline's cache, or None."""
    cache = getattr(pipeline, "_prompt_embed_cache", None)
    return cache.directory if isinstance(cache, PromptEmbedCache) else None


def clear_cache(pipeline: Any, reason: str) -> PromptEmbedCache | None:
    """Empty every tier of the pipeline's prompt-embed cache, if it has one, and say why; return it."""
    cache = getattr(pipeline, "_prompt_embed_cache", None)
    if isinstance(cache, PromptEmbedCache):
        entries = len(cache) + (len(cache.host) if cache.host is not None else 0)
        cache.clear()
        if entries:
            logger.info("Prompt-embed cache cleared (%d entries): %s.", entries, reason)
        return cache
    return None


def release_device_memory(pipeline: Any, reason: str) -> None:
    """Drop the pipeline's cached entries from device memory (to the host tier, if any), and say why."""
    cache = getattr(pipeline, "_prompt_embed_cache", None)
    if isinstance(cache, PromptEmbedCache):
        entries = cache.release_device_memory()
        if entries:
            kept = "moved to host memory" if cache.host is not None else "cleared"
            logger.info("Prompt-embed cache: %d entries %s: %s.", entries, kept, reason)


def patch_worker(module: ModuleType) -> None:
    """Clear the cache before sleep; give the worker stats/clear methods for ``collective_rpc``."""
    worker_cls = module.DiffusionWorker
    replace_once(worker_cls, "sleep", _clearing_before_sleep)
    for name in WEIGHT_UPDATE_SESSION:
        if name in vars(worker_cls):  # 0.32 and later
            replace_once(worker_cls, name, lambda original, name=name: _clearing_around_weight_update(original, name))

    # They read the runner's cache themselves (the attribute our install sets), not the runner's
    # methods of the same names, which another vLLM-Omni release may not have.
    def get_prompt_embed_cache_stats(self: Any) -> dict | None:
        """Return this worker's prompt-embed cache statistics (None without a cache)."""
        cache = getattr(getattr(self, "model_runner", None), "prompt_embed_cache", None)
        return None if cache is None else cache.stats()

    def clear_prompt_embed_cache(self: Any) -> None:
        """Drop this worker's cached embeddings."""
        cache = getattr(getattr(self, "model_runner", None), "prompt_embed_cache", None)
        if cache is not None:
            cache.clear()

    def get_prompt_embed_cache_namespace(self: Any) -> dict | None:
        """Return this worker's directory tier: its root, namespace (fingerprinting now if needed) and
        why it is unused, if it is (None without a directory tier)."""
        cache = getattr(getattr(self, "model_runner", None), "prompt_embed_cache", None)
        directory = getattr(cache, "directory", None)
        if directory is None:
            return None
        namespace = directory.namespace
        return {"root": str(directory.root), "namespace": namespace, "off_reason": directory.off_reason}

    for method in (get_prompt_embed_cache_stats, clear_prompt_embed_cache, get_prompt_embed_cache_namespace):
        if not hasattr(worker_cls, method.__name__):
            setattr(worker_cls, method.__name__, method)


def _clearing_around_weight_update(original: Callable, name: str) -> Callable:
    """Clear every tier as a weight-transfer session starts (after it started) and as it finishes
    (whether it succeeded or not); the directory tier stays suspended in between."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        pipeline = getattr(getattr(self, "model_runner", None), "pipeline", None)
        directory = _directory_tier(pipeline)
        if name == "start_weight_update":
            result = original(self, *args, **kwargs)
            _settle_placement(pipeline)  # the engine writes into the encoder's host copies
            if directory is not None:
                directory.suspend()  # until the session ends: half-written weights have no namespace
            clear_cache(pipeline, "a weight update started (the weights it writes are not named)")
            return result
        try:
            return original(self, *args, **kwargs)
        finally:
            clear_cache(pipeline, "a weight update finished")
            if directory is not None:
                directory.resume()  # fingerprints the new weights on its next use

    return wrapper


def _clearing_before_sleep(original_sleep: Callable) -> Callable:
    @functools.wraps(original_sleep)
    def sleep(self: Any, *args: Any, **kwargs: Any) -> Any:
        pipeline = getattr(getattr(self, "model_runner", None), "pipeline", None)
        level = kwargs.get("level", args[0] if args else 1)
        _settle_placement(pipeline)
        if level == 1:
            release_device_memory(pipeline, "the diffusion worker is going to sleep (level 1)")
        else:
            clear_cache(pipeline, f"the diffusion worker is going to sleep (level {level}: its weights are discarded)")
        return original_sleep(self, *args, **kwargs)

    return sleep


def _settle_placement(pipeline: Any) -> None:
    """Take text encoders placed on a miss off the device if a stray forward left them there."""
    placement = getattr(pipeline, PLACEMENT_ATTRIBUTE, None)
    if placement is not None:
        placement.settle()


def _encoder_prefixes(pipeline: Any) -> tuple[str, ...]:
    """Return the prefixes of the names of the layers and weights of the modules whose outputs the cache keeps
    (``text_encoder.`` and the like, see :func:`~..text_encoders.embedding_sources`)."""
    names = tuple(embedding_sources(pipeline))
    return tuple(f"{name}." for name in names) + names


def _touches_encoder(names: Iterable[str], pipeline: Any) -> bool:
    prefixes = _encoder_prefixes(pipeline)
    return any(name.startswith(prefixes) for name in names)


def patch_lora_manager(module: ModuleType) -> None:
    """Clear the cache when a LoRA change alters text-encoder layers."""
    manager = module.DiffusionLoRAManager
    for name in (*LORA_STATE_CHANGERS, *((_SUSPENSION_RESET,) if _SUSPENSION_RESET in vars(manager) else ())):
        replace_once(
            module.DiffusionLoRAManager, name, lambda original, name=name: _clearing_on_lora_change(original, name)
        )


def _lora_state(manager: Any) -> tuple:
    active = getattr(manager, "_active_adapter_id", None)
    scales = getattr(manager, "_adapter_scales", {})
    return (
        active,
        getattr(manager, "_suspended_adapter_id", None),
        scales.get(active) if active is not None else None,
        frozenset(getattr(manager, "_lora_modules", {})),
    )


def _clearing_on_lora_change(original: Callable, name: str) -> Callable:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = _lora_state(self)
        pipeline = getattr(self, "pipeline", None)
        directory = _directory_tier(pipeline)
        if directory is not None:
            directory.suspend()  # nothing encoded during the change is read or written
        try:
            return original(self, *args, **kwargs)
        finally:
            if _lora_state(self) != before and _touches_encoder(getattr(self, "_lora_modules", {}), pipeline):
                why = f"LoRA {name.strip('_').replace('_', ' ')} changed text-encoder layers"
                if directory is not None:
                    directory.disable(why)  # the fingerprint would not see the LoRA
                clear_cache(pipeline, why)
            if directory is not None:
                directory.resume()

    return wrapper


def watch_weight_loads(pipeline: Any) -> None:
    """Clear the cache when ``pipeline.load_weights`` loads a text-encoder weight: as the first one
    arrives (an encode overlapping the load is then never kept, nor written under the old weights'
    namespace) and again after the load (what was encoded from half-loaded weights goes too)."""
    replace_once(pipeline, "load_weights", lambda original: _clearing_after_encoder_load(original, pipeline))


def _clearing_after_encoder_load(original: Callable, pipeline: Any) -> Callable:
    @functools.wraps(original)
    def load_weights(weights: Iterable[tuple[str, Any]], *args: Any, **kwargs: Any) -> Any:
        _settle_placement(pipeline)  # encoder weights must be written into their host copies
        seen: list[str] = []
        prefixes = _encoder_prefixes(pipeline)
        directory = _directory_tier(pipeline)
        suspended = False

        def observed() -> Iterable[tuple[str, Any]]:
            nonlocal suspended
            for name, tensor in weights:
                seen.append(name)
                if not suspended and name.startswith(prefixes):
                    suspended = True
                    if directory is not None:
                        directory.suspend()  # until the load ends: half-loaded weights have no namespace
                    clear_cache(pipeline, "text-encoder weights are being loaded")
                yield name, tensor

        try:
            return original(observed(), *args, **kwargs)
        finally:
            if _touches_encoder(seen, pipeline):
                clear_cache(pipeline, "text-encoder weights were loaded")
            if suspended and directory is not None:
                directory.resume()  # fingerprints the new weights on its next use

    return load_weights


class StatsLogger:
    """Logs one INFO line about the cache at most every ``interval_s`` seconds, when calls happened."""

    def __init__(self, interval_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last_time = clock()
        self._last_calls = 0

    def __call__(self, cache: PromptEmbedCache) -> None:
        now = self._clock()
        if now - self._last_time < self.interval_s:
            return
        stats = cache.snapshot()
        if stats.calls == self._last_calls:
            return
        self._last_time, self._last_calls = now, stats.calls
        logger.info("%s", stats.summary())
