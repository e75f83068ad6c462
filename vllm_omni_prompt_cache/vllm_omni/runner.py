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

from vllm_omni_prompt_cache.config import METHODS, ROW_LAYOUTS, PromptEmbedCacheSettings
from vllm_omni_prompt_cache.vllm_omni.bindings import upstream_cache_module
from vllm_omni_prompt_cache.vllm_omni.imports import replace_once
from vllm_omni_prompt_cache.vllm_omni.layouts import resolve_declared_layouts
from vllm_omni_prompt_cache.vllm_omni.lifecycle import StatsLogger, watch_weight_loads
from vllm_omni_prompt_cache.vllm_omni.methods import resolve_declared_methods
from vllm_omni_prompt_cache.vllm_omni.settings import stage_settings
from vllm_omni_prompt_cache.wrapper import install_prompt_embed_cache

logger = logging.getLogger("vllm_omni_prompt_cache")

RUNNER_MODULE = "vllm_omni.diffusion.worker.diffusion_model_runner"
#: Seconds between the worker's cache statistics log lines.
STATS_LOG_INTERVAL_S = 30.0


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
        return result

    return load_model_then_install


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
    if settings.backend == "vllm-omni":
        upstream = upstream_cache_module()
        return upstream.install_prompt_embed_cache(
            pipeline, max_size=settings.max_size, enabled=True, model_tag=model_tag
        )
    cache = install_prompt_embed_cache(
        pipeline,
        max_size=settings.max_size,
        model_tag=model_tag,
        max_bytes=settings.max_bytes,
        verify=settings.verify,
        report=StatsLogger(STATS_LOG_INTERVAL_S),
        row_layouts=resolve_declared_layouts(
            settings.row_layouts, settings.sources.get(ROW_LAYOUTS.name, "the stage's settings")
        ),
        host_bytes=settings.host_bytes,
        directory=directory,
        directory_bytes=settings.directory_bytes,
        methods=resolve_declared_methods(settings.methods, settings.sources.get(METHODS.name, "the stage's settings")),
    )
    if cache is not None:
        watch_weight_loads(pipeline)
    return cache
