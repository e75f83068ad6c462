"""Key-build and hit-path micro benchmarks (pytest-benchmark), compared side by side per group.

    make bench      # runs these, writes benchmarks/results/keys.json, prints the Markdown tables

Each key variant starts from the same bound arguments of a verl-omni-shaped ``encode_prompt``
call and ends with the Python hash a dict lookup needs:

* ours          ``CallKeyBuilder.build_from_arguments`` (xxh3-128 digest + witness) + hash
* raw bytes     ``(dtype, shape, device, tensor.cpu().numpy().tobytes())`` per tensor + hash
* list          the adapter workaround: ``tensor.tolist()`` turned into tuples + hash
* bare xxh3     ``xxh3_128_digest`` of each tensor's bytes, nothing else: the floor
* bind          ``signature.bind`` alone, which every variant needs before it starts

The hit-path group times a whole wrapped ``encode_prompt`` call that hits, against one uncached
encode on the tiny real Qwen2 encoder. ``extra_info`` names each variant and its role, which
``render_tables.py`` uses to compute the ratios; the tables report the best (min) round.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import xxhash
from conftest import encoder_label, time_hits, time_uncached

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.keys.call_key import CallKey, CallKeyBuilder
from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline

# Calls per round keep a round near 1-3 ms, far above the timer's resolution; many short rounds
# give the best (min) round a good chance to miss other load on a shared 2-core machine.
CALLS_PER_ROUND = {(1, 512): 500, (16, 1024): 50}
ROUNDS = 200


def encode_prompt(
    prompt_ids,
    attention_mask=None,
    num_images_per_prompt=1,
    max_sequence_length=512,
    device=None,
    dtype=None,
):
    """The shape of verl-omni's token-ID encode_prompt call (signature only)."""


SIGNATURE = inspect.signature(encode_prompt)
BUILDER = CallKeyBuilder(SIGNATURE, "QwenImagePipeline")


def ours_key(arguments: dict) -> int:
    return hash(BUILDER.build_from_arguments(arguments).identity)


def raw_bytes_key(arguments: dict) -> int:
    parts = []
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            value = (value.dtype, tuple(value.shape), str(value.device), value.cpu().numpy().tobytes())
        parts.append((name, value))
    return hash(tuple(parts))


def list_key(arguments: dict) -> int:
    parts = []
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            value = tuple(map(tuple, value.tolist()))
        parts.append((name, value))
    return hash(tuple(parts))


def bare_xxh3(arguments: dict) -> list[bytes]:
    return [xxhash.xxh3_128_digest(v.numpy()) for v in arguments.values() if isinstance(v, torch.Tensor)]


def signature_bind(arguments: dict) -> inspect.BoundArguments:
    return SIGNATURE.bind(*arguments.values())


# (label, role, function); role "ours" is the row the others are compared with, "alternative"
# rows get a ratio, "part" rows (a cost every variant pays first) get none.
KEY_VARIANTS = [
    pytest.param("ours (xxh3-128 + witness)", "ours", ours_key, id="ours"),
    pytest.param("raw-bytes tuple key", "alternative", raw_bytes_key, id="raw-bytes"),
    pytest.param("list workaround (.tolist())", "alternative", list_key, id="list"),
    pytest.param("bare xxh3-128 over the bytes", "alternative", bare_xxh3, id="bare-xxh3"),
    pytest.param("(signature bind, same for all)", "part", signature_bind, id="bind"),
]


@pytest.fixture(scope="module", params=list(CALLS_PER_ROUND), ids=lambda shape: f"{shape[0]}x{shape[1]}")
def bound_call(request) -> tuple[tuple[int, int], dict]:
    batch, length = request.param
    ids = torch.randint(1, 150_000, (batch, length), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    arguments = SIGNATURE.bind(ids, ids != 0, 1, length, torch.device("cpu"), torch.bfloat16)
    arguments.apply_defaults()
    return request.param, dict(arguments.arguments)


@pytest.mark.parametrize(("label", "role", "function"), KEY_VARIANTS)
def test_key(benchmark, bound_call, label, role, function) -> None:
    (batch, length), arguments = bound_call
    assert type(BUILDER.build_from_arguments(arguments)) is CallKey
    benchmark.group = f"key: [{batch},{length}] int64 ids + bool mask"
    benchmark.extra_info.update(variant=label, role=role)
    benchmark.pedantic(
        function, args=(arguments,), rounds=ROUNDS, iterations=CALLS_PER_ROUND[(batch, length)], warmup_rounds=3
    )


@pytest.fixture(scope="module")
def cached_pipeline(bench_encoder) -> tuple[TokenIdTextPipeline, torch.Tensor, torch.Tensor, str]:
    pipeline = TokenIdTextPipeline(bench_encoder)
    install_prompt_embed_cache(pipeline, max_size=8)
    ids = torch.randint(1, 32_000, (1, 512), generator=torch.Generator().manual_seed(0))
    mask = ids != 0
    pipeline.encode_prompt(ids, mask)  # fill the cache
    return pipeline, ids, mask, f"hit path: [1,512] on {encoder_label(bench_encoder)}"


def test_one_encode(benchmark, cached_pipeline) -> None:
    time_uncached(benchmark, *cached_pipeline, "one encode (uncached)")


def test_hit_path(benchmark, cached_pipeline) -> None:
    time_hits(benchmark, *cached_pipeline, "whole wrapper call on a hit", rounds=ROUNDS, iterations=100)


class FoundByWatching(TokenIdTextPipeline):
    """The same encode under a name nobody listed, which ``forward`` calls: found by watching the encoder."""

    @torch.inference_mode()
    def embed_request_ids(
        self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.text_encoder(input_ids=prompt_ids, attention_mask=attention_mask.long()).last_hidden_state
        return hidden, attention_mask

    def forward(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        self.embed_request_ids(prompt_ids, attention_mask)


@pytest.fixture(scope="module")
def found_pipeline(bench_encoder, cached_pipeline) -> FoundByWatching:
    pipeline = FoundByWatching(bench_encoder)
    install_prompt_embed_cache(pipeline, max_size=8)
    _, ids, mask, _ = cached_pipeline
    for _ in range(4):  # open the encode, settle it (the next encoder call), learn the method, check a first hit
        pipeline(ids.clone(), mask.clone())
    assert pipeline._prompt_embed_cache.stats()["encode_methods"]["embed_request_ids"]["state"] == "cached"
    return pipeline


@pytest.mark.parametrize("which", ["encode_prompt", "found by watching"])
def test_found_method_hit_path(benchmark, cached_pipeline, found_pipeline, which) -> None:
    """A whole-call hit on a method found by watching, beside one on ``encode_prompt``, in one run."""
    pipeline, ids, mask, _ = cached_pipeline
    call = pipeline.encode_prompt if which == "encode_prompt" else found_pipeline.embed_request_ids
    counted = pipeline if which == "encode_prompt" else found_pipeline
    runs_before = counted.encoder_runs
    benchmark.group = "found by watching: whole-call hit, [1,512]"
    benchmark.extra_info.update(variant=which, role="ours" if which == "encode_prompt" else "alternative")
    benchmark.pedantic(lambda: call(ids.clone(), mask.clone()), rounds=ROUNDS, iterations=100, warmup_rounds=3)
    assert counted.encoder_runs == runs_before, "a timed call reached the encoder"
