"""How the cache's settings travel from ``AsyncOmni`` / ``Omni`` kwargs and serve flags to the worker.

vLLM-Omni 0.30 builds a diffusion stage's config from a fixed list of keyword arguments and
drops the rest. The hook below resolves every cache setting once, in the caller's process (so a
bad kwarg or env var fails when the engine is constructed), and puts the one resolved
:class:`PromptEmbedCacheSettings` into the stage config's ``extras`` under :data:`RESOLVED_KEY`.
The worker reads it back with :func:`stage_settings`. A deploy-config YAML may name our extra
settings itself, under :data:`EXTRAS_KEY`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from vllm_omni_prompt_cache.config import (
    ENABLE,
    MAX_SIZE,
    ROW_LAYOUTS,
    SETTINGS,
    PromptEmbedCacheConfigError,
    PromptEmbedCacheSettings,
    resolve_settings,
)
from vllm_omni_prompt_cache.vllm_omni.imports import replace_once
from vllm_omni_prompt_cache.vllm_omni.layouts import resolve_declared_layouts

#: Where a deploy-config stage names our settings: ``engine_args.extras.prompt_embed_cache``.
EXTRAS_KEY = "prompt_embed_cache"
#: Where the kwargs builder leaves the resolved settings inside ``OmniDiffusionConfig.extras``.
RESOLVED_KEY = "prompt_embed_cache_resolved"
KWARG_SOURCE = "AsyncOmni/Omni keyword argument"
#: Settings vLLM-Omni knows itself: they stay in the kwargs (and reach ``OmniDiffusionConfig``).
_UPSTREAM_SETTINGS = (ENABLE.name, MAX_SIZE.name)


def patch_stage_config_factory(module: ModuleType) -> None:
    """Make vLLM-Omni's default diffusion stage builder resolve and carry our settings."""
    replace_once(module.StageConfigFactory, "_normalize_default_diffusion", _carrying_our_settings)


def _carrying_our_settings(original: classmethod) -> classmethod:
    original_function = original.__func__

    @functools.wraps(original_function)
    def normalize_default_diffusion(cls: type, kwargs: dict[str, Any]) -> Any:
        given = {setting.name: kwargs.get(setting.name) for setting in SETTINGS}
        # vLLM-Omni refuses keyword arguments it does not know; its own two stay.
        kwargs = {name: value for name, value in kwargs.items() if name not in given or name in _UPSTREAM_SETTINGS}
        settings = resolve_settings(given, source=KWARG_SOURCE)
        # A layout reference that names nothing fails here, before any stage loads.
        resolve_declared_layouts(settings.row_layouts, settings.sources.get(ROW_LAYOUTS.name, KWARG_SOURCE))
        engine_args, *rest = original_function(cls, kwargs)
        engine_args["extras"] = {**(engine_args.get("extras") or {}), RESOLVED_KEY: settings.as_dict()}
        return (engine_args, *rest)

    return classmethod(normalize_default_diffusion)


def stage_settings(od_config: Any) -> PromptEmbedCacheSettings:
    """Return the settings a diffusion stage runs with.

    A stage built from kwargs carries them resolved (see above). A stage from a deploy config may
    name our extra settings under ``extras.prompt_embed_cache``; those, the stage's own two fields
    and the environment are resolved here, once.
    """
    extras = getattr(od_config, "extras", None)
    if not isinstance(extras, Mapping):  # a config built without vLLM-Omni's builders may lack it
        extras = {}
    if RESOLVED_KEY in extras:
        return PromptEmbedCacheSettings.from_dict(extras[RESOLVED_KEY], "the diffusion stage config")
    ours: Mapping[str, Any] = extras.get(EXTRAS_KEY) or {}
    upstream_named = sorted(set(ours) & set(_UPSTREAM_SETTINGS))
    if upstream_named:
        # vLLM-Omni reads these from the stage's own fields (its data-parallel safety check too).
        raise PromptEmbedCacheConfigError(
            f"{upstream_named} under extras.{EXTRAS_KEY} of a diffusion stage: set them as the stage's own "
            f"engine_args ({', '.join(_UPSTREAM_SETTINGS)}), where vLLM-Omni reads them"
        )
    given = {
        ENABLE.name: getattr(od_config, ENABLE.name, None),
        MAX_SIZE.name: getattr(od_config, MAX_SIZE.name, None),
        **ours,
    }
    return resolve_settings(given, source="diffusion stage config")
