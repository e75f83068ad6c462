"""How the cache's settings travel from ``AsyncOmni`` / ``Omni`` kwargs and serve flags to the worker.

vLLM-Omni builds a diffusion stage in one of two ways, and both lose our kwargs:

* a model with no registered pipeline (Qwen-Image, FLUX, SD3, ...) goes through the generic
  diffusion builder, which keeps a fixed list of keyword arguments and refuses the rest (0.30 and
  later: ``StageConfigFactory``; 0.27 and 0.28: ``AsyncOmniEngine``, which drops them). Its hook
  resolves every cache setting once, in the caller's process (so a bad kwarg or env var fails
  when the engine is constructed), and puts the resolved :class:`PromptEmbedCacheSettings` into
  the stage config's ``extras`` under :data:`RESOLVED_KEY`;
* a model with a registered pipeline and deploy config (Wan2.2 ``WanPipeline``, HunyuanVideo-1.5,
  GLM-Image, ...) goes through ``VllmOmniConfig.from_pipeline_config`` (0.30 and later) or
  ``StageConfigFactory._create_legacy_from_registry`` (the engine's route on 0.27 and 0.28; were
  both to run, scoping twice changes nothing), which keep a top-level
  kwarg only if it is an engine argument: ``enable_prompt_embed_cache`` and
  ``prompt_embed_cache_size`` were dropped silently and our other settings refused. Its hook
  scopes them to every diffusion stage (``stage_N_...``, so a stage-scoped value still wins, and a
  caller's value wins over the deploy YAML's as vLLM-Omni's own precedence has it), after
  checking them in the caller; our other settings ride in ``extras`` under :data:`EXTRAS_KEY`.

The worker reads either back with :func:`stage_settings`. A deploy-config YAML may name our
extra settings itself, under :data:`EXTRAS_KEY`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings, resolve_settings
from vllm_omni_prompt_cache.settings.schema import (
    ENABLE,
    MAX_SIZE,
    REMOVED,
    PromptEmbedCacheConfigError,
    carried_settings,
)
from vllm_omni_prompt_cache.vllm_omni.imports import replace_once

#: Where a deploy-config stage names our settings: ``engine_args.extras.prompt_embed_cache``.
EXTRAS_KEY = "prompt_embed_cache"
#: Where the kwargs builder leaves the resolved settings inside ``OmniDiffusionConfig.extras``.
RESOLVED_KEY = "prompt_embed_cache_resolved"
KWARG_SOURCE = "AsyncOmni/Omni keyword argument"
#: Settings vLLM-Omni knows itself: they stay in the kwargs (and reach ``OmniDiffusionConfig``).
_UPSTREAM_SETTINGS = (ENABLE.name, MAX_SIZE.name)


def patch_stage_config_factory(module: ModuleType) -> None:
    """Make vLLM-Omni 0.30's generic diffusion stage builder carry our settings (see the module docstring)."""
    replace_once(module.StageConfigFactory, "_normalize_default_diffusion", _carrying_our_settings)


def patch_engine_stage_builder(module: ModuleType) -> None:
    """The same for vLLM-Omni 0.27 and 0.28, whose engine builds the generic stage itself from a fixed
    list of kwargs (ours were dropped without a word)."""
    replace_once(module.AsyncOmniEngine, "_create_default_diffusion_stage_cfg", _engine_builder_carrying_our_settings)


def patch_deploy_config(module: ModuleType) -> None:
    """Make the deploy-config builder scope our settings to each diffusion stage."""
    replace_once(module.VllmOmniConfig, "from_pipeline_config", _scoping_our_settings_to_diffusion_stages)


def patch_legacy_deploy_config(module: ModuleType) -> None:
    """The same for the route vLLM-Omni 0.27 and 0.28 engines build registered pipelines by
    (``create_legacy_stage_configs_from_model``), which never reaches ``from_pipeline_config``: our
    settings stayed plain engine arguments there, and the worker's config dropped them without a word."""
    replace_once(module.StageConfigFactory, "_create_legacy_from_registry", _scoping_on_the_legacy_route)


def _resolved_in_caller(kwargs: dict[str, Any]) -> tuple[PromptEmbedCacheSettings, dict[str, Any]]:
    """Resolve our settings from ``kwargs`` (and the environment); return them and the kwargs vLLM-Omni knows."""
    given = {setting.name: kwargs.get(setting.name) for setting in carried_settings()}
    given.update({name: kwargs[name] for name in REMOVED if name in kwargs})  # refused by name, not dropped
    # vLLM-Omni refuses (0.30) or drops (0.27, 0.28) keyword arguments it does not know; its own two stay.
    kwargs = {name: value for name, value in kwargs.items() if name not in given or name in _UPSTREAM_SETTINGS}
    # Declared methods' classes are imported where the pipeline loads, in the worker (importing an adapter here
    # could patch or need what only the worker has).
    settings = resolve_settings(given, source=KWARG_SOURCE)
    return settings, kwargs


def _with_resolved(engine_args: Any, settings: PromptEmbedCacheSettings) -> None:
    engine_args["extras"] = {**(engine_args.get("extras") or {}), RESOLVED_KEY: settings.as_dict()}


def _carrying_our_settings(original: classmethod) -> classmethod:
    original_function = original.__func__

    @functools.wraps(original_function)
    def normalize_default_diffusion(cls: type, kwargs: dict[str, Any]) -> Any:
        settings, kwargs = _resolved_in_caller(kwargs)
        engine_args, *rest = original_function(cls, kwargs)
        _with_resolved(engine_args, settings)
        return (engine_args, *rest)

    return classmethod(normalize_default_diffusion)


