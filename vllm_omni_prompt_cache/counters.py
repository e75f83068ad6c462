"""What a cache counts, declared once, and the one function that turns what happened into counts.

:data:`COUNTS` is the table of every counter: one :class:`Count` each. :class:`Counters` (each
method's counts), :class:`~.stats.CacheStats` (the snapshot) and the Prometheus families of
``vllm_omni/metrics.py`` are generated from it, so a new counter is one more line there.

Every count a call makes belongs to the pipeline method whose call made it. A call's counts are
made by :func:`tally` from what the call came to and added under one lock when the call ends (or
raises). The tiers below device memory and the encoder moves keep their own counts, which a
snapshot reads off them by the attribute the table names.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

#: The method every pipeline encodes prompts with, upstream's one cached method: a count belongs to
#: it when its caller names none.
ENCODE_PROMPT = "encode_prompt"
#: Where a count made by calls is kept: each method's :class:`Counters` (the others name a tier's attribute).
CALLS = "calls"


@dataclasses.dataclass(frozen=True)
class Count:
    """One counter: its snapshot field, who keeps it, and the Prometheus family it advances.

    The family is ``vllm_omni:prompt_embed_cache_<family>_total`` with labels ``model_name``, ``stage``,
    ``replica``, then the names of ``labels`` (fixed values, for a family several counts share), then
    ``reason`` for a count by reason. ``by_method``: the family (name, help) that counts it by method
    too (label ``method`` after the replica's).
    """

    name: str  # the field of the snapshot, and of Counters when calls make it
    help: str | None  # the family's help text; None: no family (stats() only)
    kept_by: str = CALLS  # CALLS, or "tier.attribute": a count the tier (host, directory) or the moves keep
    by_reason: bool = False  # counted by reason: each reason its own series
    family: str = ""  # the family's name, when it is not the count's
    labels: tuple[tuple[str, str], ...] = ()  # (label, value) of its series in a family other counts share
    by_method: tuple[str, str] | None = None  # the family (name, help) counting it per method

    def __post_init__(self) -> None:
        if not self.family:
            object.__setattr__(self, "family", self.name)

    @property
    def label_names(self) -> tuple[str, ...]:
        """Return its family's labels after ``model_name``, ``stage``, ``replica`` (and ``method``)."""
        return (*(label for label, _ in self.labels), *(("reason",) if self.by_reason else ()))

    @property
    def label_values(self) -> tuple[str, ...]:
        """Return the values of its series' fixed labels (before a reason)."""
        return tuple(value for _, value in self.labels)


#: The family the exactness checks share, each check a series of its own (label ``check``), and its help.
VERIFICATION_FAILURES = "verification_failures"
VERIFICATION_FAILURES_HELP = (
    "Exactness checks that failed: a key whose stored bytes differed (check=key, the call is encoded), "
    "a row layout whose rows differed from the uncached call (check=row_layout, rows turned off), "
    "or a hit whose fresh encode differed (check=audit, the cache turned off for the class)."
)

#: Every counter, once. Integers are event counts since the cache was made (``clear()`` keeps them);
#: counts by reason are Counters (mappings in a snapshot). The help texts are the ``/metrics`` page's.
COUNTS: tuple[Count, ...] = (
    # Calls, by the method that made them.
    Count(
        "hits",
        "encode_prompt calls served from the cache, without encoding.",
        by_method=("method_hits", "Calls of one cached method served without encoding."),
    ),
    Count(
        "misses",  # calls that ran the encoder and offered the result to the cache
        "encode_prompt calls that ran the text encoder and offered the result.",
        by_method=("method_misses", "Calls of one cached method that ran the encoder."),
    ),
    Count(
        "bypass_reasons",  # calls not using the cache
        "encode_prompt calls that did not use the cache, by reason (bounded set).",
        by_reason=True,
        family="bypassed",
        by_method=("method_bypassed", "Calls of one cached method that did not use the cache, by reason."),
    ),
    Count("evictions", "Entries evicted to stay within the entry or byte budget."),
    Count("oversize_rejections", "Results larger than the byte budget, not stored."),
    # Rows of batched calls (pipelines with a row layout): each row is an entry of its own.
    # row_hits: served without this call encoding them (cache, another call's encode, a duplicate);
    # row_misses: encoded and offered to the store (kept unless a clear() or a budget intervened).
    Count("row_hits", "Rows of batched calls served without encoding them."),
    Count("row_misses", "Rows of batched calls encoded and offered to the cache (kept unless over a budget)."),
    Count(
        "row_bypass_reasons",
        "Rows of batched calls encoded without caching, by reason.",
        by_reason=True,
        family="row_bypassed",
    ),
    Count(
        "rows_encoded",  # rows that reached the encoder to be served: row misses and bypasses, whole calls
        "Prompt rows that reached the text encoder (misses and bypasses).",
        by_method=("method_rows_encoded", "Prompt rows one cached method sent to the text encoder."),
    ),
    Count(
        "whole_call_reasons",
        "Batched calls cached as one entry instead of row by row, by reason.",
        by_reason=True,
        family="whole_calls",
    ),
    # Hits proven before they are served: what would reach the text encoder compared with what reached it
    # when the entry was made (see encoder_inputs.py).
    Count("proven_hits", "Calls and rows served from the cache after their text-encoder inputs matched the entry's."),
    Count(
        "unproven_reasons",
        "Calls and rows that found an entry but were encoded, since it could not be proven equal, by reason.",
        by_reason=True,
        family="unproven",
    ),
    Count(
        "changed_entries",
        "Entries found changed in place since they were stored (a caller wrote into a served tensor): dropped.",
    ),
    # First-use checks of a row layout against the uncached call (see wrapper.py).
    Count("layout_checks", None),  # calls served uncached and compared with their assembled rows
    Count("layout_check_rows", None),  # rows those uncached calls sent to the encoder
    Count(
        "layout_mismatches",
        VERIFICATION_FAILURES_HELP,
        family=VERIFICATION_FAILURES,
        labels=(("check", "row_layout"),),
    ),
    # Audits: hits encoded again and compared with what was served (see audit.py).
    Count("audits", "Hits encoded again and compared with what was served (check=audit fails)."),
    Count("audit_mismatches", VERIFICATION_FAILURES_HELP, family=VERIFICATION_FAILURES, labels=(("check", "audit"),)),
    # The host-memory tier.
    Count("host_hits", "Device-memory misses served from the host-memory tier.", "host.hits"),
    Count("host_misses", "Device-memory misses the host-memory tier did not hold.", "host.misses"),
    Count(
        "host_demotions",
        "Entries moved from device memory to the host-memory tier (evicted, or at sleep).",
        "host.demotions",
    ),
    Count("host_evictions", "Entries dropped from the host-memory tier by its budget.", "host.evictions"),
    # The directory tier.
    Count("dir_hits", "Misses in memory served from a file of the directory tier.", "directory.hits"),
    Count("dir_misses", "Misses in memory the directory tier had no usable file for.", "directory.misses"),
    Count("dir_writes", "Encoded entries written to the directory tier.", "directory.writes"),
    Count(
        "dir_write_errors",
        "Writes to the directory tier that failed (a full disk...); the entry stays in memory.",
        "directory.write_errors",
    ),
    Count("dir_evictions", "Files removed from the directory tier to stay within its budget.", "directory.evictions"),
    Count(
        "dir_rejections",
        "Files of the directory tier removed on read, by reason: truncated, corrupt, another namespace, "
        "other key bytes. Each is a miss, never an error or a wrong embedding.",
        "directory.rejections",
        by_reason=True,
    ),
    Count(
        "dir_waits",
        "Misses served by waiting for another process's encode of the same entry (then a hit).",
        "directory.waits",
    ),
    Count(
        "dir_stale_claims",
        "Claims on directory entries taken over: their process was gone, or silent for the claim wait.",
        "directory.stale_claims",
    ),
    Count(
        "dir_wait_timeouts",
        "Waits for another process's encode that ended without its file (then encoded here).",
        "directory.wait_timeouts",
    ),
    Count(
        "dir_leftovers_removed",
        "Temporary and claim files of crashed processes removed from the directory tier.",
        "directory.leftovers_removed",
    ),
    # Moves of the text encoders (and the DiTs they swap with) between host and device, whoever made
    # them: vLLM-Omni's module offload, or this package's placement on a miss (see residency.py).
    Count(
        "encoder_placements",
        "Text-encoder moves onto the device (vLLM-Omni's module offload, or this cache's placement on a miss).",
        "moves.encoder_placements",
    ),
    Count("encoder_evictions", "Text-encoder moves off the device.", "moves.encoder_evictions"),
    Count(
        "dit_placements",
        "DiT moves back onto the device that vLLM-Omni's module offload made after an encode.",
        "moves.dit_placements",
    ),
    Count(
        "dit_evictions",
        "DiT moves to the host that vLLM-Omni's module offload made for an encode.",
        "moves.dit_evictions",
    ),
    Count("bytes_moved", "Bytes those moves copied between host and device.", "moves.bytes_moved"),
    Count(
        "placements_avoided",
        "Text-encoder placements that calls served from the cache did not make.",
        "moves.placements_avoided",
    ),
    Count(
        "bytes_not_moved",
        "Bytes those avoided placements, and the DiT swaps they bring, would have copied.",
        "moves.bytes_not_moved",
    ),
)


class Outcome(enum.Enum):
    """What one call (or one row) came to."""

    HIT = "served without encoding"
    MISS = "encoded, and offered to the cache"
    BYPASS = "encoded without the cache"


#: The counts calls make, kept per method: the fields of :class:`Counters`.
CALL_COUNTS = tuple(count for count in COUNTS if count.kept_by == CALLS)


def count_fields(counts: Iterable[Count], by_reason: Any, reasons: Callable[[], Any]) -> dict[str, tuple[Any, Any]]:
    """Return a dataclass field (type hint, default) for each count: an int from 0, or ``by_reason`` made by
    ``reasons``."""
    return {
        count.name: (by_reason, dataclasses.field(default_factory=reasons)) if count.by_reason else (int, 0)
        for count in counts
    }


def with_fields(fields: Mapping[str, tuple[Any, Any]]) -> Callable[[type], type]:
    """Return a class decorator, for under ``@dataclass``: make ``fields`` (name: (type hint, default)) the
    class's fields, in their order, as if its body declared them."""

    def declare(cls: type) -> type:
        cls.__annotations__ = {name: hint for name, (hint, _) in fields.items()}
        for name, (_, default) in fields.items():
            setattr(cls, name, default)
        return cls

    return declare


@dataclasses.dataclass
@with_fields(count_fields(CALL_COUNTS, Counter[str], Counter))
class Counters:
    """Every count a cache keeps for one method (one field per :data:`CALL_COUNTS` entry): a snapshot
    copies it field by field.

    Integers are event counts since the cache was made (``clear()`` keeps them); Counters count
    events by reason. :class:`~.stats.CacheStats` has a field of the same name for each.
    """

    def add(self, counts: Mapping[str, Any]) -> None:
        """Add ``counts`` (field name to a number, or to counts by reason), as :func:`tally` makes them."""
        for name, value in counts.items():
            if type(value) is int:
                setattr(self, name, getattr(self, name) + value)
            else:  # counts by reason
                getattr(self, name).update(value)


#: The counts of a :class:`Counters`, by name: what snapshots copy for each method.
METHOD_COUNTER_FIELDS = tuple(count.name for count in CALL_COUNTS)
#: Those of them kept by reason.
REASON_FIELDS = tuple(count.name for count in CALL_COUNTS if count.by_reason)


def tally(
    call: Outcome | None = None,
    *,
    reason: str | None = None,
    rows_hit: int = 0,
    rows_missed: int = 0,
    row_reasons: Mapping[str, int] | None = None,
    rows_encoded: int = 0,
    whole_call: str | None = None,
    proven: int = 0,
    unproven: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Return what one call adds to its method's counters.

    ``call``: what the call came to (None: counted by another tally); ``reason``: why it bypassed;
    ``rows_*``: what its rows came to and how many reached the encoder; ``row_reasons``: its rows
    encoded without being cached, by reason; ``whole_call``: why a call with a row layout was not
    split into rows; ``proven``: calls or rows served after their encoder inputs were compared; ``unproven``:
    those encoded instead, by reason.
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
    if proven:
        counts["proven_hits"] = proven
    if unproven:
        counts["unproven_reasons"] = unproven
    return counts


#: What a call served from an entry adds (the hit path's tallies, made once): keyed whole, or as its one row.
WHOLE_HIT: Mapping[str, Any] = MappingProxyType(tally(Outcome.HIT))
ROW_HIT: Mapping[str, Any] = MappingProxyType(tally(Outcome.HIT, rows_hit=1))
#: The same, for a hit whose encoder inputs were compared with its entry's first.
PROVEN_WHOLE_HIT: Mapping[str, Any] = MappingProxyType(tally(Outcome.HIT, proven=1))
PROVEN_ROW_HIT: Mapping[str, Any] = MappingProxyType(tally(Outcome.HIT, rows_hit=1, proven=1))


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
