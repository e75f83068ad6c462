"""What a cache counts, declared once, and the one function that turns what happened into counts.

Every count belongs to the pipeline method whose call made it. A call's counts are made by
:func:`tally` from what the call came to and added under one lock when the call ends (or raises).
A snapshot copies the fields of :class:`Counters` by name; it never lists them by hand.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

#: The method every pipeline encodes prompts with, upstream's one cached method: a count belongs to
#: it when its caller names none.
ENCODE_PROMPT = "encode_prompt"


class Outcome(enum.Enum):
    """What one call (or one row) came to."""

    HIT = "served without encoding"
    MISS = "encoded, and offered to the cache"
    BYPASS = "encoded without the cache"


@dataclasses.dataclass
class Counters:
    """Every count a cache keeps for one method: a snapshot copies it field by field.

    Integers are event counts since the cache was made (``clear()`` keeps them); mappings count
    events by reason. :class:`~.stats.CacheStats` has a field of the same name for each.
    """

    hits: int = 0  # calls served without encoding
    misses: int = 0  # calls that ran the encoder and offered the result to the cache
    bypass_reasons: Counter[str] = dataclasses.field(default_factory=Counter)  # calls not using the cache
    evictions: int = 0
    oversize_rejections: int = 0
    # Rows of batched calls (pipelines with a row layout): each row is an entry of its own.
    row_hits: int = 0  # rows served without this call encoding them (cache, another call's encode, a duplicate)
    row_misses: int = 0  # rows encoded and offered to the store (kept unless a clear() or a budget intervened)
    row_bypass_reasons: Counter[str] = dataclasses.field(default_factory=Counter)  # rows encoded, not stored
    rows_encoded: int = 0  # rows that reached the encoder to be served: row misses and bypasses, whole calls
    whole_call_reasons: Counter[str] = dataclasses.field(default_factory=Counter)  # calls not split, and why
    # First-use checks of a row layout against the uncached call (see wrapper.py).
    layout_checks: int = 0  # calls served uncached and compared with their assembled rows
    layout_check_rows: int = 0  # rows those uncached calls sent to the encoder
    layout_mismatches: int = 0  # checks that turned rows off
    # Audits: hits encoded again and compared with what was served (see audit.py).
    audits: int = 0
    audit_mismatches: int = 0  # audits that found another output (the cache turned off)

    def add(self, counts: Mapping[str, Any]) -> None:
        """Add ``counts`` (field name to a number, or to counts by reason), as :func:`tally` makes them."""
        for name, value in counts.items():
            if type(value) is int:
                setattr(self, name, getattr(self, name) + value)
            else:  # counts by reason
                getattr(self, name).update(value)


#: The counts of a :class:`Counters`, by name: what snapshots copy for each method.
METHOD_COUNTER_FIELDS = tuple(field.name for field in dataclasses.fields(Counters))
#: Those of them kept by reason.
REASON_FIELDS = tuple(field.name for field in dataclasses.fields(Counters) if field.default_factory is Counter)


def tally(
    call: Outcome | None = None,
    *,
    reason: str | None = None,
    rows_hit: int = 0,
    rows_missed: int = 0,
    row_reasons: Mapping[str, int] | None = None,
    rows_encoded: int = 0,
    whole_call: str | None = None,
) -> dict[str, Any]:
    """Return what one call adds to its method's counters.

    ``call``: what the call came to (None: counted by another tally); ``reason``: why it bypassed;
    ``rows_*``: what its rows came to and how many reached the encoder; ``row_reasons``: its rows
    encoded without being cached, by reason; ``whole_call``: why a call with a row layout was not
    split into rows.
    """
    counts: dict[str, Any] = {}
    if call is Outcome.HIT:
        counts["hits"] = 1
    elif call is Outcome.MISS:
        counts["misses"] = 1
    elif call is Outcome.BYPASS:
        counts["bypass_reasons"] = {reason: 1}
    if rows_hit:
        counts["row_hits"] = rows_hit
    if rows_missed:
        counts["row_misses"] = rows_missed
    if row_reasons:
        counts["row_bypass_reasons"] = row_reasons
    if rows_encoded:
        counts["rows_encoded"] = rows_encoded
    if whole_call is not None:
        counts["whole_call_reasons"] = {whole_call: 1}
    return counts


#: What a call served from an entry adds (the hit path's tallies, made once): keyed whole, or as its one row.
WHOLE_HIT: Mapping[str, Any] = MappingProxyType(tally(Outcome.HIT))
ROW_HIT: Mapping[str, Any] = MappingProxyType(tally(Outcome.HIT, rows_hit=1))


def ranked_reasons(reasons: Counter[str]) -> dict[str, int]:
    """Return the non-zero counts, most common first (the order every snapshot shows reasons in)."""
    return {reason: count for reason, count in reasons.most_common() if count}


class MethodCounters:
    """Every cached method's :class:`Counters`, by method: a store's totals are their sums. A method's
    counters are made on first use.

    Every addition and every read holds :attr:`lock`, re-entrant so that upstream's wrapper can count
    under it as it does with its own cache (``with cache._lock: cache.bypassed += 1``): that
    read-modify-write then loses no count another thread adds meanwhile.
    """

    def __init__(self) -> None:
        self._by_method: dict[str, Counters] = {ENCODE_PROMPT: Counters()}
        self.lock = threading.RLock()

    def add(self, method: str, counts: Mapping[str, Any]) -> None:
        """Add one :func:`tally` to ``method``'s counters."""
        with self.lock:
            (self._by_method.get(method) or self._of(method)).add(counts)

    def register(self, method: str) -> None:
        """Make ``method``'s counters now, at zero (snapshots list it from then on)."""
        with self.lock:
            self._of(method)

    def _of(self, method: str) -> Counters:
        counts = self._by_method.get(method)
        if counts is None:
            counts = self._by_method[method] = Counters()
        return counts

    def total(self, name: str) -> Any:
        """Return the sum of one :class:`Counters` field over every method (a Counter for counts by reason)."""
        with self.lock:
            values = [getattr(counts, name) for counts in self._by_method.values()]
        return sum(values, Counter()) if isinstance(values[0], Counter) else sum(values)

    def assign(self, name: str, total: int, *, reason: str = "") -> None:
        """Make the sum of ``name`` ``total``, as upstream's code assigns ``cache.hits``: 0 resets every
        method's; another value moves encode_prompt's share (under ``reason`` for a count by reason)."""
        with self.lock:
            now = self.total(name)
            default = self._by_method[ENCODE_PROMPT]
            if total == 0:
                for counts in self._by_method.values():
                    setattr(counts, name, Counter() if isinstance(getattr(counts, name), Counter) else 0)
            elif isinstance(kept := getattr(default, name), Counter):
                kept[reason] += total - sum(now.values())
            else:
                setattr(default, name, kept + total - now)

    def read(self) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """Return every count summed over methods, and each method's, read at one moment; counts by
        reason are plain dicts, most common first."""
        with self.lock:
            methods = {
                method: {
                    name: ranked_reasons(value) if isinstance(value := getattr(counts, name), Counter) else value
                    for name in METHOD_COUNTER_FIELDS
                }
                for method, counts in self._by_method.items()
            }
            totals = {name: self.total(name) for name in METHOD_COUNTER_FIELDS}
        return {
            name: ranked_reasons(value) if isinstance(value, Counter) else value for name, value in totals.items()
        }, methods
