"""Counts and row calls as the wrapper's method servers make them, for tests that drive a store without a pipeline."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from vllm_omni_prompt_cache.calls.row_batches import RowTally, serve_rows
from vllm_omni_prompt_cache.counts.counters import ENCODE_PROMPT, Outcome, tally
from vllm_omni_prompt_cache.keys.call_key import CallKey
from vllm_omni_prompt_cache.store.prompt_embed_cache import PromptEmbedCache

T = TypeVar("T")


def record_bypass(cache: PromptEmbedCache, reason: str, *, method: str = ENCODE_PROMPT) -> None:
    """Count one call that did not use the cache, under ``reason``."""
    cache.record(method, tally(Outcome.BYPASS, reason=reason))


def record_whole_call(cache: PromptEmbedCache, reason: str, *, method: str = ENCODE_PROMPT) -> None:
    """Count one call of a pipeline with a row layout that was keyed as a whole, under ``reason``."""
    cache.record(method, tally(whole_call=reason))


def get_or_compute_rows(
    cache: PromptEmbedCache, keys: Sequence[CallKey], compute: Callable[[int], T], *, method: str = ENCODE_PROMPT
) -> tuple[list[T], int]:
    """Return a value for each of ``keys`` (the rows of one call), running ``compute(i)`` per row to encode, and
    how many rows this call encoded; count the call, a hit when it encoded none."""
    rows = RowTally()
    try:
        values = serve_rows(cache.lookups, keys, compute, rows, method)
    except BaseException:
        cache.record(method, rows.counts(Outcome.MISS))
        raise
    cache.record(method, rows.counts(Outcome.MISS if rows.encoded else Outcome.HIT))
    return values, rows.encoded
