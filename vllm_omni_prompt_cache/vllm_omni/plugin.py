"""Entry points that make stock vLLM-Omni (0.27 to 0.32) use this package's cache.

``register`` is loaded by vLLM-Omni (``vllm_omni.general_plugins``: diffusion workers, stage
processes, engine-argument construction) and ``register_vllm`` by vLLM (``vllm.general_plugins``:
before the serve parser is built). ``register_at_platform_detection`` rides on both platform
groups, because ``AsyncOmni(...)`` builds its stage config, where our kwargs are read, before any
general plugin runs, while platforms are detected as soon as vLLM is imported. All are idempotent
and cheap: they only arrange for hooks to run when the vLLM-Omni modules concerned are imported,
so a process that never imports them (plain vLLM serving a language model) is untouched.

Set ``VLLM_OMNI_PROMPT_CACHE_PLUGIN=0`` to keep stock behaviour. Whether the installed vLLM-Omni
can be hooked is decided by looking for every hook point (:mod:`.hook_points`), not by its
version. On a release we test (:mod:`.releases`) nothing more is said than what is off there; on
another one the plugin says once that every hook point was found, or names the version and the
missing hook points and stays inert (or, where only a feature's hook points are missing, turns
that feature off).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
from typing import Any

from vllm_omni_prompt_cache.settings.resolved import env_flag

logger = logging.getLogger("vllm_omni_prompt_cache")

PLUGIN_ENV = "VLLM_OMNI_PROMPT_CACHE_PLUGIN"

_registered = False


def installed_vllm_omni_version() -> str | None:
    """Return the installed vLLM-Omni version, or None when it is not installed."""
    try:
        return importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        return None


def hookable_features(version: str) -> set[str]:
    """Return the features the installed vLLM-Omni has every hook point for; say once what is missing.

    An empty set means the cache itself cannot be hooked, and the plugin must stay inert.
    """
    from vllm_omni_prompt_cache.vllm_omni import releases
    from vllm_omni_prompt_cache.vllm_omni.hook_points import CACHE, FEATURES, HOOK_POINTS, missing_by_feature

    missing = missing_by_feature()
    built_for = f"vllm-omni-prompt-cache (tested on vLLM-Omni {releases.tested_list()}) found {version}"
    if missing[CACHE]:
        logger.warning(
            "%s, which lacks hook points the cache needs: %s. Staying inert: vLLM-Omni's own prompt-embed "
            "cache applies (token-ID tensor calls bypass it).",
            built_for,
            ", ".join(str(point) for point in missing[CACHE]),
        )
        return set()
    features_off = [feature for feature in FEATURES if missing[feature]]
    if features_off:
        logger.warning(
            "%s. The cache is active; %s stay off, for want of: %s.",
            built_for,
            " and ".join(features_off),
            ", ".join(str(point) for feature in features_off for point in missing[feature]),
        )
    elif not releases.is_tested(version):
        required = sum(not point.optional for point in HOOK_POINTS)
        logger.warning("%s, which has all %d hook points the plugin needs: active.", built_for, required)
    return set(FEATURES) - set(features_off)


def show_logs_as_vllm_does() -> None:
    """Print this package's log records with vLLM's handler, where nothing else would show them.

    vLLM's logger does not propagate, and a served process has no root handler: our install line,
    statistics and warnings would reach no one (Python's last resort shows warnings only, bare).
    Where the root logger has a handler (an application's own logging, pytest), records go there
    as before.
    """
    ours, vllm_logger = logging.getLogger("vllm_omni_prompt_cache"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    ours.propagate = False  # as vLLM's own logger: a root handler added later must not print it twice
    if ours.level == logging.NOTSET:
        ours.setLevel(vllm_logger.getEffectiveLevel())


def register() -> None:
    """``vllm_omni.general_plugins`` entry point: hook the cache into vLLM-Omni (once per process)."""
    global _registered
    if _registered:
        return
    _registered = True
    show_logs_as_vllm_does()
    if not env_flag(PLUGIN_ENV, default=True):
        logger.info("vllm-omni-prompt-cache: %s=0, vLLM-Omni keeps its own prompt-embed cache.", PLUGIN_ENV)
        return
    version = installed_vllm_omni_version()
    if version is None:
        return
    features = hookable_features(version)
    if not features:
        return

    from vllm_omni_prompt_cache.vllm_omni import bindings, cli_args, hook_points, lifecycle, metrics, runner, settings
    from vllm_omni_prompt_cache.vllm_omni.imports import when_imported

    def balancer_hook(name: str) -> Any:  # balancer imports vLLM-Omni: only once vLLM-Omni is importing
        def hook(module: Any) -> None:
            getattr(importlib.import_module(f"{__package__}.balancer"), name)(module)

        hook.__qualname__ = f"balancer.{name}"  # what a failure is logged under
        return hook

    when_imported(bindings.CACHE_MODULE, bindings.patch_cache_module)
    when_imported(runner.RUNNER_MODULE, runner.patch_runner_module)
    when_imported(hook_points.WORKER, lifecycle.patch_worker)
    when_imported("vllm_omni.diffusion.lora.manager", lifecycle.patch_lora_manager)
    if hook_points.KWARGS in features:
        carried = hook_points.found_choice(hook_points.KWARGS_BUILDER)
        if carried is not None and carried.module == hook_points.ASYNC_ENGINE:
            when_imported(hook_points.ASYNC_ENGINE, settings.patch_engine_stage_builder)
        else:
            when_imported("vllm_omni.config.config_factory", settings.patch_stage_config_factory)
    if hook_points.DEPLOY_CONFIG in features:
        when_imported("vllm_omni.config.config_factory", settings.patch_deploy_config)
        when_imported("vllm_omni.config.config_factory", settings.patch_legacy_deploy_config)
    runner.count_offload_moves = hook_points.OFFLOAD_COUNTS in features
    if hook_points.SERVE_FLAGS in features:

        def serve_hook(module: Any) -> None:
            cli_args.patch_serve_command(module, with_policy=hook_points.ROUTING in features)

        serve_hook.__qualname__ = "cli_args.patch_serve_command"  # what a failure is logged under
        when_imported("vllm_omni.entrypoints.cli.serve", serve_hook)
    if hook_points.ROUTING in features:
        when_imported("vllm_omni.engine.stage_runtime", balancer_hook("patch_stage_runtime"))
        when_imported("vllm_omni.engine.stage_pool", balancer_hook("patch_stage_pool"))
        when_imported("vllm_omni.engine.omni_engine_base", balancer_hook("patch_engine_base"))
    if hook_points.METRICS in features:
        when_imported(hook_points.WORKER, metrics.patch_worker)
        when_imported("vllm_omni.diffusion.diffusion_engine", metrics.patch_diffusion_engine)
        when_imported("vllm_omni.engine.orchestrator", metrics.patch_orchestrator)


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
