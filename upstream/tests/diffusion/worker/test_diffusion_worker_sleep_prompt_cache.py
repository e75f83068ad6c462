# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""
``DiffusionWorker.sleep`` empties the prompt-embedding cache before the allocator sleeps.

Cached embeddings live outside the allocator's memory pools, so a sleep that does not
drop them keeps their device memory. The allocator (``CuMemAllocator``) and the
platform's memory queries need CUDA: they are replaced by recording doubles here.
The worker, its runner and the cache are the real classes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_omni.diffusion.cache.prompt_embed_cache import install_prompt_embed_cache
from vllm_omni.diffusion.worker import diffusion_worker
from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
from vllm_omni.diffusion.worker.diffusion_worker import DiffusionWorker

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


class _Pipeline(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.text_encoder = torch.nn.Embedding(16, 4)
        self.register_buffer("scale", torch.ones(1))

    def encode_prompt(self, prompt_ids):
        return self.text_encoder(prompt_ids)


class _RecordingAllocator:
    """Stands in for CuMemAllocator (CUDA only); records the cache size when the pools sleep."""

    def __init__(self, cache):
        self.cache = cache
        self.slept = False
        self.cache_size_at_sleep = None

    def get_current_usage(self):
        return 0

    def sleep(self, offload_tags=()):
        self.slept = True
        if self.cache is not None:
            self.cache_size_at_sleep = self.cache.stats()["size"]


class _CpuMemory:
    """Stands in for the platform's device-memory queries (CUDA only)."""

    def get_free_memory(self):
        return 0

    def get_device_total_memory(self):
        return 0

    def empty_cache(self):
        pass

    def synchronize(self):
        pass


def _sleeping_worker(monkeypatch, runner):
    allocator = _RecordingAllocator(runner.prompt_embed_cache)
    monkeypatch.setattr(
        diffusion_worker, "_get_cumem_allocator_class", lambda: SimpleNamespace(get_instance=lambda: allocator)
    )
    monkeypatch.setattr(diffusion_worker, "current_omni_platform", _CpuMemory())
    worker = DiffusionWorker.__new__(DiffusionWorker)
    worker.rank = 0
    worker.device = torch.device("cpu")
    worker.od_config = SimpleNamespace()
    worker.model_runner = runner
    return worker, allocator


def _runner_with_cached_prompts():
    pipeline = _Pipeline()
    runner = DiffusionModelRunner.__new__(DiffusionModelRunner)
    runner.pipeline = pipeline
    runner.prompt_embed_cache = install_prompt_embed_cache(pipeline, max_size=4)
    for token in range(3):
        pipeline.encode_prompt(torch.tensor([[token, token + 1]]))
    assert runner.prompt_embed_cache.stats()["size"] == 3
    return runner


class TestSleepClearsPromptCache:
    @pytest.mark.parametrize("level", [1, 2])
    def test_cache_is_empty_before_the_allocator_sleeps(self, monkeypatch, level):
        runner = _runner_with_cached_prompts()
        worker, allocator = _sleeping_worker(monkeypatch, runner)
        worker.sleep(level=level)
        assert allocator.cache_size_at_sleep == 0
        stats = runner.prompt_embed_cache.stats()
        assert stats["size"] == 0 and stats["bytes"] == 0 and stats["misses"] == 3  # counters kept

    def test_prompts_are_encoded_again_after_sleep(self, monkeypatch):
        runner = _runner_with_cached_prompts()
        worker, _ = _sleeping_worker(monkeypatch, runner)
        worker.sleep(level=1)
        runner.pipeline.encode_prompt(torch.tensor([[0, 1]]))
        assert runner.prompt_embed_cache.stats()["misses"] == 4

    def test_a_runner_without_the_hook_still_sleeps(self, monkeypatch):
        class CustomRunner:
            pipeline = _Pipeline()
            prompt_embed_cache = None

            def release_captured_graphs(self):
                pass

        worker, allocator = _sleeping_worker(monkeypatch, CustomRunner())
        assert worker.sleep(level=1) == 0
        assert allocator.slept
