"""Run a GRPO-shaped rollout through the real ``AsyncOmni`` engine and measure it.

P prompts x K siblings are sent concurrently, each request with its own seed and the token ids
of its prompt and of a shared negative prompt (CFG on), as verl-omni's rollout does. Each
cache mode gets its own engine, enabled by the same ``AsyncOmni`` kwargs a user passes:

* ``off``   -- ``enable_prompt_embed_cache=False``;
* ``stock`` -- vLLM-Omni 0.30's own cache (``prompt_embed_cache_backend="vllm-omni"``);
* ``ours``  -- this package's content-keyed cache.

With ``replicas`` > 1 the stage runs that many replicas behind ``lb_policy`` (see :mod:`.replicas`),
each with its own cache.
"""

from __future__ import annotations

import asyncio
import copy
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_omni_prompt_cache.store.prompt_embed_cache import CacheStats
from vllm_omni_prompt_cache.tiny.qwen_image import (
    SAMPLE_NEGATIVE_PROMPT,
    SAMPLE_PROMPTS,
    checkpoint_dtype,
    load_tokenizer,
    prompt_token_ids,
)
from vllm_omni_prompt_cache.vllm_omni.engine_client import cache_stats, open_engine, worker_values

MODES = ("off", "stock", "ours")
#: Request orders: sibling-major (one request of every prompt, then the next round), prompt-major
#: (a prompt's K siblings back to back, as verl's ``repeat(interleave=True)`` lays a batch out), or
#: shuffled (as many independent clients produce).
ARRIVALS = ("interleaved", "grouped", "shuffled")
TOKEN_ID_PIPELINE = "vllm_omni_prompt_cache.tiny.token_id_pipeline.TokenIdQwenImagePipeline"
DEFAULT_PROMPTS = SAMPLE_PROMPTS
NEGATIVE_PROMPT = SAMPLE_NEGATIVE_PROMPT
#: The models a rollout can run: Qwen-Image (FlowGRPO-shaped token-ID pipeline, images), Wan2.2
#: (verl-omni's DanceGRPO adapter's shape, videos; vLLM-Omni builds it from a registered pipeline) and
#: SD3.5 (verl-omni's FlowGRPO adapter's shape: CLIP and T5 ids per request, images).
MODELS = ("qwen-image", "wan2.2", "sd3")
WAN22_PIPELINE = "vllm_omni_prompt_cache.tiny.wan22_adapter.DanceGrpoWan22Pipeline"
SD3_PIPELINE = "vllm_omni_prompt_cache.tiny.sd3_adapter.StableDiffusion3PipelineWithLogProb"
PIPELINES = {"qwen-image": TOKEN_ID_PIPELINE, "wan2.2": WAN22_PIPELINE, "sd3": SD3_PIPELINE}


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
    max_num_seqs: int = 1  # requests vLLM-Omni's forward batches into one encode_prompt call
    step_execution: bool = False  # vLLM-Omni's continuous batching across denoising steps
    replicas: int = 1  # replicas of the diffusion stage, each with its own cache
    lb_policy: str | None = None  # how requests are spread over them (None: one replica)
    arrival: str = "interleaved"  # the order requests are sent in: one of ARRIVALS
    model: str = "qwen-image"  # one of MODELS: which pipeline model_dir holds
    frames: int = 5  # video frames per request (Wan2.2)

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"unknown arrival {self.arrival!r}: expected one of {', '.join(ARRIVALS)}")
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}: expected one of {', '.join(MODELS)}")

    def requests(self) -> list[tuple[int, int, int]]:
        """Return ``(request_index, prompt_index, seed)`` for every request, in the order they are sent."""
        prompts = range(len(self.prompts))
        if self.arrival == "grouped":
            order = [p for p in prompts for _ in range(self.group_size)]
        else:
            order = [p for _ in range(self.group_size) for p in prompts]
            if self.arrival == "shuffled":
                random.Random(self.base_seed).shuffle(order)
        return [(index, prompt_index, self.base_seed + index) for index, prompt_index in enumerate(order)]


