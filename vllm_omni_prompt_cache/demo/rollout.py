"""Run a GRPO-shaped rollout through the real ``AsyncOmni`` engine and measure it.

P prompts x K siblings are sent concurrently, each request with its own seed and the token ids
of its prompt and of a shared negative prompt (CFG on), as verl-omni's rollout does. Each
cache mode gets its own engine, enabled by the same ``AsyncOmni`` kwargs a user passes:

* ``off``   -- ``enable_prompt_embed_cache=False``;
* ``stock`` -- vLLM-Omni 0.30's own cache (this package's plugin bypassed for that engine);
* ``ours``  -- this package's content-keyed cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_omni_prompt_cache.tiny.qwen_image import (
    SAMPLE_NEGATIVE_PROMPT,
    SAMPLE_PROMPTS,
    load_tokenizer,
    prompt_token_ids,
)
from vllm_omni_prompt_cache.vllm_omni.platform_plugins import CPU_PLATFORM_ENV, cpu_platform_requested

MODES = ("off", "stock", "ours")
TOKEN_ID_PIPELINE = "vllm_omni_prompt_cache.tiny.token_id_pipeline.TokenIdQwenImagePipeline"
DEFAULT_PROMPTS = SAMPLE_PROMPTS
NEGATIVE_PROMPT = SAMPLE_NEGATIVE_PROMPT


def use_cpu_platform_if_no_gpu() -> bool:
    """Opt into the CPU platform when no CUDA device is visible; return whether it is on.

    Must run before vLLM is imported (the platform is resolved at import).
    """
    if CPU_PLATFORM_ENV in os.environ:
        return cpu_platform_requested()
    if torch.cuda.is_available():
        return False
    os.environ[CPU_PLATFORM_ENV] = "1"
    return True


@dataclass(frozen=True)
class RolloutSpec:
    """What one rollout sends: P prompts x K siblings with their seeds and sampling settings."""

    model_dir: Path
    prompts: tuple[str, ...]
    group_size: int
    negative_prompt: str | None = NEGATIVE_PROMPT
    height: int = 64
    width: int = 64
    steps: int = 2
    true_cfg_scale: float = 4.0
    base_seed: int = 1234

    def requests(self) -> list[tuple[int, int, int]]:
        """Return ``(request_index, prompt_index, seed)`` for every request, siblings interleaved."""
        return [
            (index, prompt_index, self.base_seed + index)
            for index, (_, prompt_index) in enumerate(
                (sibling, p) for sibling in range(self.group_size) for p in range(len(self.prompts))
            )
        ]


@dataclass
class RolloutResult:
    """What one mode's rollout produced and measured."""

    mode: str
    wall_seconds: float
    engine_init_seconds: float
    requests: int
    stats: dict[str, Any] | None
    encoder_runs: int
    encode_seconds: float
    latents: dict[int, torch.Tensor] = field(repr=False, default_factory=dict)
    image_sizes: set[tuple[int, int]] = field(default_factory=set)
    worker_pid: int | None = None  # the diffusion worker's process (this one, unless spawned)


def engine_kwargs(spec: RolloutSpec, mode: str, cache_size: int, max_bytes: str | int | None) -> dict[str, Any]:
    """Return the ``AsyncOmni`` keyword arguments for ``mode`` (what a user would pass)."""
    from vllm_omni_prompt_cache.vllm_omni.worker_extension import WORKER_EXTENSION

    if mode not in MODES:
        raise ValueError(f"unknown cache mode {mode!r}: expected one of {', '.join(MODES)}")
    kwargs: dict[str, Any] = {
        "model": str(spec.model_dir),
        "custom_pipeline_args": {"pipeline_class": TOKEN_ID_PIPELINE},
        "worker_extension_cls": WORKER_EXTENSION,
        "enable_prompt_embed_cache": mode != "off",
        "prompt_embed_cache_size": cache_size,
        "log_stats": False,
    }
    if mode == "ours" and max_bytes is not None:
        kwargs["prompt_embed_cache_max_bytes"] = max_bytes
    return kwargs


@contextlib.asynccontextmanager
async def open_engine(kwargs: dict[str, Any], *, stock: bool = False) -> AsyncIterator[Any]:
    """Yield a started ``AsyncOmni``; with ``stock`` its worker installs vLLM-Omni's own cache."""
    from vllm_omni.entrypoints.async_omni import AsyncOmni

    from vllm_omni_prompt_cache.vllm_omni.bindings import stock_prompt_embed_cache

    with stock_prompt_embed_cache() if stock else contextlib.nullcontext():
        engine = AsyncOmni(**kwargs)
    try:
        yield engine
    finally:
        engine.shutdown()


