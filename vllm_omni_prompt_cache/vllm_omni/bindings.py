"""Which names in stock vLLM-Omni 0.30 are rebound to ours, and the installer the runner calls.

Stock vLLM-Omni binds the cache API in three places: the cache module itself, the
``vllm_omni.diffusion.cache`` package's re-exports, and the names
``DiffusionModelRunner.load_model`` calls, imported into ``diffusion_model_runner`` at import
time. Each is rebound as soon as its module is imported (see :mod:`.imports`); a module imported
later binds ours from the patched cache module by itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import sys
import types
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from vllm_omni_prompt_cache.config import resolve_prompt_embed_cache_config
from vllm_omni_prompt_cache.store import PromptEmbedCache
from vllm_omni_prompt_cache.vllm_omni.imports import replace_once
from vllm_omni_prompt_cache.vllm_omni.lifecycle import StatsLogger, watch_weight_loads
from vllm_omni_prompt_cache.vllm_omni.settings import worker_settings
from vllm_omni_prompt_cache.wrapper import install_prompt_embed_cache, uninstall_prompt_embed_cache

logger = logging.getLogger("vllm_omni_prompt_cache")

CACHE_MODULE = "vllm_omni.diffusion.cache.prompt_embed_cache"
CACHE_PACKAGE = "vllm_omni.diffusion.cache"
RUNNER_MODULE = "vllm_omni.diffusion.worker.diffusion_model_runner"
OURS: dict[str, Any] = {
    "install_prompt_embed_cache": install_prompt_embed_cache,
    "uninstall_prompt_embed_cache": uninstall_prompt_embed_cache,
    "PromptEmbedCache": PromptEmbedCache,
    "resolve_prompt_embed_cache_config": resolve_prompt_embed_cache_config,
}
#: Seconds between the worker's cache statistics log lines.
STATS_LOG_INTERVAL_S = 30.0

_stock: dict[str, Any] = {}  # upstream's objects, kept to compare against and for stock mode
_use_stock = False  # process-wide: engines may load their model on another thread
_loading_config: contextvars.ContextVar[Any] = contextvars.ContextVar("loading_od_config", default=None)


def patch_cache_module(module: ModuleType) -> None:
    """Replace the cache module's public API with ours, and the package's re-exports of it."""
    missing = [name for name in OURS if not hasattr(module, name)]
    if missing:
        logger.warning(
            "vllm-omni-prompt-cache: %s lacks %s; leaving vLLM-Omni's prompt-embed cache unchanged.",
            module.__name__,
            missing,
        )
        return
    for name, ours in OURS.items():
        current = getattr(module, name)
        if current is not ours:
            _stock.setdefault(name, current)
            setattr(module, name, ours)
    package = sys.modules.get(CACHE_PACKAGE)
    if package is not None:
        for name, ours in OURS.items():
            if getattr(package, name, None) is _stock.get(name):
                setattr(package, name, ours)


def patch_runner_module(module: ModuleType) -> None:
    """Point the runner's installer and resolver at ours; remember the config being loaded."""
    for name in ("install_prompt_embed_cache", "resolve_prompt_embed_cache_config"):
        if not hasattr(module, name):
            logger.warning(
                "vllm-omni-prompt-cache: %s has no %s; the worker keeps vLLM-Omni's cache.",
                module.__name__,
                name,
            )
            return
    # The runner may have bound upstream's objects, or (imported after the cache module was
    # patched) ours: the stock versions are upstream's in either case.
    for name, dispatcher in (
        ("install_prompt_embed_cache", install_for_runner),
        ("resolve_prompt_embed_cache_config", resolve_for_runner),
    ):
        current = getattr(module, name)
        if current is not dispatcher:
            _stock.setdefault(name, current)
            setattr(module, name, dispatcher)

    replace_once(module.DiffusionModelRunner, "load_model", _remembering_the_config)


def _remembering_the_config(load_model: Any) -> Any:
    @functools.wraps(load_model)
    def load_model_with_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _loading_config.set(getattr(self, "od_config", None))
        try:
            return load_model(self, *args, **kwargs)
        finally:
            _loading_config.reset(token)

    return load_model_with_config


def _with_stock_globals(function: Any) -> Any:
    """Return ``function`` running against its module's original globals.

    Upstream's installer builds its cache from its module's global ``PromptEmbedCache``, which
    is ours once the module is patched; this copy still sees upstream's class.
    """
    stock_globals = {**function.__globals__, **{name: _stock[name] for name in OURS if name in _stock}}
    copy = types.FunctionType(function.__code__, stock_globals, function.__name__, function.__defaults__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def resolve_for_runner(enable: Any = None, max_size: Any = None) -> tuple[bool, int]:
    """The resolver ``DiffusionModelRunner.load_model`` calls: ours, or upstream's in stock mode."""
    if _use_stock:
        return _stock["resolve_prompt_embed_cache_config"](enable=enable, max_size=max_size)
    return resolve_prompt_embed_cache_config(enable=enable, max_size=max_size)


def install_for_runner(pipeline: Any, *, max_size: int = 32, enabled: bool = True, model_tag: str | None = None) -> Any:
    """The installer ``DiffusionModelRunner.load_model`` calls: ours with the stage's extra settings."""
    if _use_stock:
        stock_install = _with_stock_globals(_stock["install_prompt_embed_cache"])
        return stock_install(pipeline, max_size=max_size, enabled=enabled, model_tag=model_tag)
    settings = worker_settings(_loading_config.get(), enable=enabled, max_size=max_size)
    cache = install_prompt_embed_cache(
        pipeline,
        max_size=max_size,
        enabled=enabled,
        model_tag=model_tag,
        max_bytes=settings.max_bytes,
        verify=settings.verify,
        report=StatsLogger(STATS_LOG_INTERVAL_S),
    )
    if cache is not None:
        watch_weight_loads(pipeline)
    return cache


@contextlib.contextmanager
def stock_prompt_embed_cache() -> Iterator[None]:
    """While this block runs, runners in this process load vLLM-Omni's own cache instead of ours.

    For side-by-side comparisons (the demo's "stock" mode): build the engine inside the block.
    """
    global _use_stock
    _use_stock = True
    try:
        yield
    finally:
        _use_stock = False