def _engine_builder_carrying_our_settings(original: staticmethod) -> staticmethod:
    original_function = original.__func__

    @functools.wraps(original_function)
    def create_default_diffusion_stage_cfg(kwargs: dict[str, Any]) -> list:
        settings, kwargs = _resolved_in_caller(kwargs)
        stages = original_function(kwargs)
        for stage in stages:
            _with_resolved(stage["engine_args"], settings)
        return stages

    return staticmethod(create_default_diffusion_stage_cfg)


def _scoping_our_settings_to_diffusion_stages(original: classmethod) -> classmethod:
    original_function = original.__func__

    @functools.wraps(original_function)
    def from_pipeline_config(cls: type, pipeline_cfg: Any, *args: Any, **kwargs: Any) -> Any:
        overrides = kwargs.get("cli_overrides")
        if overrides:
            kwargs["cli_overrides"] = scope_to_diffusion_stages(pipeline_cfg, overrides)
        return original_function(cls, pipeline_cfg, *args, **kwargs)

    return classmethod(from_pipeline_config)


def _scoping_on_the_legacy_route(original: classmethod) -> classmethod:
    original_function = original.__func__

    @functools.wraps(original_function)
    def create_legacy_from_registry(cls: type, pipeline_cfg: Any, cli_overrides: Any, *args: Any, **kwargs: Any) -> Any:
        if cli_overrides:
            cli_overrides = scope_to_diffusion_stages(pipeline_cfg, cli_overrides)
        stages, *rest = original_function(cls, pipeline_cfg, cli_overrides, *args, **kwargs)
        for stage in stages or ():
            _merge_over_yaml_extras(stage)
        return (stages, *rest)

    return classmethod(create_legacy_from_registry)


def _merge_over_yaml_extras(stage: Any) -> None:
    """Make an ``extras`` override that carries our settings add to the stage's deploy YAML
    ``engine_args.extras`` (ours merged setting by setting), as 0.30 merges them: 0.27 and 0.28 replace
    the YAML's extras with the override. A user's own extras overrides keep their release's meaning."""
    overrides = getattr(stage, "runtime_overrides", None)
    yaml_args = getattr(stage, "yaml_engine_args", None)
    if not isinstance(overrides, dict) or not isinstance(overrides.get("extras"), Mapping):
        return
    if EXTRAS_KEY not in overrides["extras"]:
        return
    yaml_extras = dict(yaml_args.get("extras") or {}) if isinstance(yaml_args, Mapping) else {}
    merged = {**yaml_extras, **overrides["extras"]}
    if isinstance(yaml_extras.get(EXTRAS_KEY), Mapping) and isinstance(overrides["extras"].get(EXTRAS_KEY), Mapping):
        merged[EXTRAS_KEY] = {**yaml_extras[EXTRAS_KEY], **overrides["extras"][EXTRAS_KEY]}
    overrides["extras"] = merged


def scope_to_diffusion_stages(pipeline_cfg: Any, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``overrides`` with our settings scoped to each diffusion stage of ``pipeline_cfg``.

    Per stage, ``stage_N_<setting>`` wins over the top-level ``<setting>``. The two settings
    vLLM-Omni knows become ``stage_N_`` fields; ours go to ``stage_N_extras[EXTRAS_KEY]``, which
    vLLM-Omni merges over the deploy YAML's extras. A stage whose extras already hold the resolved
    settings (the generic builder ran first) is left alone.
    """
    names = [setting.name for setting in carried_settings()]
    if not any(key in names or _stage_scoped(key) for key in overrides):
        return dict(overrides)
    top_level = {name: overrides[name] for name in names if overrides.get(name) is not None}
    result = {key: value for key, value in overrides.items() if key not in names}  # None means not given
    diffusion_stages = [stage.stage_id for stage in pipeline_cfg.stages if _is_diffusion(stage)]
    for stage_id in diffusion_stages:
        prefix = f"stage_{stage_id}_"
        extras = dict(result.get(f"{prefix}extras") or {})
        if RESOLVED_KEY in extras:
            continue
        given = {name: result.pop(f"{prefix}{name}", None) for name in names}
        given = {name: top_level.get(name) if value is None else value for name, value in given.items()}
        where = f"{KWARG_SOURCE} for diffusion stage {stage_id}"
        resolve_settings(given, source=where)  # a bad value fails here, at construction
        for name in _UPSTREAM_SETTINGS:
            if given[name] is not None:
                result[f"{prefix}{name}"] = given[name]
        ours = {name: value for name, value in given.items() if value is not None and name not in _UPSTREAM_SETTINGS}
        if ours:
            result[f"{prefix}extras"] = {**extras, EXTRAS_KEY: {**(extras.get(EXTRAS_KEY) or {}), **ours}}
    stray = []
    for key in [key for key in result if _stage_scoped(key)]:
        if int(_stage_scoped(key)[1]) in diffusion_stages:
            continue  # a stage the generic builder already resolved
        if result.pop(key) is not None:
            stray.append(key)
    if stray or (not diffusion_stages and top_level.get(ENABLE.name)):
        raise PromptEmbedCacheConfigError(
            f"prompt-embed cache settings {sorted(stray) or sorted(top_level)} for a stage that is not a diffusion "
            f"stage of {getattr(pipeline_cfg, 'model_type', 'this pipeline')!r} (diffusion stages: "
            f"{diffusion_stages}): the cache only wraps a diffusion pipeline's encode_prompt"
        )
    return result


def _stage_scoped(key: str) -> re.Match[str] | None:
    """Match ``stage_N_<setting name>``: group 1 the stage, group 2 the setting."""
    names = "|".join(re.escape(setting.name) for setting in carried_settings())
    return re.match(r"^stage_(\d+)_(" + names + r")$", key)


def _is_diffusion(stage: Any) -> bool:
    return getattr(getattr(stage, "execution_type", None), "value", None) == "diffusion"


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
