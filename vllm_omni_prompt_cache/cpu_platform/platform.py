"""The CPU platform for vLLM-Omni's diffusion engine.

vLLM-Omni has no CPU platform: on a machine without an accelerator its diffusion worker
fails in ``set_device``. With ``VLLM_OMNI_PROMPT_CACHE_CPU_PLATFORM=1`` the entry points in
:mod:`.entry_points` select vLLM's own ``CpuPlatform`` and :class:`CpuOmniPlatform` below, so
the real engine (``Omni`` / ``AsyncOmni`` -> diffusion worker -> model runner) runs small models
on the CPU. That is how this project's tests and demo go through the engine users run.

It never activates by itself, and refuses to start where an accelerator platform is present.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, InvalidStateError
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

    # 0.28 and later send through the worker's own method, under a lock, and count outputs in flight.
    # 0.27 sends from this thread and the main thread to a queue meant for one writer, unlocked:
    # there both threads' writes are made to hold one lock (what 0.28's method does).
    done = getattr(proc, "_async_output_done", None)
    enqueue = getattr(proc, "_enqueue_result", None) or _serialized(proc.result_mq)
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
        enqueue(reply)
        if done is not None:
            with done:
                proc._async_output_pending = max(0, proc._async_output_pending - 1)
                done.notify_all()


def _serialized(queue: Any) -> Any:
    """Make every ``enqueue`` on ``queue``, from any thread, hold one lock; return it."""
    enqueue, lock = queue.enqueue, threading.Lock()

    def locked_enqueue(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return enqueue(*args, **kwargs)

    queue.enqueue = locked_enqueue
    return locked_enqueue


def adopt_early_batch_outputs(module: Any) -> None:
    """Give vLLM-Omni 0.27's multiprocess executor the fix 0.28 made: adopt a batch's output that
    arrived before ``execute_batch`` registered where its requests' outputs go.

    The worker announces a batch (``COMPUTE_DONE``) and its output thread sends the output
    (``OUTPUT_READY``) right after. 0.27 registers the batch's split only once the announcement
    reached it; an output arriving before that is filed under the batch and never found (a 30 s
    time-out). On a GPU the copy to the host delays the output past the registration; on the CPU
    nothing does. Where ``execute_batch`` adopts it itself (0.28 and later), nothing is left to adopt.
    """
    from vllm_omni_prompt_cache.vllm_omni.imports import replace_once

    replace_once(module.MultiprocDiffusionExecutor, "execute_batch", _adopting_early_outputs)


def _adopting_early_outputs(execute_batch: Any) -> Any:
    def execute_batch_adopting_early_outputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = execute_batch(self, *args, **kwargs)
        ids = [getattr(output, "async_output_id", None) for output in getattr(result, "runner_outputs", None) or ()]
        batch_ids = {output_id.partition("/")[0] for output_id in ids if output_id and "/" in output_id}
        for batch_id in batch_ids:
            with self._futures_lock:
                early = self._completed_outputs.pop(batch_id, None)
                split = self._batch_split_map.pop(batch_id, None) if early is not None else None
            if early is not None and split is not None:
                _deliver_split(self, early, split)
        return result

    return execute_batch_adopting_early_outputs


def _deliver_split(executor: Any, early: Any, split: dict[str, str]) -> None:
    """File each request's part of an early batch output as the executor's result pump would have."""
    from concurrent.futures import Future

    from vllm_omni.diffusion.data import DiffusionOutput

    try:
        batch_output, error = early.result(), None
    except Exception as exception:
        batch_output, error = None, str(exception)
    for per_request_id, request_id in split.items():
        request_output = batch_output.get_request_output(request_id) if batch_output is not None else None
        if request_output is not None and request_output.result is not None:
            result = request_output.result
        else:
            result = DiffusionOutput(error=error or "No output result for batch request")
        future: Future = Future()
        future.set_result(result)
        with executor._futures_lock:
            pending = executor._output_futures.pop(per_request_id, None)
            if pending is not None and not pending.done():
                pending.set_result(result)
            else:
                executor._completed_outputs[per_request_id] = future


def answer_waiters_that_register_while_filing(module: Any) -> None:
    """Give vLLM-Omni 0.27's multiprocess executor the fix 0.28 made to its result pump: an output whose
    waiter registers while the pump files it goes to that waiter.

    0.27's pump looks for the output's waiter under the executor's lock and, finding none, unpacks the
    output and files it for a later ``wait_output_ready`` under the lock again. A waiter registered
    between the two (the engine thread, just told ``COMPUTE_DONE``) is never answered: a 30 s time-out,
    first seen in the engine's warm-up run. On a GPU the output trails ``COMPUTE_DONE`` by its copy to
    the host; on the CPU it follows at once, into the gap, more often the busier the machine. From 0.28
    the pump looks and files under one lock, so no waiter is there when it files: this does nothing.
    """
    from vllm_omni_prompt_cache.vllm_omni.imports import replace_once

    replace_once(module.MultiprocDiffusionExecutor, "_init_executor", _filing_for_late_waiters)


def _filing_for_late_waiters(init_executor: Any) -> Any:
    def init_executor_filing_for_late_waiters(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = init_executor(self, *args, **kwargs)
        self._completed_outputs = CompletedOutputs(self, self._completed_outputs)
        return result

    return init_executor_filing_for_late_waiters


class CompletedOutputs(dict):
    """The executor's outputs filed for a later ``wait_output_ready``: one whose waiter is already
    registered goes to the waiter instead (see :func:`answer_waiters_that_register_while_filing`).
    The pump files under the executor's lock, which ``wait_output_ready`` registers under too."""

    def __init__(self, executor: Any, filed: dict) -> None:
        super().__init__(filed)
        self._executor = executor

    def __setitem__(self, output_id: str, output: Future) -> None:
        waiters = self._executor._output_futures
        waiter = waiters.get(output_id)
        if type(waiter) is not Future or waiter.done():  # none, or a release's own placeholder: filed
            super().__setitem__(output_id, output)
            return
        del waiters[output_id]
        output.add_done_callback(lambda filed: _pass_on(filed, waiter))


