"""How the cache's settings travel from ``AsyncOmni`` / ``Omni`` kwargs and serve flags to the worker.

vLLM-Omni 0.30 builds a diffusion stage's config from a fixed list of keyword arguments and
drops the rest. The hook below resolves every cache setting once, in the caller's process (so a
bad kwarg or env var fails when the engine is constructed), and puts the one resolved
:class:`PromptEmbedCacheSettings` into the stage config's ``extras`` under :data:`EXTRAS_KEY`.
The worker reads it back with :func:`stage_settings`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from vllm_omni_prompt_cache.config import (
    ENABLE,
    MAX_SIZE,
    SETTINGS,
    PromptEmbedCacheSettings,
    resolve_settings,
)
from vllm_omni_prompt_cache.vllm_omni.imports import replace_once

#: Key of our settings inside ``OmniDiffusionConfig.extras``.
EXTRAS_KEY = "prompt_embed_cache"
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
        kwargs = dict(kwargs)
        given = {
            setting.name: kwargs.get(setting.name) if setting.name in _UPSTREAM_SETTINGS else kwargs.pop(setting.name)
            for setting in SETTINGS
            if setting.name in kwargs
        }
        settings = resolve_settings(given, source=KWARG_SOURCE)
        engine_args, *rest = original_function(cls, kwargs)
        engine_args["extras"] = {**(engine_args.get("extras") or {}), EXTRAS_KEY: settings.as_dict()}
        return (engine_args, *rest)

    return classmethod(normalize_default_diffusion)


def stage_settings(od_config: Any) -> PromptEmbedCacheSettings:
    """Return the settings a diffusion stage runs with.

    A stage built from kwargs carries them resolved (see above). A stage from a deploy config may
    name some of ours under ``extras.prompt_embed_cache``; those, its own two fields and the
    environment are resolved here, once.
    """
    extras = getattr(od_config, "extras", None) or {}
    ours: Mapping[str, Any] = extras.get(EXTRAS_KEY) or {}
    if "sources" in ours:  # written by the hook above
        return PromptEmbedCacheSettings.from_dict(ours, "the diffusion stage config")
    given = {
        ENABLE.name: getattr(od_config, ENABLE.name, None),
        MAX_SIZE.name: getattr(od_config, MAX_SIZE.name, None),
        **ours,
    }
    return resolve_settings(given, source="diffusion stage config")
