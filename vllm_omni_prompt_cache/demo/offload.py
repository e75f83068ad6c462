"""Rollouts through ``AsyncOmni`` that count where the text encoder went: vLLM-Omni's module offload
(``enable_cpu_offload``) with no cache, vLLM-Omni's cache, ours, ours on a precomputed directory;
and ours with the text encoder placed on the device only for a miss.

The counts come from the worker (``text_encoder_moves``, see
:mod:`vllm_omni_prompt_cache.tiny.worker_extension`): with our cache they are its own ``stats()``
counts; without it the same observer of vLLM-Omni's offload hooks counts them. On the CPU platform
the hooks' device is the host, so nothing is copied: the counts are the moves a GPU would make.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from vllm_omni_prompt_cache.demo.rollout import RolloutSpec, engine_kwargs, request_dicts, send_rollout
from vllm_omni_prompt_cache.settings.schema import DIRECTORY, ENCODER_ON_MISS
from vllm_omni_prompt_cache.vllm_omni.engine_client import open_engine, worker_value

#: The cache configurations an offload rollout compares (the demo's modes, plus ours on a directory).
CONFIGURATIONS = ("off", "stock", "ours", "ours, precomputed directory")
#: vLLM-Omni's module offload as a user turns it on (every encoder and the DiT swap).
MODULE_OFFLOAD = {"enable_cpu_offload": True}


@dataclasses.dataclass
class OffloadRollout:
    """What one engine's rollout moved, encoded and produced (the rollout's share: start-up excluded)."""

    configuration: str
    moves: dict[str, int]  # text_encoder_moves' counts added by the rollout ({} when nothing moves the encoder)
    placer: str | None
    rows_encoded: int  # prompt rows that reached the text encoder (the pipeline's own count)
    encoder_device_bytes: int | None  # text-encoder bytes on the device after the rollout (between requests)
    encoder_bytes: int  # the text encoders' parameter and buffer bytes
    latents: dict[int, torch.Tensor] = dataclasses.field(repr=False)
    startup_moves: dict[str, int] = dataclasses.field(default_factory=dict)  # counts before the rollout
    seconds: float = 0.0  # the rollout's wall time
    device_allocated: int | None = None  # CUDA bytes allocated after the rollout (None: no CUDA)
    device_peak: int | None = None  # CUDA peak bytes during the rollout
    device_free: int | None = None  # free device bytes after the rollout (memory outside torch included)


def _counts(moves: dict[str, Any] | None) -> dict[str, int]:
    return {} if moves is None else {name: int(value) for name, value in moves.items() if isinstance(value, int)}


async def offload_rollout(
    spec: RolloutSpec,
    configuration: str,
    *,
    offload: dict[str, Any] | None = None,
    directory: str | None = None,
    encoder_on_miss: bool = False,
    cache_size: int = 16,
) -> OffloadRollout:
    """Start an engine (``offload`` its offload kwargs), send ``spec`` once, return what moved."""
    mode = {"off": "off", "stock": "stock"}.get(configuration, "ours")
    kwargs = {**engine_kwargs(spec, mode, cache_size, None), **(offload or {})}
    if directory is not None:
        kwargs[DIRECTORY.name] = directory
    if encoder_on_miss:
        kwargs[ENCODER_ON_MISS.name] = True
    async with open_engine(kwargs) as engine:
        before = await worker_value(engine, "text_encoder_moves")
        rows_before = (await worker_value(engine, "text_encoder_counters"))["encoder_rows"]
        await engine.collective_rpc("device_memory", args=(True,))
        began = time.perf_counter()
        sent = await send_rollout(engine, spec)
        seconds = time.perf_counter() - began
        memory = await worker_value(engine, "device_memory")
        after = await worker_value(engine, "text_encoder_moves")
        rows_after = (await worker_value(engine, "text_encoder_counters"))["encoder_rows"]
        encoder_bytes = await worker_value(engine, "text_encoder_bytes")
    added = {name: value - _counts(before).get(name, 0) for name, value in _counts(after).items()}
    return OffloadRollout(
        configuration=configuration,
        moves=added,
        placer=None if after is None else after["placer"],
        rows_encoded=int(rows_after - rows_before),
        encoder_device_bytes=None if after is None else int(after["encoder_device_bytes"]),
        encoder_bytes=int(encoder_bytes),
        latents=sent.latents,
        startup_moves=_counts(before),
        seconds=seconds,
        device_allocated=None if memory is None else memory["allocated"],
        device_peak=None if memory is None else memory["peak"],
        device_free=None if memory is None else memory["free"],
    )


async def precompute_directory(spec: RolloutSpec, directory: str) -> None:
    """Fill ``directory`` with every prompt of ``spec`` (and, through the engine's start-up warm-up, its
    dummy prompt) with ``vllm-omni-prompt-cache precompute``'s function, sending what the rollout sends."""
    from vllm_omni_prompt_cache.vllm_omni.precompute import precompute

    kwargs = engine_kwargs(spec, "ours", 16, None)
    model = kwargs.pop("model")
    for name in ("enable_prompt_embed_cache", "prompt_embed_cache_size"):
        kwargs.pop(name)
    sampling = {"height": spec.height, "width": spec.width, "true_cfg_scale": spec.true_cfg_scale}
    await precompute(model, request_dicts(spec), directory, sampling=sampling, engine_args=kwargs)


def run_configurations(
    spec: RolloutSpec, configurations: Sequence[str], directory: str, *, offload: dict[str, Any] | None
) -> dict[str, OffloadRollout]:
    """Run each configuration on its own engine, in order; ``directory`` is filled first when one needs it."""

    async def run_all() -> dict[str, OffloadRollout]:
        results = {}
        for configuration in configurations:
            on_directory = configuration == "ours, precomputed directory"
            if on_directory:
                await precompute_directory(spec, directory)
            results[configuration] = await offload_rollout(
                spec, configuration, offload=offload, directory=directory if on_directory else None
            )
        return results

    return asyncio.run(run_all())
