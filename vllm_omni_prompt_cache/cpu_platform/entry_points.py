"""The CPU platform's entry points: ``vllm.platform_plugins`` and ``vllm_omni.platform_plugins``.

No platform of ours unless ``VLLM_OMNI_PROMPT_CACHE_CPU_PLATFORM=1`` asks for the CPU one. vLLM
resolves its platform while it imports itself, so this module imports nothing from vLLM or
vLLM-Omni at import time (doing so there is a circular import).
"""

from __future__ import annotations

import logging
import os

from vllm_omni_prompt_cache.settings.resolved import env_flag

logger = logging.getLogger(__name__)

#: Set to 1 to run vLLM-Omni's diffusion engine on the CPU (tests, demos, laptops without a GPU).
CPU_PLATFORM_ENV = "VLLM_OMNI_PROMPT_CACHE_CPU_PLATFORM"
OMNI_PLATFORM_CLASS = "vllm_omni_prompt_cache.cpu_platform.platform.CpuOmniPlatform"
#: humming (a vLLM dependency) starts two interpreters at each import of vLLM's kernel config, to
#: build CUDA helpers in the background; with no GPU they fail, after about 10 s of CPU per import.
NO_CUDA_BUILDS_ENV = "HUMMING_DISABLE_PARALLEL_BUILD"


def cpu_platform_requested() -> bool:
    """Return True when the CPU platform was asked for; raise on a value that is neither yes nor no."""
    return env_flag(CPU_PLATFORM_ENV, default=False)


def opt_in_where_no_gpu() -> bool:
    """Ask for the CPU platform unless a CUDA device is visible or the user decided; return whether it is on.

    Where it is on, CUDA builds vLLM's dependencies start in the background are turned off (an explicit
    setting wins). Must run before vLLM is imported (the platform is resolved at import).
    """
    if CPU_PLATFORM_ENV in os.environ:
        on = cpu_platform_requested()
    else:
        import torch

        on = not torch.cuda.is_available()
        if on:
            os.environ[CPU_PLATFORM_ENV] = "1"
    if on:  # in this process and the ones it starts, which inherit the environment
        os.environ.setdefault(NO_CUDA_BUILDS_ENV, "1")
    return on


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


def vllm_cpu_platform() -> str | None:
    """``vllm.platform_plugins`` entry point: vLLM's own CPU platform, when opted in and no GPU is seen."""
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
    try:
        if not cpu_platform_requested():
            return None
    except ValueError:
        pass  # a malformed opt-in: the platform's constructor raises it where vLLM-Omni cannot hide it
    # On a machine with an accelerator, or with a malformed opt-in, this class refuses to start.
    return OMNI_PLATFORM_CLASS
