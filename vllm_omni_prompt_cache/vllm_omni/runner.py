"""Where a diffusion worker gets its cache: right after ``DiffusionModelRunner.load_model``.

Stock ``load_model`` resolves two settings and calls ``install_prompt_embed_cache`` (a name it
imported at import time) with them. Ours need the whole stage config, so the runner module's
installer name is pointed at :func:`_installed_after_load_model` (it installs nothing) and
``load_model`` is wrapped: once the pipeline is built, :func:`install_for_stage` installs the
cache the stage's settings ask for, with ``self.od_config`` in hand. Interaction handlers that
``load_model`` built after its own install point captured ``pipeline.encode_prompt`` unwrapped;
they are built again so they see the cache, as they would have in stock vLLM-Omni.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any

import torch

from vllm_omni_prompt_cache.calls.methods import resolve_declared_methods
from vllm_omni_prompt_cache.calls.wrapper import install_prompt_embed_cache
from vllm_omni_prompt_cache.encoders.residency import (
    PLACEMENT_ATTRIBUTE,
    EncoderMoves,
    EncoderPlacement,
)
from vllm_omni_prompt_cache.encoders.text_encoders import text_encoders
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.settings.schema import (
    DIRECTORY_KEY_FILE,
    ENCODER_ON_MISS,
    METHODS,
    PromptEmbedCacheConfigError,
)
from vllm_omni_prompt_cache.store.tiers.directory_trust import read_key
from vllm_omni_prompt_cache.vllm_omni.bindings import upstream_cache_module
from vllm_omni_prompt_cache.vllm_omni.imports import replace_once
from vllm_omni_prompt_cache.vllm_omni.lifecycle import StatsLogger, watch_weight_loads
from vllm_omni_prompt_cache.vllm_omni.offload import observe_module_offload, refusal_with_offload
from vllm_omni_prompt_cache.vllm_omni.settings import stage_settings

logger = logging.getLogger("vllm_omni_prompt_cache")

RUNNER_MODULE = "vllm_omni.diffusion.worker.diffusion_model_runner"
#: Seconds between the worker's cache statistics log lines.
STATS_LOG_INTERVAL_S = 30.0
#: Whether the installed vLLM-Omni's module offload can be counted (the plugin sets it from its hook points).
count_offload_moves = True


def patch_runner_module(module: ModuleType) -> None:
    """Install the stage's cache after ``load_model``, instead of inside it."""
    if not hasattr(module, "install_prompt_embed_cache") or not hasattr(module.DiffusionModelRunner, "load_model"):
        logger.warning(
            "vllm-omni-prompt-cache: %s has no install_prompt_embed_cache / DiffusionModelRunner.load_model; "
            "the worker keeps vLLM-Omni's cache.",
            module.__name__,
        )
        return
    module.install_prompt_embed_cache = _installed_after_load_model
    replace_once(module.DiffusionModelRunner, "load_model", _installing_after)
    if hasattr(module.DiffusionModelRunner, "profile_run"):
        replace_once(module.DiffusionModelRunner, "profile_run", _profiling_as_misses)


def _installed_after_load_model(pipeline: Any, **_: Any) -> None:
    """Stock ``load_model``'s install call: a no-op, :func:`install_for_stage` follows it."""
    return None


