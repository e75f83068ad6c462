"""The opt-in CPU platform: inert unless asked for, refuses next to an accelerator, covers the worker."""

from __future__ import annotations

import ast
import importlib.util
import os
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm_omni", reason="the platform tests need the vllm-omni extra")

import vllm_omni.platforms as omni_platforms

from vllm_omni_prompt_cache.cpu_platform import entry_points as platform_plugins
from vllm_omni_prompt_cache.cpu_platform.entry_points import CPU_PLATFORM_ENV
from vllm_omni_prompt_cache.cpu_platform.platform import CpuOmniPlatform, HostMemoryAllocator

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU platform is for machines without a GPU; this one has CUDA"
)


def test_entry_points_are_installed() -> None:
    assert "prompt_cache_cpu" in {ep.name for ep in entry_points(group="vllm_omni.platform_plugins")}
    assert "prompt_cache_cpu" in {ep.name for ep in entry_points(group="vllm.platform_plugins")}


def test_inert_unless_asked_for(monkeypatch) -> None:
    monkeypatch.delenv(CPU_PLATFORM_ENV, raising=False)
    assert platform_plugins.omni_cpu_platform() is None
    assert platform_plugins.vllm_cpu_platform() is None
    monkeypatch.setenv(CPU_PLATFORM_ENV, "0")
    assert platform_plugins.omni_cpu_platform() is None


def test_selected_when_asked_for_on_a_machine_without_accelerators(monkeypatch) -> None:
    monkeypatch.setenv(CPU_PLATFORM_ENV, "1")
    assert platform_plugins.omni_cpu_platform() == "vllm_omni_prompt_cache.cpu_platform.platform.CpuOmniPlatform"
    assert platform_plugins.vllm_cpu_platform() == "vllm.platforms.cpu.CpuPlatform"
    assert type(omni_platforms.current_omni_platform) is CpuOmniPlatform  # this test session runs on it


def test_where_it_is_on_the_background_cuda_builds_are_off_unless_set(monkeypatch) -> None:
    """humming's two background interpreters per vLLM import can only fail here (no CUDA)."""
    name = platform_plugins.NO_CUDA_BUILDS_ENV
    monkeypatch.setenv(CPU_PLATFORM_ENV, "0")
    monkeypatch.delenv(name, raising=False)
    assert platform_plugins.opt_in_where_no_gpu() is False
    assert name not in os.environ  # no platform of ours, no say in the environment
    monkeypatch.setenv(CPU_PLATFORM_ENV, "1")
    assert platform_plugins.opt_in_where_no_gpu() is True
    assert os.environ[name] == "1"
    monkeypatch.setenv(name, "0")  # the user's own setting wins
    assert platform_plugins.opt_in_where_no_gpu() is True
    assert os.environ[name] == "0"


def test_refuses_to_start_where_an_accelerator_is_present(monkeypatch) -> None:
    # No GPU can run here: stand in for vLLM-Omni's CUDA detector finding one.
    monkeypatch.setenv(CPU_PLATFORM_ENV, "1")
    monkeypatch.setitem(
        omni_platforms.builtin_omni_platform_plugins, "cuda", lambda: "vllm_omni.platforms.cuda.platform.X"
    )
    with pytest.raises(RuntimeError, match=r"accelerator platform\(s\) \['cuda'\] are present") as raised:
        CpuOmniPlatform()
    assert f"Unset {CPU_PLATFORM_ENV}" in str(raised.value)


def test_a_malformed_opt_in_is_an_error_not_ignored(monkeypatch, caplog) -> None:
    monkeypatch.setenv(CPU_PLATFORM_ENV, "maybe")
    with pytest.raises(ValueError, match=f"invalid {CPU_PLATFORM_ENV}='maybe' from the environment"):
        CpuOmniPlatform()
    # vLLM hides exceptions from platform detectors, so the vLLM side logs the error itself.
    assert platform_plugins.vllm_cpu_platform() is None
    assert f"invalid {CPU_PLATFORM_ENV}='maybe'" in caplog.text


