"""Instrumentation an encode keeps on its pipeline counts every call, as uncached, and the cache stays on.

An encode that bumps a counter on ``self``, a dict of counts under a lock, or appends its timing to a
list reads that state and changes it on every call. The cache keys what reaches the text encoder, not
what the method reads, and runs the method's body for real on every call: such instrumentation, before
the encoder call or after it, counts exactly what it counts uncached (an uncached twin's counters), while
each distinct prompt is encoded once (real forwards of the encoder, counted by a hook on it), for
``encode_prompt`` and for a method found by watching.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.tiny.text_encoder import build_qwen2_encoder

PROMPTS = {"A": [5, 17, 29, 3], "B": [88, 41, 7, 7, 90, 12], "C": [600, 2]}
SEQUENCE = "AAABACB"


def encode(pipeline: Instrumented, prompt_ids: torch.Tensor) -> torch.Tensor:
    """The encode both methods share (a function, so that the method calling it is the encode found)."""
    started = time.perf_counter()
    if pipeline.where == "before":
        pipeline.instrument(started)
    hidden = pipeline.text_encoder(input_ids=prompt_ids).last_hidden_state
    if pipeline.where == "after":
        pipeline.instrument(started)
    return hidden


class Instrumented(torch.nn.Module):
    """A token-ID encode with instrumentation on ``self``: ``where`` is "before" or "after" the encoder call."""

    def __init__(self, encoder: torch.nn.Module, where: str) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.dit = torch.nn.Linear(4, 4)
        self.where = where
        self.calls = 0
        self.counts: dict[str, int] = {}
        self.timings: list[float] = []
        self._counts_lock = threading.Lock()
        self.encoder_forwards = 0  # the ground truth: counted by a hook on the encoder itself
        encoder.register_forward_hook(self._ran)

    def _ran(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        self.encoder_forwards += 1

    def instrument(self, started: float) -> None:
        self.calls += 1
        with self._counts_lock:
            self.counts["encode"] = self.counts.get("encode", 0) + 1
        self.timings.append(time.perf_counter() - started)

    @torch.inference_mode()
    def encode_prompt(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        return encode(self, prompt_ids)

    @torch.inference_mode()
    def embed_request(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        return encode(self, prompt_ids)

    @torch.inference_mode()
    def forward(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_request(prompt_ids)
        self.dit(torch.zeros(4))
        return embeds


@pytest.mark.parametrize("found", [False, True], ids=["encode_prompt", "found by watching"])
@pytest.mark.parametrize("where", ["before", "after"])
def test_instrumentation_on_the_pipeline_counts_every_call_and_keeps_the_cache_on(where: str, found: bool) -> None:
    pipeline = Instrumented(build_qwen2_encoder(), where)
    if found:
        pipeline.encode_prompt = None  # no encode_prompt: the encode is found by watching
    reference = Instrumented(build_qwen2_encoder(), where)  # the same seed: the same weights
    cache = install_prompt_embed_cache(pipeline)
    wrong = 0
    for name in SEQUENCE:
        ids = torch.tensor([PROMPTS[name]])
        served = pipeline(ids) if found else pipeline.encode_prompt(ids)
        wrong += not torch.equal(served, reference.encode_prompt(ids))
    assert wrong == 0
    stats = cache.stats()
    method = "embed_request" if found else "encode_prompt"
    assert stats["encode_methods"][method]["state"] == "cached"
    # One encode per distinct prompt (the bound the old design had, which let a method found by watching run twice
    # uncached), the repeats answered: real forwards of the encoder, counted by its hook.
    assert pipeline.encoder_forwards <= len(set(SEQUENCE)) + (2 if found else 0)
    assert stats["hits"] >= 2
    # The method's body runs on every call, before the encoder call or after it: its counters count calls, exactly
    # as the uncached twin's do.
    assert pipeline.calls == pipeline.counts["encode"] == len(pipeline.timings) == len(SEQUENCE)
    assert (pipeline.calls, pipeline.counts) == (reference.calls, reference.counts)
    assert len(pipeline.timings) == len(reference.timings)
