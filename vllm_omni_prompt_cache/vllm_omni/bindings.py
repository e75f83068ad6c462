"""Upstream's cache module, with its public API swapped for ours.

Code that imports ``vllm_omni.diffusion.cache.prompt_embed_cache`` (or the package's
re-exports) after the plugin loaded gets this package's ``install_prompt_embed_cache``,
``uninstall_prompt_embed_cache``, ``PromptEmbedCache`` and ``resolve_prompt_embed_cache_config``.
Upstream's private miss sentinel becomes ours too, so code written against upstream's
``get`` / ``put`` (its own wrapper included) keeps working on our store.

vLLM-Omni's own cache stays available, unpatched, through :func:`upstream_cache_module`: a second
copy of the module loaded from vLLM-Omni's file, for engines configured with
``prompt_embed_cache_backend="vllm-omni"``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
from types import ModuleType
from typing import Any

from vllm_omni_prompt_cache.calls.wrapper import install_prompt_embed_cache, uninstall_prompt_embed_cache
from vllm_omni_prompt_cache.settings.resolved import resolve_prompt_embed_cache_config
from vllm_omni_prompt_cache.store.prompt_embed_cache import MISS, PromptEmbedCache

logger = logging.getLogger("vllm_omni_prompt_cache")

CACHE_MODULE = "vllm_omni.diffusion.cache.prompt_embed_cache"
CACHE_PACKAGE = "vllm_omni.diffusion.cache"
#: The public API both modules share; the package re-exports it.
PUBLIC_API: dict[str, Any] = {
    "install_prompt_embed_cache": install_prompt_embed_cache,
    "uninstall_prompt_embed_cache": uninstall_prompt_embed_cache,
    "PromptEmbedCache": PromptEmbedCache,
    "resolve_prompt_embed_cache_config": resolve_prompt_embed_cache_config,
}
_SENTINEL = "_CACHE_MISS"  # what upstream's get() returns for a miss
_PRISTINE_NAME = "vllm_omni_prompt_cache._upstream_prompt_embed_cache"


def patch_cache_module(module: ModuleType) -> None:
    """Swap the cache module's public API (and the package's re-exports of it) for ours."""
    missing = [name for name in (*PUBLIC_API, _SENTINEL) if not hasattr(module, name)]
    if missing:
        logger.warning(
            "vllm-omni-prompt-cache: %s lacks %s; leaving vLLM-Omni's prompt-embed cache unchanged.",
            module.__name__,
            missing,
        )
        return
    upstream = {name: getattr(module, name) for name in PUBLIC_API}
    for name, ours in PUBLIC_API.items():
        setattr(module, name, ours)
    setattr(module, _SENTINEL, MISS)
    package = sys.modules.get(CACHE_PACKAGE)
    if package is not None:
        for name, ours in PUBLIC_API.items():
            if getattr(package, name, None) is upstream[name]:
                setattr(package, name, ours)


@functools.cache
def upstream_cache_module() -> ModuleType:
    """Return vLLM-Omni's cache module as shipped: a private copy no plugin has touched."""
    spec = importlib.util.find_spec(CACHE_MODULE)
    if spec is None or spec.origin is None:
        raise ImportError(f"{CACHE_MODULE} is not installed")
    copy_spec = importlib.util.spec_from_file_location(_PRISTINE_NAME, spec.origin)
    module = importlib.util.module_from_spec(copy_spec)
    copy_spec.loader.exec_module(module)
    return module