async def worker_value(engine: Any, method: str) -> Any:
    """Return the first diffusion worker's answer to an RPC (one stage, one worker here)."""
    results = await engine.collective_rpc(method)
    value = results[0]
    while isinstance(value, list):
        value = value[0]
    return value


async def send_rollout(
    engine: Any,
    spec: RolloutSpec,
    on_done: Callable[[], None] | None = None,
) -> tuple[dict[int, torch.Tensor], set[tuple[int, int]]]:
    """Send every request of ``spec`` concurrently; return final latents by request and image sizes."""
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    tokenizer = load_tokenizer(spec.model_dir)
    prompt_ids = [prompt_token_ids(tokenizer, prompt) for prompt in spec.prompts]
    negative_ids = None if spec.negative_prompt is None else prompt_token_ids(tokenizer, spec.negative_prompt)

    async def one(index: int, prompt_index: int, seed: int) -> tuple[int, Any]:
        request: dict[str, Any] = {"prompt_ids": list(prompt_ids[prompt_index])}
        if negative_ids is not None:
            request["negative_prompt_ids"] = list(negative_ids)
        params = OmniDiffusionSamplingParams(
            height=spec.height,
            width=spec.width,
            num_inference_steps=spec.steps,
            seed=seed,
            true_cfg_scale=spec.true_cfg_scale,
            return_trajectory_latents=True,
        )
        final = None
        async for output in engine.generate(request, params, request_id=f"rollout-{index}"):
            final = output
        if final is None or final.error:
            raise RuntimeError(f"request {index} failed: {None if final is None else final.error}")
        if on_done is not None:
            on_done()
        return index, final

    finished = await asyncio.gather(*(one(*request) for request in spec.requests()))
    latents = {index: output.trajectory_latents for index, output in finished}
    sizes = {image.size for _, output in finished for image in output.images}
    return latents, sizes


async def run_mode(
    spec: RolloutSpec,
    mode: str,
    *,
    cache_size: int,
    max_bytes: str | int | None = None,
    on_done: Callable[[], None] | None = None,
    engine_overrides: dict[str, Any] | None = None,
) -> RolloutResult:
    """Start an engine for ``mode``, run the rollout once, and return what it measured."""
    started = time.perf_counter()
    kwargs = {**engine_kwargs(spec, mode, cache_size, max_bytes), **(engine_overrides or {})}
    async with open_engine(kwargs, stock=mode == "stock") as engine:
        init_seconds = time.perf_counter() - started
        stats_before = await worker_value(engine, "prompt_embed_cache_stats")
        counters_before = await worker_value(engine, "text_encoder_counters")
        worker_pid = counters_before["pid"]
        began = time.perf_counter()
        latents, sizes = await send_rollout(engine, spec, on_done)
        wall = time.perf_counter() - began
        stats_after = await worker_value(engine, "prompt_embed_cache_stats")
        counters_after = await worker_value(engine, "text_encoder_counters")
    return RolloutResult(
        mode=mode,
        wall_seconds=wall,
        engine_init_seconds=init_seconds,
        requests=len(spec.requests()),
        stats=stats_delta(stats_before, stats_after),
        encoder_runs=int(counters_after["encoder_runs"] - counters_before["encoder_runs"]),
        encode_seconds=counters_after["encode_seconds"] - counters_before["encode_seconds"],
        latents=latents,
        image_sizes=sizes,
        worker_pid=worker_pid,
    )


def stats_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """Return the counters that changed between two stats snapshots (the engine's warm-up excluded)."""
    if after is None:
        return None
    before = before or {}
    delta = dict(after)
    for key in ("hits", "misses", "bypassed", "evictions", "oversize_rejections"):
        if key in after:
            delta[key] = after[key] - before.get(key, 0)
    if "bypass_reasons" in after:
        earlier = before.get("bypass_reasons", {})
        delta["bypass_reasons"] = {
            reason: count - earlier.get(reason, 0)
            for reason, count in after["bypass_reasons"].items()
            if count - earlier.get(reason, 0)
        }
    calls = delta.get("hits", 0) + delta.get("misses", 0) + delta.get("bypassed", 0)
    delta["hit_rate"] = delta.get("hits", 0) / calls if calls else 0.0
    return delta
