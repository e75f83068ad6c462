"""Platform entry points: the opt-in CPU platform, and the earliest hook into vLLM-Omni.

vLLM and vLLM-Omni resolve their platforms as soon as they are imported, which is earlier than
they load general plugins: ``AsyncOmni(...)`` builds its stage config (where our kwargs must be
read) before any general plugin runs. So these entry points also register the cache integration
(:func:`.plugin.register`, cheap and idempotent) and then answer the platform question: no
platform of ours unless ``VLLM_OMNI_PROMPT_CACHE_CPU_PLATFORM=1`` asks for the CPU one.

vLLM resolves its platform while it imports itself, so this module imports nothing from vLLM or
vLLM-Omni at import time (doing so there is a circular import). The platform classes live in
:mod:`.cpu_platform`, imported only once the opt-in is set.
"""

from __future__ import annotations

import logging

from vllm_omni_prompt_cache.config import env_flag

logger = logging.getLogger(__name__)

#: Set to 1 to run vLLM-Omni's diffusion engine on the CPU (tests, demos, laptops without a GPU).
CPU_PLATFORM_ENV = "VLLM_OMNI_PROMPT_CACHE_CPU_PLATFORM"


def cpu_platform_requested() -> bool:
    """Return True when the CPU platform was asked for; raise on a value that is neither yes nor no."""
    return env_flag(CPU_PLATFORM_ENV, default=False)


def active_accelerators(framework: str) -> list[str]:
    """Return the built-in accelerator platforms of ``framework`` (vllm or vllm_omni) seeing hardware."""
    if framework == "vllm":
        from vllm.platforms import builtin_platform_plugins as detectors
    else:
        from vllm_omni.platforms import builtin_omni_platform_plugins as detectors
    found = []
    for name, detect in detectors.items():
        if name == "cpu":
            continue
        try:
            if detect() is not None:
                found.append(name)
        except Exception:  # a detector that fails has detected nothing
            continue
    return found


def _register_integration() -> None:
    try:
        from vllm_omni_prompt_cache.vllm_omni.plugin import register_vllm

        register_vllm()
    except Exception:  # platform detection must go on whatever happens here
        logger.exception("vllm-omni-prompt-cache: could not register the prompt-embed cache integration")


def vllm_cpu_platform() -> str | None:
    """``vllm.platform_plugins`` entry point: vLLM's own CPU platform, when opted in and no GPU is seen."""
    _register_integration()
    try:
        if not cpu_platform_requested():
            return None
    except ValueError as error:  # vLLM would swallow it; the Omni platform below raises it again
        logger.error("%s", error)
        return None
    if active_accelerators("vllm"):
        # vLLM swallows exceptions raised here; the Omni platform below reports the conflict.
        return None
    return "vllm.platforms.cpu.CpuPlatform"


def omni_cpu_platform() -> str | None:
    """``vllm_omni.platform_plugins`` entry point: our CPU Omni platform, when opted in."""
    _register_integration()
    try:
        if not cpu_platform_requested():
            return None
    except ValueError:
        pass  # a malformed opt-in: the platform's constructor raises it where vLLM-Omni cannot hide it
    # On a machine with an accelerator, or with a malformed opt-in, this class refuses to start.
    return "vllm_omni_prompt_cache.vllm_omni.cpu_platform.CpuOmniPlatform"
