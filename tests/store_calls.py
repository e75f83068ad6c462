"""Counts and row calls as the cache's call servers make them, for tests that drive a store without a pipeline."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from vllm_omni_prompt_cache.counts.counters import ENCODE_PROMPT, Outcome, tally
from vllm_omni_prompt_cache.keys.call_key import CallKey
from vllm_omni_prompt_cache.store.prompt_embed_cache import PromptEmbedCache

T = TypeVar("T")


def record_bypass(cache: PromptEmbedCache, reason: str, *, method: str = ENCODE_PROMPT) -> None:
    """Count one call that did not use the cache, under ``reason``."""
    cache.record(method, tally(Outcome.BYPASS, reason=reason))


def record_whole_call(cache: PromptEmbedCache, reason: str, *, method: str = ENCODE_PROMPT) -> None:
    """Count one batched encoder call that was keyed as a whole, under ``reason``."""
    cache.record(method, tally(whole_call=reason))


def get_or_compute_rows(
    cache: PromptEmbedCache, keys: Sequence[CallKey], compute: Callable[[int], T], *, method: str = ENCODE_PROMPT
) -> tuple[list[T], int]:
    """Return a value for each of ``keys`` (the rows of one call), running ``compute(i)`` per row to encode, and
    how many rows this call encoded; count the call, a hit when it encoded none. Rows with the same key (identity
    and bytes) share the first one's value, as a batched encoder call's rows do."""
    values: list[Any] = [None] * len(keys)
    firsts: dict[tuple, int] = {}
    hit = missed = 0
    try:
        for index, key in enumerate(keys):
            spelled = (key.identity, tuple(bytes(part) for part in key.witness))
            first = firsts.get(spelled)
            if first is not None:
                values[index] = values[first]
                hit += 1
                continue
            firsts[spelled] = index
            ran: list[int] = []

            def encode(index: int = index, ran: list[int] = ran) -> T:
                ran.append(index)
                return compute(index)

            try:
                values[index] = cache.lookups.serve(key, encode, _uncounted, method)
            finally:  # a row that raised was encoded (tried) all the same
                if ran:
                    missed += 1
                else:
                    hit += 1
    finally:
        outcome = Outcome.MISS if missed else Outcome.HIT
        cache.record(method, tally(outcome, rows_hit=hit, rows_missed=missed, rows_encoded=missed))
    return values, missed


def _uncounted(outcome: Outcome, reason: str | None) -> None:
    return None