def _installing_after(load_model: Any) -> Any:
    @functools.wraps(load_model)
    def load_model_then_install(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = load_model(self, *args, **kwargs)
        pipeline = getattr(self, "pipeline", None)
        if pipeline is not None:  # a "dummy" load builds no pipeline
            settings = stage_settings(self.od_config)
            ranks = getattr(getattr(self.od_config, "parallel_config", None), "world_size", 1) or 1
            self.prompt_embed_cache = install_for_stage(
                pipeline, settings, self.od_config.model_class_name, ranks=ranks
            )
            if self.prompt_embed_cache is not None:
                _rebuild_interaction_handlers(self)
            placement = getattr(pipeline, PLACEMENT_ATTRIBUTE, None)
            if placement is not None and placement.device.type != "cpu" and hasattr(self, "model_memory_usage"):
                # Measured with the encoders on the device; a memory profile adds a miss's placement itself.
                self.model_memory_usage = max(0, int(self.model_memory_usage) - placement.host_bytes())
        return result

    return load_model_then_install


def _profiling_as_misses(profile_run: Any) -> Any:
    """Profile memory with every encode a miss when text encoders are placed on a miss: the budget
    vLLM-Omni derives must hold a miss's peak (the encoders placed for the encode), not that of a
    request the cache serves (a profile request's prompt may well be cached). The profile's calls
    are then counted as bypasses ("cache disabled")."""

    @functools.wraps(profile_run)
    def profile_run_as_misses(self: Any, *args: Any, **kwargs: Any) -> Any:
        pipeline = getattr(self, "pipeline", None)
        cache = getattr(pipeline, "_prompt_embed_cache", None)
        if getattr(pipeline, PLACEMENT_ATTRIBUTE, None) is None or cache is None:
            return profile_run(self, *args, **kwargs)
        with cache.disabled():
            return profile_run(self, *args, **kwargs)

    return profile_run_as_misses


def _rebuild_interaction_handlers(runner: Any) -> None:
    """Build the runner's interaction coordinator again, now that ``encode_prompt`` is wrapped."""
    coordinator = getattr(runner, "_interaction_coordinator", None)
    if coordinator is None:
        return
    runner._interaction_coordinator = type(coordinator).build(runner.pipeline, runner.od_config)
    if hasattr(runner.pipeline, "_interaction_coordinator"):  # as stock load_model hands it over
        runner.pipeline._interaction_coordinator = runner._interaction_coordinator


def install_for_stage(
    pipeline: Any, settings: PromptEmbedCacheSettings, model_tag: str | None, *, ranks: int = 1
) -> Any:
    """Install the cache ``settings`` ask for on ``pipeline``; return it, or None when off.

    ``ranks``: the diffusion stage's world size. Every rank must take the same hit or miss decision
    (see docs/design.md, "Rank consistency"); the other tiers decide from the calls alone, but what
    a shared directory holds can change between two ranks' reads, so with more than one rank the
    directory tier stays off.
    """
    if not settings.enabled:
        return None
    directory = settings.directory
    if directory is not None and ranks > 1:
        logger.warning(
            "vllm-omni-prompt-cache: directory tier %s off: this diffusion stage runs on %d ranks, and a shared "
            "directory may change between their reads, so one rank could skip the encoder while another runs it "
            "(and its collectives). The device and host tiers stay on.",
            directory,
            ranks,
        )
        directory = None
    audit = settings.audit
    if audit and ranks > 1:
        logger.warning(
            "vllm-omni-prompt-cache: audits off: this diffusion stage runs on %d ranks, and an audit that finds a "
            "difference on one rank only would turn the cache off there alone (one rank encoding, and running "
            "the encoder's collectives, while another hits).",
            ranks,
        )
        audit = 0.0
    key_source = settings.sources.get(DIRECTORY_KEY_FILE.name, "the stage's settings")
    if settings.encoder_on_miss:
        _check_encoder_on_miss(pipeline, settings)
    if settings.backend == "vllm-omni":
        upstream = upstream_cache_module()
        return upstream.install_prompt_embed_cache(
            pipeline, max_size=settings.max_size, enabled=True, model_tag=model_tag
        )
    placed = settings.replace(
        directory=directory,
        audit=audit,
        report=StatsLogger(STATS_LOG_INTERVAL_S),
        directory_key=None if directory is None else read_key(settings.directory_key_file, key_source),
        methods=resolve_declared_methods(settings.methods, settings.sources.get(METHODS.name, "the stage's settings")),
    )
    cache = install_prompt_embed_cache(pipeline, max_size=settings.max_size, model_tag=model_tag, settings=placed)
    if cache is not None:
        watch_weight_loads(pipeline)
        _count_encoder_moves(pipeline, cache, settings)
    return cache


def _check_encoder_on_miss(pipeline: Any, settings: PromptEmbedCacheSettings) -> None:
    """Raise, naming the setting and its source, when the text encoders cannot be placed on a miss."""
    source = settings.sources.get(ENCODER_ON_MISS.name, "the stage's settings")
    why = refusal_with_offload(pipeline)
    if why is None and settings.backend == "vllm-omni":
        why = "it needs this package's cache (prompt_embed_cache_backend=content-keyed), which brackets each encode"
    lora_components = set(getattr(pipeline, "_lora_components", ()) or ())
    if why is None and lora_components & set(text_encoders(pipeline)):
        why = (
            f"the pipeline puts LoRA on its text encoders ({', '.join(sorted(lora_components))}); LoRA weights "
            "live outside the encoder's parameters and would not follow it"
        )
    if why is not None:
        raise PromptEmbedCacheConfigError(f"invalid {ENCODER_ON_MISS.name}=True from {source}: {why}")


def _count_encoder_moves(pipeline: Any, cache: Any, settings: PromptEmbedCacheSettings) -> None:
    """Count the text encoders' moves on ``cache``: vLLM-Omni's module offload's, and place them on a miss
    when ``settings`` ask (the pipeline then holds an :class:`EncoderPlacement`)."""
    if getattr(cache, "moves", None) is not None:  # installed already (the install returned that cache)
        return
    moves = EncoderMoves()
    observed = (
        observe_module_offload(pipeline, moves, text_encoders=not settings.encoder_on_miss)
        if count_offload_moves
        else None
    )
    placement = None
    if settings.encoder_on_miss:
        placement = _encoder_placement(pipeline, moves)
        if placement is not None:
            object.__setattr__(pipeline, PLACEMENT_ATTRIBUTE, placement)
    if observed is not None or placement is not None:
        cache.attach(moves=moves)


def _encoder_placement(pipeline: Any, moves: EncoderMoves) -> EncoderPlacement | None:
    """Return the text encoders parked in host memory, to be placed where they are now on each miss."""
    encoders = text_encoders(pipeline)
    devices = {tensor.device for module in encoders.values() for tensor in module.parameters()}
    pipeline_device = getattr(pipeline, "device", None)
    if not encoders or len(devices) != 1:
        logger.warning(
            "vllm-omni-prompt-cache: %s=True does nothing for %s: %s.",
            ENCODER_ON_MISS.name,
            type(pipeline).__name__,
            "it has no text-encoder module"
            if not encoders
            else f"its text encoders are on several devices ({', '.join(sorted(map(str, devices)))})",
        )
        return None
    (device,) = devices
    if device.type == "cpu" and isinstance(pipeline_device, torch.device) and pipeline_device.type != "cpu":
        logger.warning(
            "vllm-omni-prompt-cache: %s=True does nothing for %s: its text encoders already run on the host.",
            ENCODER_ON_MISS.name,
            type(pipeline).__name__,
        )
        return None
    placement = EncoderPlacement(encoders, device, moves)
    logger.info(
        "vllm-omni-prompt-cache: text encoders %s of %s kept in host memory (%.1f MiB%s), placed on %s only "
        "while a cache miss encodes.",
        ", ".join(encoders),
        type(pipeline).__name__,
        placement.host_bytes() / 2**20,
        ", pinned" if device.type == "cuda" else "",
        device,
    )
    return placement
