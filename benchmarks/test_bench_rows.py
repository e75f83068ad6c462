"""Row-level hit path (pytest-benchmark): what serving a batched call from cached rows costs.

    make bench      # runs these with the key benchmarks; docs/benchmarks.md gets the tables

A request-batched forward sends 16 rows (4 prompts x 4 siblings, Qwen-Image-templated lengths of
100-250 tokens, right-padded, a bool mask) in one ``encode_prompt`` call. Side by side, on the
same real 6-layer Qwen2 encoder as the key benchmarks:

* reference   one uncached call that encodes the 16 rows as one batch (the cheapest uncached way)
* ours        the whole wrapped call when every row is cached: split, 16 row keys, lookups, assembly
* part        the assembly alone: 16 cached rows padded into the output tensors

and the one-row call every request makes at ``max_num_seqs`` 1 on a recognised pipeline, whose
hit goes through the row path (the one-row test, the row key) instead of the whole-call key: its
table compares it with the same call on a pipeline without a row layout, keyed whole.
"""

from __future__ import annotations

import pytest
import torch
from conftest import encoder_label, time_hits, time_uncached

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.calls.layouts import TOKEN_IDS
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.tiny.text_encoder import QwenStyleTokenPipeline

PROMPTS, SIBLINGS = 4, 4
ROUNDS = 100


@pytest.fixture(scope="module")
def batched_call(bench_encoder) -> tuple[QwenStyleTokenPipeline, torch.Tensor, torch.Tensor, str]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(100, 250, (PROMPTS,), generator=generator).tolist()
    prompts = [torch.randint(1, 32_000, (length,), generator=generator) for length in lengths]
    rows = [prompts[index % PROMPTS] for index in range(PROMPTS * SIBLINGS)]
    ids = torch.zeros(len(rows), max(lengths), dtype=torch.int64)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = row
    pipeline = QwenStyleTokenPipeline(bench_encoder)
    install_prompt_embed_cache(pipeline, max_size=64, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    pipeline.encode_prompt(ids, ids != 0)  # every row cached from here on
    group = (
        f"rows: a batch of {len(rows)} cached rows ({PROMPTS} prompts x {SIBLINGS}) on {encoder_label(bench_encoder)}"
    )
    return pipeline, ids, ids != 0, group


def test_encode_the_rows(benchmark, batched_call) -> None:
    time_uncached(benchmark, *batched_call, "encode the 16 rows (one uncached call)", rounds=10)


def test_cached_rows_call(benchmark, batched_call) -> None:
    time_hits(benchmark, *batched_call, "whole wrapper call, every row cached", rounds=ROUNDS, iterations=10)


def test_assembly_alone(benchmark, batched_call) -> None:
    pipeline, ids, mask, group = batched_call
    split = TOKEN_IDS.split(
        {"prompt_ids": ids, "attention_mask": mask, "num_images_per_prompt": 1, "max_sequence_length": 1024}
    )
    original = pipeline._prompt_embed_cache_original_fn
    row_values = [original(**split.call_arguments(index)) for index in range(split.batch)]
    benchmark.group = group
    benchmark.extra_info.update(variant="(assembly of 16 cached rows alone)", role="part")
    benchmark.pedantic(split.assemble, args=(row_values,), rounds=ROUNDS, iterations=10, warmup_rounds=3)


@pytest.fixture(scope="module")
def one_row_call(bench_encoder) -> tuple[QwenStyleTokenPipeline, torch.Tensor, torch.Tensor, str]:
    """The max_num_seqs=1 case on a recognised pipeline: every call is one row, keyed as a row."""
    ids = torch.randint(1, 32_000, (1, 512), generator=torch.Generator().manual_seed(0))
    pipeline = QwenStyleTokenPipeline(bench_encoder)
    install_prompt_embed_cache(pipeline, max_size=8, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    pipeline.encode_prompt(ids, ids != 0)
    return pipeline, ids, ids != 0, f"hit path, row layout: [1,512] on {encoder_label(bench_encoder)}"


def test_one_row_encode(benchmark, one_row_call) -> None:
    time_uncached(benchmark, *one_row_call, "one encode (uncached)")


def test_one_row_hit(benchmark, one_row_call) -> None:
    variant = "whole wrapper call on a hit (one-row test, row key, lookup)"
    time_hits(benchmark, *one_row_call, variant, rounds=ROUNDS, iterations=100)


@pytest.fixture(scope="module")
def one_whole_call(bench_encoder, one_row_call) -> tuple[QwenStyleTokenPipeline, torch.Tensor, torch.Tensor, str]:
    """The same one-row call on a pipeline without a row layout: keyed as a whole call (the baseline)."""
    _, ids, mask, group = one_row_call
    pipeline = QwenStyleTokenPipeline(bench_encoder)
    install_prompt_embed_cache(pipeline, max_size=8)
    pipeline.encode_prompt(ids, mask)
    return pipeline, ids, mask, group


def test_one_row_hit_keyed_whole(benchmark, one_whole_call) -> None:
    time_hits(
        benchmark,
        *one_whole_call,
        "whole wrapper call on a hit, no row layout (whole-call key)",
        rounds=ROUNDS,
        iterations=100,
        role="alternative",  # the row path's ratio to it is the comparison its table shows
    )
