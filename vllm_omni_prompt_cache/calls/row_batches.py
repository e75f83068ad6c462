"""How one batched call's rows are served: each distinct row from its entry, or one encode of it alone.

Rows are the entries of :mod:`.layout` layouts. Each distinct row is claimed in the store like any
key (hit, own its flight, join another call's flight, or encode it uncached after a collision),
so rows share entries, single-flight and verification with whole calls. A call encodes the rows it
owns before it waits for rows other calls are encoding, so two calls waiting on each other cannot
deadlock. Counts go into a :class:`RowTally` that the caller adds once, also when a row raised.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

from vllm_omni_prompt_cache.counts.counters import Count, Outcome, tally
from vllm_omni_prompt_cache.keys.call_key import CallKey, freeze_witness, witness_matches
from vllm_omni_prompt_cache.store.flights import Claim
from vllm_omni_prompt_cache.store.lookups import Lookups

T = TypeVar("T")


@dataclasses.dataclass
class RowTally:
    """What one call's rows came to so far."""

    hit: int = 0  # served without this call encoding them (an entry, another call's encode, a duplicate)
    missed: int = 0  # encoded by this call and offered to the store
    bypassed: Counter[str] = dataclasses.field(default_factory=Counter)  # encoded, not stored, by reason
    encoded: int = 0  # sent to the encoder by this call, one that raised included
    proven: int = 0  # served from an entry once what reaches the text encoder was compared with its record
    unproven: Counter[str] = dataclasses.field(default_factory=Counter)  # found, not proven: encoded, by reason
    key_only: int = 0  # served from an entry on its key alone (no text encoder to prove it by)

    def not_proven(self, reason: str) -> None:
        """Count a row that found an entry it could not be proven equal to, and was encoded alone instead."""
        self.unproven[reason] += 1
        self.hit -= 1
        self.missed += 1
        self.encoded += 1

    def counts(self, call: Outcome | None) -> dict[Count, Any]:
        """Return the tally of these rows, and of their call as ``call`` (None: counted elsewhere)."""
        return tally(
            call,
            rows_hit=self.hit,
            rows_missed=self.missed,
            row_reasons=self.bypassed,
            rows_encoded=self.encoded,
            proven=self.proven,
            unproven=self.unproven,
            key_only=self.key_only,
        )


def serve_rows(
    lookups: Lookups, keys: Sequence[CallKey], compute: Callable[[int], T], rows: RowTally, method: str
) -> list[T]:
    """Return a value for each of ``keys`` (the rows of one call), running ``compute(i)`` per row to encode.

    Rows with the same key (identity and witness) share one entry and one encode, of the first of
    them; ``compute(i)`` gets that row's index. ``rows`` is counted as rows are served; ``method``:
    whose entries they are (for what their insertion evicts).
    """
    values: list[Any] = [None] * len(keys)
    pending, copies = distinct_rows(keys, verify=lookups.verify)
    while pending:
        claims = lookups.claim([keys[index] for index in pending], method)
        for index, (decision, claimed) in zip(pending, claims, strict=True):
            if decision is Claim.HIT:
                values[index] = claimed
                rows.hit += 1
            elif decision is Claim.DIRECT:
                rows.bypassed[claimed] += 1
        owned = [
            (index, claimed)
            for index, (decision, claimed) in zip(pending, claims, strict=True)
            if decision is Claim.OWN
        ]
        for position, (index, flight) in enumerate(owned):
            try:
                values[index], encoded = lookups.complete(
                    keys[index], flight, functools.partial(compute, index), method
                )
            except BaseException:
                rows.encoded += 1
                lookups.abandon([(keys[later], unrun) for later, unrun in owned[position + 1 :]])
                raise
            rows.encoded += encoded
            if encoded:
                rows.missed += 1
            else:
                rows.hit += 1
        joined = []
        for index, (decision, claimed) in zip(pending, claims, strict=True):
            if decision is Claim.DIRECT:
                rows.encoded += 1
                values[index] = compute(index)
            elif decision is Claim.JOIN:
                joined.append((index, claimed))
        pending = []
        for index, flight in joined:
            if not flight.wait():  # its owner's call raised; claim the row again
                pending.append(index)
                continue
            values[index] = flight.value
            rows.hit += 1
    for index, first in copies:
        values[index] = values[first]
    rows.hit += len(copies)
    return values


def distinct_rows(keys: Sequence[CallKey], *, verify: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """Return the first row of each distinct key, and ``(row, first row with its key)`` for the rest.

    Two rows share a key only if their witnesses match too (or verification is off, as for every
    hit); colliding rows stay apart, and the store serves the second one uncached. A witness is
    copied only when a later row shares its identity.
    """
    firsts: list[int] = []
    copies: list[tuple[int, int]] = []
    seen: dict[Hashable, list[int]] = {}  # identity -> the first rows with it (one per distinct witness)
    frozen: dict[int, tuple[bytes, ...]] = {}  # first row -> its witness, copied when first compared
    for index, key in enumerate(keys):
        earlier = seen.get(key.identity)
        if earlier is None:
            seen[key.identity] = [index]
            firsts.append(index)
            continue
        first = next((row for row in earlier if not verify or _same_witness(keys, frozen, row, key)), None)
        if first is None:
            earlier.append(index)
            firsts.append(index)
        else:
            copies.append((index, first))
    return firsts, copies


def _same_witness(keys: Sequence[CallKey], frozen: dict[int, tuple[bytes, ...]], row: int, key: CallKey) -> bool:
    witness = frozen.get(row)
    if witness is None:
        witness = frozen[row] = freeze_witness(keys[row].witness)
    return witness_matches(witness, key.witness)
