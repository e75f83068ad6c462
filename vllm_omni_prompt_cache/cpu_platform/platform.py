"""The CPU platform for vLLM-Omni's diffusion engine.

vLLM-Omni 0.30 has no CPU platform: on a machine without an accelerator its diffusion worker
fails in ``set_device``. With ``VLLM_OMNI_PROMPT_CACHE_CPU_PLATFORM=1`` the entry points in
:mod:`.entry_points` select vLLM's own ``CpuPlatform`` and :class:`CpuOmniPlatform` below, so
the real engine (``Omni`` / ``AsyncOmni`` -> diffusion worker -> model runner) runs small models
on the CPU. That is how this project's tests and demo go through the engine users run.

It never activates by itself, and refuses to start where an accelerator platform is present.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psutil
import torch
from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

from vllm_omni_prompt_cache.cpu_platform.entry_points import (
    CPU_PLATFORM_ENV,
    active_accelerators,
    cpu_platform_requested,
)

logger = init_logger(__name__)


class HostMemoryAllocator:
    """Stands in for vLLM's CuMemAllocator, which needs CUDA, with the same public methods.

    On the CPU there is no device pool to unmap: sleep, wake and shutdown keep their stock control
    flow, and the allocator only records which tags are asleep and which pools were opened.
    """

    _instance: HostMemoryAllocator | None = None

    def __init__(self) -> None:
        self.pool_tags: set[str] = set()  # tags a memory pool was opened for, until release_pools()
        self.asleep_tags: set[str] = set()

    @classmethod
    def get_instance(cls) -> HostMemoryAllocator:
        """Return the process-wide allocator, as vLLM's singleton does."""
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def get_current_usage(self) -> int:
        """Return 0: host tensors belong to torch, not to this allocator."""
        return 0  # host tensors are torch's, not the allocator's

    def use_memory_pool(self, tag: str | None = None) -> contextlib.AbstractContextManager[None]:
        """Return a no-op context for allocations under ``tag``, and remember the tag."""
        self.pool_tags.add(tag or "default")
        return contextlib.nullcontext()

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        """Mark every pool asleep."""
        # CuMem backs up ``offload_tags`` to the host and discards the rest: either way, all sleep.
        self.asleep_tags |= self.pool_tags

    def discard(self, tags: tuple[str, ...] | str) -> None:
        """Mark ``tags`` asleep, as if their memory had been released without a backup."""
        self.asleep_tags |= {tags} if isinstance(tags, str) else set(tags)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake ``tags``, or every tag when None."""
        self.asleep_tags -= set(self.asleep_tags if tags is None else tags)

    def release_pools(self) -> None:
        """Forget every pool (vLLM-Omni's worker shutdown calls this); safe to call twice."""
        self.pool_tags.clear()
        self.asleep_tags.clear()

    def close(self) -> None:
        """Alias of :meth:`release_pools`, as vLLM's allocator has."""
        self.release_pools()


def host_output_loop(proc: Any) -> None:
    """``WorkerProc._async_output_loop`` for the CPU: outputs are already in host memory.

    vLLM-Omni's loop copies outputs to pinned host memory on a side CUDA stream, which needs a
    CUDA driver. Here the packing into shared memory happens directly, and the loop reports
    ``OUTPUT_READY`` (or an error) for each output exactly as the stock loop does.
    """
    from vllm_omni.diffusion.worker import diffusion_worker as worker_module

    while (item := proc._async_output_queue.get()) is not None:
        output, async_output_id, _device_event = item
        try:
            worker_module.pack_diffusion_output_shm(output)
            reply = worker_module.AsyncDiffusionOutput(
                kind=worker_module.AsyncOutputKind.OUTPUT_READY, async_output_id=async_output_id, output=output
            )
        except Exception:
            logger.exception("Packing diffusion output %s failed", async_output_id)
            reply = worker_module.AsyncDiffusionOutput(
                kind=worker_module.AsyncOutputKind.OUTPUT_READY,
                async_output_id=async_output_id,
                error="packing the diffusion output into shared memory failed",
            )
        proc._enqueue_result(reply)
        with proc._async_output_done:
            proc._async_output_pending = max(0, proc._async_output_pending - 1)
            proc._async_output_done.notify_all()


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    """vLLM's CpuPlatform plus what vLLM-Omni's diffusion worker and runner ask of a platform."""

    _omni_enum = OmniPlatformEnum.OOT

    def __init__(self) -> None:
        cpu_platform_requested()  # raises on a malformed value
        conflicts = active_accelerators("vllm_omni")
        if conflicts:
            raise RuntimeError(
                f"{CPU_PLATFORM_ENV}=1 asks vLLM-Omni to run on the CPU, but the accelerator "
                f"platform(s) {conflicts} are present on this machine. Unset {CPU_PLATFORM_ENV} "
                "to use the accelerator; the CPU platform is only for machines without one."
            )
        super().__init__()

    # --- device -----------------------------------------------------------------------------
    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    # --- memory queries (the base class forwards unknown names to torch.cpu, which lacks these)
    @classmethod
    def reset_peak_memory_stats(cls, device: Any = None) -> None:
        return None

    @classmethod
    def max_memory_allocated(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def memory_reserved(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return psutil.virtual_memory().available

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return memory.available, memory.total

    # --- diffusion ----------------------------------------------------------------------------
    @classmethod
    def get_diffusion_attn_backend_cls(
        cls,
        selected_backend: str | None,
        head_size: int,
        allow_trtllm_default: bool = False,
    ) -> str:
        if selected_backend is not None and selected_backend.upper() not in ("TORCH_SDPA", "SDPA"):
            logger.warning("The CPU platform runs attention with PyTorch SDPA, not %s.", selected_backend)
        # A path, not a class: the backend module imports current_omni_platform, which is this.
        return "vllm_omni_prompt_cache.cpu_platform.attention.CpuSDPABackend"

    @classmethod
    def init_diffusion_worker_vllm_config(cls, vllm_config: Any) -> None:
        # Runs in every diffusion worker, in-process or spawned, before the model loads.
        import vllm_omni.diffusion.worker.diffusion_worker as worker_module

        worker_module._get_cumem_allocator_class = lambda: HostMemoryAllocator
        # Spawned workers (multiprocess executor) start their output thread after this hook.
        worker_module.WorkerProc._async_output_loop = host_output_loop

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        raise NotImplementedError("the CPU platform runs diffusion stages only, not autoregressive stages")

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        raise NotImplementedError("the CPU platform runs diffusion stages only, not generation stages")