@dataclass
class RolloutResult:
    """What one mode's rollout produced and measured."""

    mode: str
    wall_seconds: float
    engine_init_seconds: float
    requests: int
    stats: CacheStats | None  # what the rollout added (the engine's warm-up excluded); None: no cache
    encoder_runs: int
    encode_seconds: float
    latents: dict[int, torch.Tensor] = field(repr=False, default_factory=dict)
    image_sizes: set[tuple[int, int]] = field(default_factory=set)
    worker_pid: int | None = None  # the diffusion worker's process (this one, unless spawned)
    encoder_rows: int = 0  # prompt rows that reached the text encoder
    max_num_seqs: int = 1
    lb_policy: str | None = None
    replica_by_request: dict[int, int | None] = field(repr=False, default_factory=dict)
    encoder_runs_per_replica: tuple[int, ...] = ()
    routing: dict[str, Any] | None = None  # prompt-affinity's placement counts, when it routed

    @property
    def requests_per_replica(self) -> tuple[int, ...]:
        """Return how many requests each replica served, in replica order (from the outputs' replica ids)."""
        served = list(self.replica_by_request.values())
        return tuple(served.count(replica) for replica in range(len(self.encoder_runs_per_replica)))


@dataclass
class SentRollout:
    """What the engine returned for one rollout: final latents, image sizes, and who served each request."""

    latents: dict[int, torch.Tensor]
    image_sizes: set[tuple[int, int]]
    replica_by_request: dict[int, int | None]


def engine_kwargs(spec: RolloutSpec, mode: str, cache_size: int, max_bytes: str | int | None) -> dict[str, Any]:
    """Return the ``AsyncOmni`` keyword arguments for ``mode`` (what a user would pass)."""
    from vllm_omni_prompt_cache.tiny.worker_extension import WORKER_EXTENSION

    if mode not in MODES:
        raise ValueError(f"unknown cache mode {mode!r}: expected one of {', '.join(MODES)}")
    kwargs: dict[str, Any] = {
        "model": str(spec.model_dir),
        "custom_pipeline_args": {"pipeline_class": PIPELINES[spec.model]},
        "worker_extension_cls": WORKER_EXTENSION,
        "enable_prompt_embed_cache": mode != "off",
        "prompt_embed_cache_size": cache_size,
        "log_stats": False,
        "max_num_seqs": spec.max_num_seqs,
    }
    if spec.step_execution:
        kwargs["step_execution"] = True
    dtype = checkpoint_dtype(spec.model_dir)
    if dtype is not None:  # vLLM-Omni's default is bf16 whatever the weights are
        kwargs["dtype"] = dtype
    if mode == "stock":
        kwargs["prompt_embed_cache_backend"] = "vllm-omni"
    if mode == "ours" and max_bytes is not None:
        kwargs["prompt_embed_cache_max_bytes"] = max_bytes
    if spec.lb_policy is not None:
        from vllm_omni_prompt_cache.demo.replicas import distributed_kwargs

        kwargs.update(distributed_kwargs(spec.replicas, spec.lb_policy))
    return kwargs