def test_answers_what_the_diffusion_worker_asks() -> None:
    platform = omni_platforms.current_omni_platform
    assert str(platform.get_torch_device(0)) == "cpu"
    assert platform.get_device_count() == 1
    assert platform.synchronize() is None and platform.empty_cache() is None
    assert platform.max_memory_allocated() == 0 and platform.max_memory_reserved() == 0
    free, total = platform.get_device_memory()
    assert 0 < free <= total
    assert platform.get_free_memory() > 0
    assert platform.dist_backend == "gloo"
    assert platform.get_diffusion_attn_backend_cls(None, 64).endswith("cpu_platform.attention.CpuSDPABackend")
    assert not platform.supports_torch_inductor()


def test_attention_backend_runs_sdpa_on_cpu() -> None:
    import torch

    from vllm_omni_prompt_cache.cpu_platform.attention import CpuSDPABackend

    impl = CpuSDPABackend.get_impl_cls()(num_heads=2, head_size=8, softmax_scale=8**-0.5)
    query = torch.randn(1, 5, 2, 8)
    out = impl.forward(query, query, query)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(x.permute(0, 2, 1, 3) for x in (query, query, query)), scale=8**-0.5
    ).permute(0, 2, 1, 3)
    assert torch.allclose(out, expected)


def test_host_allocator_follows_sleep_wake_and_shutdown() -> None:
    """What vLLM-Omni's worker calls on vLLM's CuMemAllocator, in its order, on the host stand-in."""
    # vLLM's allocator cannot even be imported without libcuda: read its methods from its source.
    source = Path(importlib.util.find_spec("vllm.device_allocator.cumem").origin).read_text()
    (cumem,) = [node for node in ast.parse(source).body if getattr(node, "name", "") == "CuMemAllocator"]
    public = {node.name for node in cumem.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}
    assert "release_pools" in public
    assert public <= set(dir(HostMemoryAllocator))  # every public method vLLM's allocator has
    allocator = HostMemoryAllocator()
    assert HostMemoryAllocator.get_instance() is HostMemoryAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        pass
    assert allocator.pool_tags == {"weights"} and allocator.get_current_usage() == 0
    allocator.sleep(offload_tags=("weights",))
    assert allocator.asleep_tags == {"weights"}
    allocator.wake_up(["weights"])
    assert allocator.asleep_tags == set()
    allocator.sleep()
    allocator.wake_up(None)  # wakes every tag
    assert allocator.asleep_tags == set()
    allocator.release_pools()  # the worker's shutdown; safe twice
    allocator.release_pools()
    assert allocator.pool_tags == set()


@pytest.mark.release
def test_the_stock_sdpa_gets_the_cpu_forward_where_a_release_falls_back_to_it(monkeypatch) -> None:
    """0.27 and 0.28 run float32 attention through a fallback built from the stock SDPA backend."""
    from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl

    monkeypatch.setattr(SDPAImpl, "forward", SDPAImpl.forward)  # restored after the test

    CpuOmniPlatform.get_diffusion_attn_backend_cls(None, 16)
    impl = SDPABackend.get_impl_cls()(num_heads=2, head_size=16, softmax_scale=0.25, causal=False, num_kv_heads=2)
    query = torch.randn(1, 5, 2, 16)
    out = impl.forward(query, query, query)
    assert out.shape == query.shape


