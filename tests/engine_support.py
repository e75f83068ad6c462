"""Shared pieces of the tests that run the real vLLM-Omni engine on CPU."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

pytest.importorskip("vllm_omni", reason="the engine tests need the vllm-omni extra")

from vllm_omni_prompt_cache.demo.rollout import RolloutSpec
from vllm_omni_prompt_cache.store.prompt_embed_cache import CacheStats
from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image
from vllm_omni_prompt_cache.tiny.worker_extension import WORKER_EXTENSION, TextEncoderCountersExtension
from vllm_omni_prompt_cache.vllm_omni.engine_client import cache_stats, open_engine, worker_value

PROMPTS = ("a red fox in the snow", "a lighthouse above a stormy sea")
GROUP_SIZE = 4


def tiny_spec(**overrides: Any) -> RolloutSpec:
    """The e2e rollout: 2 prompts x 4 siblings, 64x64, 2 steps, CFG with a shared negative prompt."""
    values: dict[str, Any] = {"model_dir": ensure_tiny_qwen_image(), "prompts": PROMPTS, "group_size": GROUP_SIZE}
    values.update(overrides)
    return RolloutSpec(**values)


def adapter_engine_kwargs(
    model_dir: Any, pipeline_class: str, *, cache: bool, max_num_seqs: int, cache_size: int
) -> dict[str, Any]:
    """Return the ``AsyncOmni`` kwargs for a verl-omni adapter stand-in on a tiny checkpoint: the
    adapter as the custom pipeline, our encoder counters, fp32, the cache on or off."""
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "custom_pipeline_args": {"pipeline_class": pipeline_class},
        "worker_extension_cls": WORKER_EXTENSION,
        "dtype": "float32",
        "log_stats": False,
        "enable_prompt_embed_cache": cache,
        "max_num_seqs": max_num_seqs,
    }
    if cache:
        kwargs["prompt_embed_cache_size"] = cache_size
    return kwargs


def run(coroutine: Any) -> Any:
    """Run a coroutine to completion on a fresh event loop (engines bind to the loop they start on)."""
    return asyncio.run(coroutine)


T = TypeVar("T")


@dataclass
class Counted:
    """What an engine's text encoder and cache did while some work ran (the pipeline's counters, and
    the cache's counts since the work began; ``stats`` None without a cache)."""

    rows_at_start: int  # rows the encoder had run before the work (the engine's warm-up)
    encoder_runs: int
    encoder_rows: int
    stats: CacheStats | None
    stats_at_start: CacheStats | None  # the cache's counts before the work (the warm-up's)


async def counted(engine: Any, work: Callable[[], Awaitable[T]]) -> tuple[T, Counted]:
    """Return the result of ``work()`` and what the text encoder and the cache did while it ran.

    ``work`` is called after the first reading: a future made before it (``asyncio.gather``) would
    start its requests while the counters are being read.
    """
    before = await worker_value(engine, "text_encoder_counters")
    stats_before = await cache_stats(engine)
    result = await work()
    after = await worker_value(engine, "text_encoder_counters")
    stats_after = await cache_stats(engine)
    return result, Counted(
        rows_at_start=before["encoder_rows"],
        encoder_runs=after["encoder_runs"] - before["encoder_runs"],
        encoder_rows=after["encoder_rows"] - before["encoder_rows"],
        stats=None if stats_after is None else stats_after.since(stats_before or CacheStats()),
        stats_at_start=stats_before,
    )


@dataclass
class Rollout(Counted):
    """What one engine returned and counted for a rollout of token-ID requests (its warm-up excluded)."""

    outputs: dict[int, Any]  # each request's final output, by the request's index
    later: dict[int, Any]  # the outputs of requests sent after the counting, by index
    init_seconds: float
    seconds: float

    @property
    def latents(self) -> dict[int, Any]:
        return {index: output.trajectory_latents for index, output in self.outputs.items()}

    @property
    def errors(self) -> dict[int, Any]:
        return {index: output.error for index, output in self.outputs.items() if output.error}


async def send_rollout(
    engine_kwargs: dict[str, Any],
    requests: Sequence[tuple[int, Any, int]],
    sampling: Mapping[str, Any],
    label: str,
    *,
    later: Sequence[tuple[int, Any, int]] = (),
) -> Rollout:
    """Start an engine from ``engine_kwargs``, send ``requests`` (``(index, request, seed)``) at once with
    ``sampling`` (``OmniDiffusionSamplingParams`` fields, each request its own copy) and count what the
    encoder and the cache did; then send ``later``, uncounted. Every model's end-to-end test rolls out here."""
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    started = time.perf_counter()
    async with open_engine(engine_kwargs) as engine:
        init_seconds = time.perf_counter() - started

        async def one(index: int, request: Any, seed: int, request_label: str) -> tuple[int, Any]:
            params = OmniDiffusionSamplingParams(**copy.deepcopy(dict(sampling)), seed=seed)
            return index, await final_output(engine, request, params, f"{request_label}-{index}")

        finished, counts = await counted(engine, lambda: asyncio.gather(*(one(*each, label) for each in requests)))
        sent_later = await asyncio.gather(*(one(*each, f"{label}-later") for each in later))
    return Rollout(
        **vars(counts),
        outputs=dict(finished),
        later=dict(sent_later),
        init_seconds=init_seconds,
        seconds=time.perf_counter() - started,
    )


async def final_output(engine: Any, request: Any, params: Any, request_id: str) -> Any:
    """Return the last output ``engine.generate`` yields for one request."""
    final = None
    async for output in engine.generate(request, params, request_id=request_id):
        final = output
    return final


RELOADING_EXTENSION = "engine_support.WeightReloadingExtension"


class WeightReloadingExtension(TextEncoderCountersExtension):
    """Reloads weights through ``pipeline.load_weights``, as RL frameworks sync new weights."""

    def reload_weights(self, component: str) -> int:
        pipeline = self.model_runner.pipeline
        module = getattr(pipeline, component)
        weights = [(f"{component}.{name}", p.detach().clone()) for name, p in module.named_parameters()]
        pipeline.load_weights(weights)
        return len(weights)


class MessageCollector(logging.Handler):
    """Keeps the messages of the records at ``level`` or above that it sees."""

    def __init__(self, level: int = logging.INFO) -> None:
        super().__init__(level=level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def found_method(methods: dict[str, dict[str, Any]]) -> str:
    """Return the encode method in a snapshot's ``methods``, other than ``encode_prompt``, that the most calls went
    through: the one the cache found by watching the encoders (which one it is follows from the adapter's code; the
    engine's warm-up may reveal another, through the stock text path, with a call or two)."""
    called = {name: counts["hits"] + counts["misses"] for name, counts in methods.items() if name != "encode_prompt"}
    return max((name for name, calls in called.items() if calls), key=called.__getitem__)
