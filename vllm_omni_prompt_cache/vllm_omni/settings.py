"""How our settings travel from ``AsyncOmni`` / ``Omni`` kwargs and serve flags to the worker.

vLLM-Omni 0.30 builds a diffusion stage's config from a fixed list of keyword arguments and
drops the rest. ``enable_prompt_embed_cache`` and ``prompt_embed_cache_size`` are on that list
and reach ``OmniDiffusionConfig`` as they always did. Our extra settings ride in the config's
``extras`` dict under :data:`EXTRAS_KEY`; the hook below puts them there, after validating every
cache setting (env vars included) so that a bad value fails when the engine is constructed, in
the caller's process, rather than later in a worker.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from vllm_omni_prompt_cache.config import (
    ENABLE,
    MAX_BYTES,
    MAX_SIZE,
    VERIFY,
    PromptEmbedCacheSettings,
    parse_setting,
    resolve_prompt_embed_cache_settings,
)
from vllm_omni_prompt_cache.vllm_omni.imports import replace_once

#: Key of our settings inside ``OmniDiffusionConfig.extras``.
EXTRAS_KEY = "prompt_embed_cache"
#: Settings vLLM-Omni does not know; they are carried in ``extras``.
EXTRA_SETTINGS = (MAX_BYTES, VERIFY)
KWARG_SOURCE = "AsyncOmni/Omni keyword argument"


def patch_stage_config_factory(module: ModuleType) -> None:
    """Make vLLM-Omni's default diffusion stage builder validate and carry our settings."""
    replace_once(module.StageConfigFactory, "_normalize_default_diffusion", _carrying_our_settings)


def _carrying_our_settings(original: classmethod) -> classmethod:
    original_function = original.__func__

    @functools.wraps(original_function)
    def normalize_default_diffusion(cls: type, kwargs: dict[str, Any]) -> Any:
        kwargs = dict(kwargs)
        # Normalized here ("256MiB" -> 268435456) so the worker receives plain values.
        extra = {
            s.name: parse_setting(s, kwargs.pop(s.name), f"{KWARG_SOURCE} {s.name}")
            for s in EXTRA_SETTINGS
            if kwargs.get(s.name) is not None
        }
        resolve_prompt_embed_cache_settings(
            enable=kwargs.get(ENABLE.name),
            max_size=kwargs.get(MAX_SIZE.name),
            max_bytes=extra.get(MAX_BYTES.name),
            verify=extra.get(VERIFY.name),
            source=KWARG_SOURCE,
        )
        engine_args, *rest = original_function(cls, kwargs)
        if extra:
            engine_args["extras"] = {**(engine_args.get("extras") or {}), EXTRAS_KEY: extra}
        return (engine_args, *rest)

    return classmethod(normalize_default_diffusion)


def worker_settings(od_config: Any, *, enable: Any, max_size: Any) -> PromptEmbedCacheSettings:
    """Return the settings a diffusion worker runs with: env vars over the stage config."""
    extras = getattr(od_config, "extras", None) or {}
    ours: Mapping[str, Any] = extras.get(EXTRAS_KEY) or {}
    return resolve_prompt_embed_cache_settings(
        enable=enable,
        max_size=max_size,
        max_bytes=ours.get(MAX_BYTES.name),
        verify=ours.get(VERIFY.name),
        source="diffusion stage config",
    )