async def send_rollout(
    engine: Any,
    spec: RolloutSpec,
    on_done: Callable[[], None] | None = None,
) -> SentRollout:
    """Send every request of ``spec`` concurrently; return what came back."""
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    by_prompt = request_dicts(spec)

    async def one(index: int, prompt_index: int, seed: int) -> tuple[int, Any]:
        request = copy.deepcopy(by_prompt[prompt_index])  # each request its own lists, as sent over the wire
        by_model: dict[str, Any] = {
            "qwen-image": {"true_cfg_scale": spec.true_cfg_scale},
            # Wan2.2: guidance_scale is its CFG scale; "np" output, as verl-omni's rollout asks for it.
            "wan2.2": {"num_frames": spec.frames, "guidance_scale": spec.true_cfg_scale, "output_type": "np"},
            "sd3": {"guidance_scale": spec.true_cfg_scale},
        }[spec.model]
        params = OmniDiffusionSamplingParams(
            height=spec.height,
            width=spec.width,
            num_inference_steps=spec.steps,
            seed=seed,
            return_trajectory_latents=True,
            **by_model,
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
    return SentRollout(
        latents={index: output.trajectory_latents for index, output in finished},
        image_sizes={_size(image) for _, output in finished for image in output.images},
        replica_by_request={index: getattr(output, "replica_id", None) for index, output in finished},
    )


def request_dicts(spec: RolloutSpec) -> list[dict[str, Any]]:
    """Return each prompt's request as verl-omni's rollout sends it to this model's adapter (its keys)."""
    if spec.model == "sd3":  # one id list per text encoder's tokenizer
        from vllm_omni_prompt_cache.tiny.sd3 import load_tokenizers, rollout_request

        tokenizers = load_tokenizers(spec.model_dir)
        return [rollout_request(tokenizers, prompt, spec.negative_prompt) for prompt in spec.prompts]
    tokenizer = load_tokenizer(spec.model_dir)
    if spec.model == "wan2.2":  # verl-omni's DanceGRPO sends the plain ids, end-of-sequence token included

        def token_ids(text: str) -> list[int]:
            return tokenizer(text)["input_ids"]

    else:

        def token_ids(text: str) -> list[int]:
            return prompt_token_ids(tokenizer, text)

    requests: list[dict[str, Any]] = [{"prompt_token_ids": token_ids(prompt)} for prompt in spec.prompts]
    if spec.negative_prompt is not None:
        negative_ids = token_ids(spec.negative_prompt)
        for request in requests:
            request["negative_prompt_ids"] = list(negative_ids)
    return requests


def _size(image: Any) -> tuple[int, int]:
    """Width and height of a PIL image, or of a video array ``(1, frames, height, width, 3)``."""
    shape = getattr(image, "shape", None)
    return image.size if shape is None else (int(shape[-2]), int(shape[-3]))


async def run_mode(
    spec: RolloutSpec,
    mode: str,
    *,
    cache_size: int,
    max_bytes: str | int | None = None,
    on_started: Callable[[], None] | None = None,
    on_done: Callable[[], None] | None = None,
    engine_overrides: dict[str, Any] | None = None,
) -> RolloutResult:
    """Start an engine for ``mode``, run the rollout once, and return what it measured.

    ``on_started`` runs once the engine is up, ``on_done`` after each request.
    """
    started = time.perf_counter()
    kwargs = {**engine_kwargs(spec, mode, cache_size, max_bytes), **(engine_overrides or {})}
    async with open_engine(kwargs) as engine:
        init_seconds = time.perf_counter() - started
        if on_started is not None:
            on_started()
        stats_before = await cache_stats(engine)
        counters_before = await worker_values(engine, "text_encoder_counters")
        began = time.perf_counter()
        sent = await send_rollout(engine, spec, on_done)
        wall = time.perf_counter() - began
        stats_after = await cache_stats(engine)
        counters_after = await worker_values(engine, "text_encoder_counters")
        routing = _routing_stats(engine)

    def added(counter: str) -> list[float]:
        return [after[counter] - before[counter] for before, after in zip(counters_before, counters_after, strict=True)]

    return RolloutResult(
        mode=mode,
        wall_seconds=wall,
        engine_init_seconds=init_seconds,
        requests=len(spec.requests()),
        stats=None if stats_after is None else stats_after.since(stats_before or CacheStats()),
        encoder_runs=int(sum(added("encoder_runs"))),
        encoder_rows=int(sum(added("encoder_rows"))),
        encode_seconds=sum(added("encode_seconds")),
        latents=sent.latents,
        image_sizes=sent.image_sizes,
        worker_pid=counters_before[0]["pid"],
        max_num_seqs=spec.max_num_seqs,
        lb_policy=spec.lb_policy,
        replica_by_request=sent.replica_by_request,
        encoder_runs_per_replica=tuple(int(runs) for runs in added("encoder_runs")),
        routing=routing,
    )


def _routing_stats(engine: Any) -> dict[str, Any] | None:
    """Return prompt-affinity's placement counts for the diffusion stage, if it routed this engine."""
    from vllm_omni_prompt_cache.vllm_omni.balancer import routing_stats

    pools = getattr(getattr(engine, "engine", None), "stage_pools", None) or []
    return routing_stats(pools).get(0)
