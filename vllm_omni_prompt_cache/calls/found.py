"""What serving a call that found an entry counts, and the reasons a call is served otherwise: shared by the
front (:mod:`.method_calls`) and both strategies (whole calls there, rows in :mod:`.row_calls`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from vllm_omni_prompt_cache.counts.counters import (
    PROVEN_ROW_HIT,
    PROVEN_WHOLE_HIT,
    ROW_HIT,
    UNPROVEN_REASONS,
    WHOLE_HIT,
    Count,
    Outcome,
    tally,
)
from vllm_omni_prompt_cache.keys.call_key import CallKey, with_encoder_input
from vllm_omni_prompt_cache.proof.verdicts import Unproven
from vllm_omni_prompt_cache.store.flights import Ticket

DISABLED_REASON = "cache disabled"
#: Whole-call reason for the call that found its row layout not to match the function's outputs
#: (the calls after it have no layout: they are keyed whole like any pipeline's).
LAYOUT_DROPPED_REASON = "row layout dropped: it did not match encode_prompt's outputs"
#: Whole-call reason for a call whose rows differ in dtype, device or shape: served uncached.
UNSTACKABLE_REASON = "rows could not be stacked into one output (dtype, device or shape differed)"


class FoundCounts(NamedTuple):
    """What a call that found an entry counts: served without a proof, served proven, or encoded instead."""

    hit: Mapping[Count, Any]
    proven: Mapping[Count, Any]
    encoded: Mapping[Count, Any]  # a miss's tally; the reason it was not proven is added

    def unproven(self, reason: str) -> dict[Count, Any]:
        return {**self.encoded, UNPROVEN_REASONS: {reason: 1}}


WHOLE_FOUND = FoundCounts(WHOLE_HIT, PROVEN_WHOLE_HIT, tally(Outcome.MISS))
ROW_FOUND = FoundCounts(ROW_HIT, PROVEN_ROW_HIT, tally(Outcome.MISS, rows_missed=1, rows_encoded=1))


@dataclass
class Found:
    """An entry a call's key found, and what proving it came to (see :meth:`MethodCalls.serve_found`)."""

    key: CallKey
    value: Any
    counts: FoundCounts
    made_under: Ticket  # the store's ticket before the call was looked up: what its own encode may be kept under
    proven: bool | None = None


def kept_under(key: CallKey, unproven: Unproven) -> CallKey:
    """Return the key an encode made instead of a hit is kept under: beside the entry it differed from when another
    input reached its first encoder call, else over it (what it did after that call differed)."""
    return key if unproven.first_input is None else with_encoder_input(key, unproven.first_input)


def transient(error: Exception) -> bool:
    """Return True for failures that say nothing about a layout (memory): they are raised, not held against it."""
    return isinstance(error, (MemoryError, torch.OutOfMemoryError))
