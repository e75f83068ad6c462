"""Entries share the leading positions whose bytes are equal (a prompt template), and serve each prompt its own bytes.

Qwen-Image wraps every prompt in a 34-token template, and a causal encoder's outputs at those positions are the same
bytes for every prompt: device memory keeps them once. A tiny real Qwen2 encoder (causal, random weights) behind a
token-ID ``encode_prompt``; its uncached twin (same seed) is the reference.
"""

from __future__ import annotations

import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.encoders.forms import ENTRY_TAG, Joined
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.store.shared_heads import SharedHeads
from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder
from vllm_omni_prompt_cache.vllm_omni.lifecycle import release_device_memory

TEMPLATE = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
PROMPTS = [torch.tensor([[*TEMPLATE, 100 + index, 7, 8 + index]]) for index in range(6)]  # each its own first word


def encode(pipeline: TokenIdTextPipeline, ids: torch.Tensor) -> torch.Tensor:
    return pipeline.encode_prompt(ids.clone(), torch.ones_like(ids))[0]


def same_bytes(first: torch.Tensor, second: torch.Tensor) -> bool:
    return first.shape == second.shape and torch.equal(first.view(torch.uint8), second.view(torch.uint8))


def test_prompts_behind_one_template_keep_it_once_and_are_served_their_own_bytes() -> None:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder(seed=3))
    twin = TokenIdTextPipeline(build_qwen2_encoder(seed=3))  # uncached: what each call must return
    cache = install_prompt_embed_cache(pipeline)
    for ids in PROMPTS:
        encode(pipeline, ids)
    served = [encode(pipeline, ids) for ids in PROMPTS]  # every one a hit, rebuilt from a head and a tail
    assert pipeline.encoder_runs == len(PROMPTS)
    assert all(same_bytes(hit, encode(twin, ids)) for hit, ids in zip(served, PROMPTS, strict=True))
    leaves = [leaf for entry in cache.lookups.entries.values() for leaf in entry.value[2] if leaf is not None]
    joined = [leaf for leaf in leaves if type(leaf) is Joined]
    assert len(joined) == len(PROMPTS) - 1  # the first is kept whole; a head starts where the second matches it
    row = served[0][0, 0]
    template_bytes = len(TEMPLATE) * row.numel() * row.element_size()
    assert cache.lookups.heads.nbytes == template_bytes  # the template, once: no head of what two prompts share
    whole = sum(len(ids[0]) * row.numel() * row.element_size() for ids in PROMPTS)
    assert cache.snapshot().bytes < whole - (len(PROMPTS) - 2) * template_bytes + 4096  # + the keys' bytes


def test_values_equal_but_bytes_different_are_not_shared_and_equal_bytes_are() -> None:
    heads = SharedHeads()
    first = torch.zeros(1, 6, 4)
    signed = first.clone()
    signed[0, 0, 0] = -0.0  # == 0.0, other bytes
    assert type(heads.share((ENTRY_TAG, "", (first,)))[2][0]) is torch.Tensor
    kept = heads.share((ENTRY_TAG, "", (signed,)))[2][0]
    assert type(kept) is torch.Tensor  # not joined: its first position differs in bytes
    nan = torch.full((1, 6, 4), float("nan"))
    heads.share((ENTRY_TAG, "", (nan,)))
    joined = heads.share((ENTRY_TAG, "", (nan.clone(),)))[2][0]
    assert type(joined) is Joined and joined.head.shape[1] == 6  # NaN bytes equal to themselves: shared
    assert same_bytes(torch.cat(joined, dim=1), nan)


def test_heads_go_with_a_clear_and_lower_tiers_keep_whole_tensors() -> None:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder(seed=3))
    twin = TokenIdTextPipeline(build_qwen2_encoder(seed=3))
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(host_bytes=2**20))
    for ids in PROMPTS:
        encode(pipeline, ids)
    release_device_memory(pipeline, "a test sleeps")  # every entry goes down to host memory, whole
    assert (cache.lookups.heads.nbytes, len(cache)) == (0, 0)
    host_values = [entry.value for entry in cache.host._entries.values()]
    assert host_values and not any(type(leaf) is Joined for value in host_values for leaf in value[2])
    assert all(same_bytes(encode(pipeline, ids), encode(twin, ids)) for ids in PROMPTS)
    assert pipeline.encoder_runs == len(PROMPTS)  # served from host memory, shared again on the way up
    cache.clear()
    assert cache.lookups.heads.nbytes == 0


def test_a_tensor_of_other_strides_is_kept_whole() -> None:
    heads = SharedHeads()
    strided = torch.zeros(1, 4, 6).transpose(1, 2)  # [1, 6, 4], not contiguous: a concatenation would be
    heads.share((ENTRY_TAG, "", (strided,)))
    assert type(heads.share((ENTRY_TAG, "", (strided.clone(),)))[2][0]) is torch.Tensor


def test_the_byte_budget_counts_each_entrys_head_in_full_and_bounds_what_is_held() -> None:
    probe = TokenIdTextPipeline(build_qwen2_encoder(seed=3))
    one = install_prompt_embed_cache(probe)
    encode(probe, PROMPTS[0])
    budget = 3 * one.snapshot().bytes  # three entries, each counted whole
    pipeline = TokenIdTextPipeline(build_qwen2_encoder(seed=3))
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(max_bytes=budget))
    for ids in PROMPTS:
        encode(pipeline, ids)
    stats = cache.snapshot()
    assert stats.size == 3 and stats.evictions == len(PROMPTS) - 3  # what sharing saves is not room for more
    assert stats.bytes < cache.lookups.entries.bytes <= budget  # what is held: the template once


def test_tensors_without_bytes_to_compare_are_kept_as_they_are() -> None:
    heads = SharedHeads()
    for make in (
        lambda: torch.zeros(1, 6, 0),  # no bytes
        lambda: torch.zeros(1, 6, 4, device="meta"),  # no values
        lambda: torch.zeros(1, 6, 4).to_sparse(),  # no strides
    ):
        first, second = make(), make()
        assert heads.share((ENTRY_TAG, "", (first,)))[2][0] is first
        assert heads.share((ENTRY_TAG, "", (second,)))[2][0] is second
