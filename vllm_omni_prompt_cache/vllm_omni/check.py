"""``vllm-omni-prompt-cache check``: what the plugin will do in this environment, before any engine starts.

It reads what an engine would: the installed versions, the entry points vLLM and vLLM-Omni load,
the hook points in vLLM-Omni's sources, the plugin switch and the cache's environment variables.
It imports neither vLLM nor vLLM-Omni, so it answers in about a second.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable

from vllm_omni_prompt_cache.settings.resolved import env_flag, resolve_prompt_embed_cache_settings
from vllm_omni_prompt_cache.settings.schema import ENABLE, PromptEmbedCacheConfigError, carried_settings
from vllm_omni_prompt_cache.vllm_omni import hook_points, releases
from vllm_omni_prompt_cache.vllm_omni.plugin import PLUGIN_ENV

DISTRIBUTION = "vllm-omni-prompt-cache"
#: The entry points the plugin needs, by group (the CPU platform's are optional and not listed).
ENTRY_POINTS = {
    "vllm.general_plugins": "prompt_embed_cache",
    "vllm_omni.general_plugins": "prompt_embed_cache",
    "vllm.platform_plugins": "prompt_embed_cache_early",
    "vllm_omni.platform_plugins": "prompt_embed_cache_early",
}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check(say: Callable[[str], None] = print) -> int:
    """Say what the plugin will do here; return 0 if every engine will get the cache, 1 if not."""
    versions = {name: _version(name) for name in (DISTRIBUTION, "vllm-omni", "vllm", "torch")}
    say("installed: " + ", ".join(f"{name} {version or '(not installed)'}" for name, version in versions.items()))
    problems: list[str] = []
    missing_entry_points = [
        f"{group}:{name}"
        for group, name in ENTRY_POINTS.items()
        if name not in importlib.metadata.entry_points(group=group).names
    ]
    say("entry points: " + (", ".join(missing_entry_points) + " missing" if missing_entry_points else "all registered"))
    if missing_entry_points:
        problems.append("this package is not installed in this environment (its entry points are missing)")
    try:
        if not env_flag(PLUGIN_ENV, default=True):
            problems.append(f"{PLUGIN_ENV}=0 switches the plugin off")
    except PromptEmbedCacheConfigError as error:
        problems.append(str(error))
    if versions["vllm-omni"] is None or hook_points.vllm_omni_source_root() is None:
        problems.append("vLLM-Omni is not installed")
    else:
        missing = hook_points.missing_by_feature()
        for feature, lacking in missing.items():
            points = len(hook_points.required(feature))
            state = "off, for want of " + ", ".join(map(str, lacking)) if lacking else "on"
            say(f"  {feature}: {points - len(lacking)} of {points} hook points found: {state}")
        if missing[hook_points.CACHE]:
            problems.append(f"vLLM-Omni {versions['vllm-omni']} lacks hook points the cache needs")
        elif not releases.is_tested(versions["vllm-omni"]):
            say(f"note: tested on vLLM-Omni {releases.tested_list()}; {versions['vllm-omni']} is not one of them")
    try:
        settings = resolve_prompt_embed_cache_settings()
    except PromptEmbedCacheConfigError as error:
        problems.append(str(error))
    else:
        from_env = [
            setting for setting in carried_settings() if settings.sources[setting.name].startswith("environment")
        ]
        if from_env:
            values = (f"{setting.env}: {setting.name}={getattr(settings, setting.field)!r}" for setting in from_env)
            say("from the environment (over kwargs and flags): " + ", ".join(values))
        if ENABLE in from_env and not settings.enabled:
            problems.append(f"{ENABLE.env} switches the cache off, whatever the kwargs and flags say")
    if problems:
        for problem in problems:
            say(f"not active: {problem}")
        return 1
    how = (
        f"switched on for every engine by {ENABLE.env}"
        if ENABLE.env in os.environ
        else "where enable_prompt_embed_cache=True or --enable-prompt-embed-cache turns it on"
    )
    say(
        "hits: every encode runs as written, each text-encoder call in it answered with what that encoder returned "
        "for the same inputs; an encode that reaches no text encoder the cache recognises is cached whole on its "
        "arguments, counted as key_only_hits (stats(), /metrics vllm_omni:prompt_embed_cache_key_only_hits_total), "
        "and the install log names the text encoders it serves"
    )
    say(f"active: diffusion engines in this environment use the content-keyed cache, {how}")
    return 0