@pytest.mark.release
def test_a_batch_output_that_arrives_before_its_split_is_registered_is_adopted() -> None:
    """vLLM-Omni 0.27's race, made to happen: the result pump files the batch's output before
    ``execute_batch`` registers the split (0.28 adopts it itself; there the wrapper finds nothing)."""
    import threading
    from concurrent.futures import Future
    from types import SimpleNamespace

    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.worker.utils import BatchRunnerOutput, RunnerOutput

    from vllm_omni_prompt_cache.cpu_platform.platform import adopt_early_batch_outputs

    batch = BatchRunnerOutput.from_list(
        [RunnerOutput(request_id=name, finished=True, result=DiffusionOutput(error=None)) for name in ("a", "b")]
    )

    class Executor:  # the attributes 0.27's MultiprocDiffusionExecutor keeps; execute_batch as it runs
        def __init__(self) -> None:
            self._futures_lock = threading.Lock()
            self._completed_outputs, self._output_futures, self._batch_split_map = {}, {}, {}

        def execute_batch(self, scheduler_output):
            early: Future = Future()
            early.set_result(batch)
            self._completed_outputs["batch"] = early  # the pump got OUTPUT_READY first
            self._batch_split_map["batch"] = {"batch/a": "a", "batch/b": "b"}  # registered too late
            return BatchRunnerOutput.from_list(
                [RunnerOutput(request_id=name, finished=True, async_output_id=f"batch/{name}") for name in ("a", "b")]
            )

    adopt_early_batch_outputs(SimpleNamespace(MultiprocDiffusionExecutor=Executor))
    executor = Executor()
    executor.execute_batch(None)
    assert executor._batch_split_map == {} and "batch" not in executor._completed_outputs
    for name in ("a", "b"):
        assert executor._completed_outputs[f"batch/{name}"].result() is batch.get_request_output(name).result


@pytest.mark.release
def test_an_output_whose_waiter_registers_while_the_pump_files_it_reaches_the_waiter(monkeypatch) -> None:
    """vLLM-Omni 0.27's race, made to happen: the release's own result pump files a single request's output
    while the engine thread registers its waiter (0.27 looks for the waiter, unpacks, then files, taking the
    lock twice; a waiter in between waited 30 s and the engine's warm-up failed in CI). Later releases look
    and file under one lock; there the filing finds no waiter and the fix does nothing."""
    import queue
    import threading
    from collections import OrderedDict
    from types import SimpleNamespace

    import vllm_omni.diffusion.executor.multiproc_executor as executor_module
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.worker.diffusion_worker import AsyncDiffusionOutput, AsyncOutputKind

    from vllm_omni_prompt_cache.cpu_platform.platform import answer_waiters_that_register_while_filing

    output = DiffusionOutput(error=None)
    message = AsyncDiffusionOutput(kind=AsyncOutputKind.OUTPUT_READY, async_output_id="out", output=output)

    class Executor(executor_module.MultiprocDiffusionExecutor):
        def _init_executor(self) -> None:  # what the releases' pumps and wait_output_ready read; no workers
            self._futures_lock = threading.Lock()
            self._output_futures, self._completed_outputs, self._rpc_futures, self._batch_split_map = {}, {}, {}, {}
            self._dropped_output_ids = OrderedDict()
            self._sync_result_buffer, self._pump_stop = queue.Queue(), threading.Event()
            self._is_failed = self._closed = False

    answer_waiters_that_register_while_filing(SimpleNamespace(MultiprocDiffusionExecutor=Executor))
    executor = object.__new__(Executor)
    executor._init_executor()
    waiters: list = []
    unpack = executor_module.unpack_diffusion_output_shm
    engine = threading.Thread(target=lambda: waiters.append(executor.wait_output_ready("out")))

    def unpack_while_the_engine_waits(unpacked) -> None:
        unpack(unpacked)
        engine.start()
        engine.join(timeout=2)  # a release that unpacks under the lock registers the waiter after filing

    def dequeue(timeout=None):
        if not executor._pump_stop.is_set():
            executor._pump_stop.set()
            return message
        raise TimeoutError

    monkeypatch.setattr(executor_module, "unpack_diffusion_output_shm", unpack_while_the_engine_waits)
    executor._result_pump(SimpleNamespace(dequeue=dequeue))
    engine.join(60)  # if it was still blocked on the lock the pump held; the bound only keeps a hang from blocking
    assert waiters[0].result(timeout=60) is output
    assert executor._output_futures == {} and "out" not in executor._completed_outputs
