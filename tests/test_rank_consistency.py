"""Tensor-parallel ranks must take identical hit/miss decisions, or their collectives deadlock.

Two separate processes stand in for two ranks: each builds its own fresh tensors (other memory
addresses) under another PYTHONHASHSEED, replays the same call sequence through a cache with
entry and byte budgets, and records every decision. The logs must match exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

RANK = r"""
import json, random, sys, torch
from vllm_omni_prompt_cache import PromptEmbedCacheSettings, install_prompt_embed_cache

class Pipeline:
    def encode_prompt(self, prompt_ids, attention_mask, num_images_per_prompt=1):
        width = 8 * int(prompt_ids[0, 0]) % 40 + 8  # outputs of different sizes: byte budget matters
        return torch.ones(prompt_ids.shape[0], width), attention_mask

rng = random.Random(0)  # the same request stream on every rank
prompts = [[rng.randrange(1, 50) for _ in range(rng.randrange(3, 12))] for _ in range(12)]
pipeline = Pipeline()
cache = install_prompt_embed_cache(pipeline, max_size=5, settings=PromptEmbedCacheSettings(max_bytes=2000))
decisions = []
for step in range(300):
    ids_list = prompts[rng.randrange(len(prompts))]
    ids = torch.tensor([ids_list + [0] * (12 - len(ids_list))])
    mask = ids != 0
    if step % 17 == 0:
        mask = mask.numpy().astype(object)  # an unkeyable argument now and then
    before = cache.snapshot()
    pipeline.encode_prompt(ids, mask)
    after = cache.snapshot()
    decision = "hit" if after.hits > before.hits else "miss" if after.misses > before.misses else "bypass"
    decisions.append([decision, after.evictions, after.size, after.bytes])
print(json.dumps(decisions))
"""


def run_rank(hash_seed: str) -> list:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    result = subprocess.run([sys.executable, "-c", RANK], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def two_ranks() -> tuple[list, list]:
    return run_rank("0"), run_rank("12345")


def test_ranks_take_identical_decisions_and_evictions() -> None:
    rank0, rank1 = two_ranks()
    assert rank0 == rank1
    kinds = {decision for decision, *_ in rank0}
    assert kinds == {"hit", "miss", "bypass"}  # the sequence exercises all three
    assert rank0[-1][1] > 0  # and evictions
