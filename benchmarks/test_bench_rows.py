"""Row-level hit path (pytest-benchmark): what serving a batched call from cached rows costs.

    make bench      # runs these with the key benchmarks; docs/benchmarks.md gets the tables

A request-batched forward sends 16 rows (4 prompts x 4 siblings, Qwen-Image-templated lengths of
100-250 tokens, right-padded, a bool mask) in one ``encode_prompt`` call. Side by side, on the
same real 6-layer Qwen2 encoder as the key benchmarks:

* reference   one uncached call that encodes the 16 rows as one batch (the cheapest uncached way)
* ours        the whole wrapped call when every row is cached: the method's code, and its encoder call cut into
              16 row keys, looked up and stacked

and the one-row call every request makes at ``max_num_seqs`` 1, its encoder call keyed whole.
"""

from __future__ import annotations

import pytest
import torch
from conftest import encoder_label, time_hits, time_uncached

from vllm_omni_prompt_cache import install_prompt_embed_cache
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
    install_prompt_embed_cache(pipeline, max_size=64)
    pipeline.encode_prompt(ids, ids != 0)  # the encoder's first batched call: its rows checked, and cached
    group = (
        f"rows: a batch of {len(rows)} cached rows ({PROMPTS} prompts x {SIBLINGS}) on {encoder_label(bench_encoder)}"
    )
    return pipeline, ids, ids != 0, group


def test_encode_the_rows(benchmark, batched_call) -> None:
    time_uncached(benchmark, *batched_call, "encode the 16 rows (one uncached call)", rounds=10)


def test_cached_rows_call(benchmark, batched_call) -> None:
    time_hits(benchmark, *batched_call, "whole wrapper call, every row cached", rounds=ROUNDS, iterations=10)


@pytest.fixture(scope="module")
def one_row_call(bench_encoder) -> tuple[QwenStyleTokenPipeline, torch.Tensor, torch.Tensor, str]:
    """The max_num_seqs=1 case: every call is one prompt, its encoder call keyed whole."""
    ids = torch.randint(1, 32_000, (1, 512), generator=torch.Generator().manual_seed(0))
    pipeline = QwenStyleTokenPipeline(bench_encoder)
    install_prompt_embed_cache(pipeline, max_size=8)
    pipeline.encode_prompt(ids, ids != 0)
    return pipeline, ids, ids != 0, f"hit path: [1,512] on {encoder_label(bench_encoder)}"


def test_one_row_encode(benchmark, one_row_call) -> None:
    time_uncached(benchmark, *one_row_call, "one encode (uncached)")


def test_one_row_hit(benchmark, one_row_call) -> None:
    variant = "whole wrapper call on a hit (the method's code, its encoder call answered)"
    time_hits(benchmark, *one_row_call, variant, rounds=ROUNDS, iterations=100)
