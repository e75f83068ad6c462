"""Entry points that make stock vLLM-Omni 0.30 use this package's cache.

``register`` is loaded by vLLM-Omni (``vllm_omni.general_plugins``: diffusion workers, stage
processes, engine-argument construction) and ``register_vllm`` by vLLM (``vllm.general_plugins``:
before the serve parser is built). ``register_at_platform_detection`` rides on both platform
groups, because ``AsyncOmni(...)`` builds its stage config, where our kwargs are read, before any
general plugin runs, while platforms are detected as soon as vLLM is imported. All are idempotent
and cheap: they only arrange for hooks to run when the vLLM-Omni modules concerned are imported,
so a process that never imports them (plain vLLM serving a language model) is untouched.

Set ``VLLM_OMNI_PROMPT_CACHE_PLUGIN=0`` to keep stock behaviour. On a vLLM-Omni version other
than 0.30.x the plugin logs one warning and changes nothing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
from typing import Any

from vllm_omni_prompt_cache.config import env_flag

logger = logging.getLogger("vllm_omni_prompt_cache")

PLUGIN_ENV = "VLLM_OMNI_PROMPT_CACHE_PLUGIN"
SUPPORTED_SERIES = "0.30."

_registered = False


def supported_vllm_omni_version() -> str | None:
    """Return the installed vLLM-Omni version if we support it; warn once and return None if not."""
    try:
        version = importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        return None
    if version.startswith(SUPPORTED_SERIES):
        return version
    logger.warning(
        "vllm-omni-prompt-cache supports vLLM-Omni %sx, found %s: leaving vLLM-Omni's own prompt-embed "
        "cache in place (token-ID tensor calls will bypass it).",
        SUPPORTED_SERIES,
        version,
    )
    return None


def register() -> None:
    """``vllm_omni.general_plugins`` entry point: hook the cache into vLLM-Omni (once per process)."""
    global _registered
    if _registered:
        return
    _registered = True
    if not env_flag(PLUGIN_ENV, default=True):
        logger.info("vllm-omni-prompt-cache: %s=0, vLLM-Omni keeps its own prompt-embed cache.", PLUGIN_ENV)
        return
    if supported_vllm_omni_version() is None:
        return

    from vllm_omni_prompt_cache.vllm_omni import bindings, cli_args, lifecycle, runner, settings
    from vllm_omni_prompt_cache.vllm_omni.imports import when_imported

    def balancer_hook(name: str) -> Any:  # balancer imports vLLM-Omni: only once vLLM-Omni is importing
        def hook(module: Any) -> None:
            getattr(importlib.import_module(f"{__package__}.balancer"), name)(module)

        hook.__qualname__ = f"balancer.{name}"  # what a failure is logged under
        return hook

    when_imported(bindings.CACHE_MODULE, bindings.patch_cache_module)
    when_imported(runner.RUNNER_MODULE, runner.patch_runner_module)
    when_imported("vllm_omni.diffusion.worker.diffusion_worker", lifecycle.patch_worker)
    when_imported("vllm_omni.diffusion.lora.manager", lifecycle.patch_lora_manager)
    when_imported("vllm_omni.config.config_factory", settings.patch_stage_config_factory)
    when_imported("vllm_omni.entrypoints.cli.serve", cli_args.patch_serve_command)
    when_imported("vllm_omni.engine.stage_runtime", balancer_hook("patch_stage_runtime"))
    when_imported("vllm_omni.engine.stage_pool", balancer_hook("patch_stage_pool"))
    when_imported("vllm_omni.engine.omni_engine_base", balancer_hook("patch_engine_base"))


def register_vllm() -> None:
    """``vllm.general_plugins`` entry point: the same, but inert where vLLM-Omni is not installed."""
    if importlib.util.find_spec("vllm_omni") is None:
        return
    register()


def register_at_platform_detection() -> None:
    """Platform-group entry point that registers the cache early and never offers a platform.

    Returns None, which both frameworks read as "this plugin provides no platform".
    """
    try:
        register_vllm()
    except Exception:  # platform detection must go on whatever happens here
        logger.exception("vllm-omni-prompt-cache: could not register the prompt-embed cache integration")
    return None