def _pass_on(filed: Future, waiter: Future) -> None:
    error = filed.exception()
    with contextlib.suppress(InvalidStateError):  # the waiter was cancelled meanwhile: nobody waits for it
        if error is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(filed.result())


def _retire_nothing_on_shutdown() -> None:
    """0.32's worker shutdown retires the allocator's device allocations through CUDA's allocator
    module, which cannot load here; the host allocator has none to retire."""
    import vllm_omni.patch as patch_module

    retire = getattr(patch_module, "release_cumem_allocations_for_shutdown", None)
    if retire is None or getattr(retire, "host_aware", False):
        return

    def release_allocations_for_shutdown(allocator: Any) -> int:
        return 0 if isinstance(allocator, HostMemoryAllocator) else retire(allocator)

    release_allocations_for_shutdown.host_aware = True
    patch_module.release_cumem_allocations_for_shutdown = release_allocations_for_shutdown


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
        from vllm_omni_prompt_cache.vllm_omni.imports import when_imported

        when_imported("vllm_omni.diffusion.executor.multiproc_executor", adopt_early_batch_outputs)
        when_imported("vllm_omni.diffusion.executor.multiproc_executor", answer_waiters_that_register_while_filing)

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
        from vllm_omni_prompt_cache.cpu_platform.attention import give_stock_sdpa_a_cpu_forward

        give_stock_sdpa_a_cpu_forward()  # imported here: that module imports vLLM-Omni's attention
        return "vllm_omni_prompt_cache.cpu_platform.attention.CpuSDPABackend"

    @classmethod
    def init_diffusion_worker_vllm_config(cls, vllm_config: Any) -> None:
        # Runs in every diffusion worker, in-process or spawned, before the model loads.
        import vllm_omni.diffusion.worker.diffusion_worker as worker_module

        worker_module._get_cumem_allocator_class = lambda: HostMemoryAllocator
        _retire_nothing_on_shutdown()
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
