"""What a cache counts, each count a named object declared once, and the one function that turns what a call
came to into counts.

Every count is a :class:`Count` of this module (``HITS``, ``DIR_MISSES``...), added to :data:`COUNTS` by
:func:`register` where it is declared here. Code that counts names the object, never a string: a call's counts are
a mapping ``{Count: amount}`` made by :func:`tally` (or written out, for a count that ``tally`` does not make), and
the keepers of the other counts report theirs the same way through ``counts()``. What shows counts enumerates
:data:`COUNTS`: :class:`Counters` below (a value for each count calls make), :class:`~.stats.CacheStats` (the
snapshot, ``stats()``: a field for each) and ``vllm_omni/metrics.py`` (a Prometheus family for each), made from the
table when their module is imported. So a new count is one line here, plus the code that makes it happen.

Every count a call makes belongs to the pipeline method whose call made it, and is added under one lock when the
call ends (or raises). The tiers below device memory and the encoder moves keep their own counts (see
:class:`Keeper`), which a snapshot reads through their ``counts()``.
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


class Keeper(enum.Enum):
    """Who keeps a count: each method's :class:`Counters` (the counts calls make), or the object below device
    memory whose ``counts()`` reports it."""

    CALLS = "each method's Counters, added to by the calls' tallies"
    HOST = "the host-memory tier (host_tier.HostTier)"
    DIRECTORY = "the directory tier (directory_tier.DirectoryTier)"
    MOVES = "the text encoders' moves (residency.EncoderMoves)"


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class Count:
    """One counter: its snapshot field, who keeps it, and the Prometheus family it advances. Compared and hashed
    by identity: each is one object of this module.

    The family is ``vllm_omni:prompt_embed_cache_<family>_total`` with labels ``model_name``, ``stage``,
    ``replica``, then the names of ``labels`` (fixed values, for a family several counts share), then
    ``reason`` for a count by reason. ``by_method``: the family (name, help) that counts it by method
    too (label ``method`` after the replica's).
    """

    name: str  # its field in the snapshot (and its key in each method's counts there)
    help: str | None  # the family's help text; None: no family (stats() only)
    kept_by: Keeper = Keeper.CALLS
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

    def zero(self) -> Any:
        """Return its value before anything is counted: 0, or an empty Counter for a count by reason."""
        return Counter() if self.by_reason else 0


#: Every counter, in the order they are declared below (each keeper's together, as the snapshot shows them).
#: Integers are event counts since the cache was made (``clear()`` keeps them); counts by reason are
#: Counters (mappings in a snapshot). The help texts are the ``/metrics`` page's.
COUNTS: tuple[Count, ...] = ()
#: Set once the table is read (:data:`CALL_COUNTS`...): a count registered later would have no field nor family.
_table_made = False


def register(count: Count) -> Count:
    """Add ``count`` to :data:`COUNTS` and return it; for this module's declarations, made before what is made
    from the table (a later one raises)."""
    global COUNTS
    if _table_made:
        raise RuntimeError(f"count {count.name} registered after the table was read: declare it in counters.py")
    if any(each.name == count.name for each in COUNTS):
        raise ValueError(f"a count named {count.name} is registered already")
    COUNTS = (*COUNTS, count)
    return count


#: The family the exactness checks share, each check a series of its own (label ``check``), and its help.
VERIFICATION_FAILURES = "verification_failures"
VERIFICATION_FAILURES_HELP = (
    "Exactness checks that failed: a key whose stored bytes differed (check=key, the call is encoded), "
    "a row layout whose rows differed from the uncached call (check=row_layout, rows turned off), "
    "or a hit whose fresh encode differed (check=audit, the cache turned off for the class)."
)

# Calls, by the method that made them.
HITS = register(
    Count(
        "hits",
        "encode_prompt calls served from the cache, without encoding.",
        by_method=("method_hits", "Calls of one cached method served without encoding."),
    )
)
MISSES = register(  # calls that ran the encoder and offered the result to the cache
    Count(
        "misses",
        "encode_prompt calls that ran the text encoder and offered the result.",
        by_method=("method_misses", "Calls of one cached method that ran the encoder."),
    )
)
BYPASS_REASONS = register(  # calls not using the cache
    Count(
        "bypass_reasons",
        "encode_prompt calls that did not use the cache, by reason (bounded set).",
        by_reason=True,
        family="bypassed",
        by_method=("method_bypassed", "Calls of one cached method that did not use the cache, by reason."),
    )
)
EVICTIONS = register(Count("evictions", "Entries evicted to stay within the entry or byte budget."))
OVERSIZE_REJECTIONS = register(Count("oversize_rejections", "Results larger than the byte budget, not stored."))
# Rows of batched calls (pipelines with a row layout): each row is an entry of its own.
# row_hits: served without this call encoding them (cache, another call's encode, a duplicate);
# row_misses: encoded and offered to the store (kept unless a clear() or a budget intervened).
ROW_HITS = register(Count("row_hits", "Rows of batched calls served without encoding them."))
ROW_MISSES = register(
    Count("row_misses", "Rows of batched calls encoded and offered to the cache (kept unless over a budget).")
)
ROW_BYPASS_REASONS = register(
    Count(
        "row_bypass_reasons",
        "Rows of batched calls encoded without caching, by reason.",
        by_reason=True,
        family="row_bypassed",
    )
)
ROWS_ENCODED = register(  # rows that reached the encoder to be served: row misses and bypasses, whole calls
    Count(
        "rows_encoded",
        "Prompt rows that reached the text encoder (misses and bypasses).",
        by_method=("method_rows_encoded", "Prompt rows one cached method sent to the text encoder."),
    )
)
WHOLE_CALL_REASONS = register(
    Count(
        "whole_call_reasons",
        "Batched calls cached as one entry instead of row by row, by reason.",
        by_reason=True,
        family="whole_calls",
    )
)
KEY_ONLY_HITS = register(
    Count(
        "key_only_hits",
        "Calls served from the cache on their arguments alone: their encode reaches no text encoder the cache "
        "recognises, so it is cached whole (upstream's behaviour).",
    )
)
CHANGED_ENTRIES = register(
    Count(
        "changed_entries",
        "Entries found changed in place since they were stored (a caller wrote into a served tensor): dropped.",
    )
)
# First-use checks of a row layout against the uncached call (see method_calls.py).
LAYOUT_CHECKS = register(Count("layout_checks", None))  # calls served uncached and compared with their rows
LAYOUT_CHECK_ROWS = register(Count("layout_check_rows", None))  # rows those uncached calls sent to the encoder
LAYOUT_MISMATCHES = register(
    Count(
        "layout_mismatches", VERIFICATION_FAILURES_HELP, family=VERIFICATION_FAILURES, labels=(("check", "row_layout"),)
    )
)
# Audits: hits encoded again and compared with what was served (see audit.py).
AUDITS = register(Count("audits", "Hits encoded again and compared with what was served (check=audit fails)."))
AUDIT_MISMATCHES = register(
    Count("audit_mismatches", VERIFICATION_FAILURES_HELP, family=VERIFICATION_FAILURES, labels=(("check", "audit"),))
)
# The host-memory tier's.
HOST_HITS = register(Count("host_hits", "Device-memory misses served from the host-memory tier.", Keeper.HOST))
HOST_MISSES = register(Count("host_misses", "Device-memory misses the host-memory tier did not hold.", Keeper.HOST))
HOST_DEMOTIONS = register(
    Count(
        "host_demotions",
        "Entries moved from device memory to the host-memory tier (evicted, or at sleep).",
        Keeper.HOST,
    )
)
HOST_EVICTIONS = register(
    Count("host_evictions", "Entries dropped from the host-memory tier by its budget.", Keeper.HOST)
)
# The directory tier's.
DIR_HITS = register(Count("dir_hits", "Misses in memory served from a file of the directory tier.", Keeper.DIRECTORY))
DIR_MISSES = register(
    Count("dir_misses", "Misses in memory the directory tier had no usable file for.", Keeper.DIRECTORY)
)
DIR_WRITES = register(Count("dir_writes", "Encoded entries written to the directory tier.", Keeper.DIRECTORY))
DIR_WRITE_ERRORS = register(
    Count(
        "dir_write_errors",
        "Writes to the directory tier that failed (a full disk...); the entry stays in memory.",
        Keeper.DIRECTORY,
    )
)
DIR_EVICTIONS = register(
    Count("dir_evictions", "Files removed from the directory tier to stay within its budget.", Keeper.DIRECTORY)
)
DIR_REJECTIONS = register(
    Count(
        "dir_rejections",
        "Files of the directory tier removed on read, by reason: truncated, corrupt, another namespace, "
        "other key bytes. Each is a miss, never an error or a wrong embedding.",
        Keeper.DIRECTORY,
        by_reason=True,
    )
)
DIR_WAITS = register(
    Count(
        "dir_waits",
        "Misses served by waiting for another process's encode of the same entry (then a hit).",
        Keeper.DIRECTORY,
    )
)
DIR_STALE_CLAIMS = register(
    Count(
        "dir_stale_claims",
        "Claims on directory entries taken over: their process was gone, or silent for the claim wait.",
        Keeper.DIRECTORY,
    )
)
DIR_WAIT_TIMEOUTS = register(
    Count(
        "dir_wait_timeouts",
        "Waits for another process's encode that ended without its file (then encoded here).",
        Keeper.DIRECTORY,
    )
)
DIR_LEFTOVERS_REMOVED = register(
    Count(
        "dir_leftovers_removed",
        "Temporary and claim files of crashed processes removed from the directory tier.",
        Keeper.DIRECTORY,
    )
)
# Moves of the text encoders (and the DiTs they swap with) between host and device, whoever made
# them: vLLM-Omni's module offload, or this package's placement on a miss (see residency.py).
ENCODER_PLACEMENTS = register(
    Count(
        "encoder_placements",
        "Text-encoder moves onto the device (vLLM-Omni's module offload, or this cache's placement on a miss).",
        Keeper.MOVES,
    )
)
ENCODER_EVICTIONS = register(Count("encoder_evictions", "Text-encoder moves off the device.", Keeper.MOVES))
DIT_PLACEMENTS = register(
    Count(
        "dit_placements",
        "DiT moves back onto the device that vLLM-Omni's module offload made after an encode.",
        Keeper.MOVES,
    )
)
DIT_EVICTIONS = register(
    Count("dit_evictions", "DiT moves to the host that vLLM-Omni's module offload made for an encode.", Keeper.MOVES)
)
BYTES_MOVED = register(Count("bytes_moved", "Bytes those moves copied between host and device.", Keeper.MOVES))
PLACEMENTS_AVOIDED = register(
    Count("placements_avoided", "Text-encoder placements that calls served from the cache did not make.", Keeper.MOVES)
)
BYTES_NOT_MOVED = register(
    Count(
        "bytes_not_moved",
        "Bytes those avoided placements, and the DiT swaps they bring, would have copied.",
        Keeper.MOVES,
    )
)


class Outcome(enum.Enum):
    """What one call (or one row) came to."""

    HIT = "served without encoding"
    MISS = "encoded, and offered to the cache"
    BYPASS = "encoded without the cache"


#: The counts calls make, kept per method: the values of :class:`Counters`.
CALL_COUNTS = tuple(count for count in COUNTS if count.kept_by is Keeper.CALLS)
#: What the other keepers keep, by keeper: each reports these through its ``counts()``.
KEPT_COUNTS = {keeper: tuple(count for count in COUNTS if count.kept_by is keeper) for keeper in Keeper}
#: The names of the counts calls make: what snapshots show for each method.
METHOD_COUNTER_FIELDS = tuple(count.name for count in CALL_COUNTS)
_table_made = True  # the table is read: no count is registered from here on


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


class Counters:
    """Every count a cache keeps for one method: a value for each :data:`CALL_COUNTS` entry, by count (the
    snapshot reads them in the table's order).

    Integers are event counts since the cache was made (``clear()`` keeps them); Counters count
    events by reason. :class:`~.stats.CacheStats` has a field of each count's name.
    """

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: dict[Count, Any] = {count: count.zero() for count in CALL_COUNTS}

    def add(self, counts: Mapping[Count, Any]) -> None:
        """Add ``counts`` (a count to a number, or to counts by reason), as :func:`tally` makes them."""
        values = self.values
        for count, value in counts.items():
            if type(value) is int:
                values[count] += value
            else:  # counts by reason
                values[count].update(value)


def tally(
    call: Outcome | None = None,
    *,
    reason: str | None = None,
    rows_hit: int = 0,
    rows_missed: int = 0,
    row_reasons: Mapping[str, int] | None = None,
    rows_encoded: int = 0,
    whole_call: str | None = None,
    key_only: int = 0,
) -> dict[Count, Any]:
    """Return what one call adds to its method's counters.

    ``call``: what the call came to (None: counted by another tally); ``reason``: why it bypassed;
    ``rows_*``: what its rows came to and how many reached the encoder; ``row_reasons``: its rows
    encoded without being cached, by reason; ``whole_call``: why a call with a row layout was not
    split into rows.
    """
    counts: dict[Count, Any] = {}
    if call is Outcome.HIT:
        counts[HITS] = 1
    elif call is Outcome.MISS:
        counts[MISSES] = 1
    elif call is Outcome.BYPASS:
        counts[BYPASS_REASONS] = {reason: 1}
    if rows_hit:
        counts[ROW_HITS] = rows_hit
    if rows_missed:
        counts[ROW_MISSES] = rows_missed
    if row_reasons:
        counts[ROW_BYPASS_REASONS] = row_reasons
    if rows_encoded:
        counts[ROWS_ENCODED] = rows_encoded
    if whole_call is not None:
        counts[WHOLE_CALL_REASONS] = {whole_call: 1}
    if key_only:
        counts[KEY_ONLY_HITS] = key_only
    return counts


#: What a call served from an entry adds (the hit path's tallies, made once): keyed whole, or as its one row.
WHOLE_HIT: Mapping[Count, Any] = MappingProxyType(tally(Outcome.HIT))
ROW_HIT: Mapping[Count, Any] = MappingProxyType(tally(Outcome.HIT, rows_hit=1))


def ranked_reasons(reasons: Counter[str]) -> dict[str, int]:
    """Return the non-zero counts, most common first (the order every snapshot shows reasons in)."""
    return {reason: count for reason, count in reasons.most_common() if count}


def zero_counts(keeper: Keeper) -> dict[Count, Any]:
    """Return each count ``keeper`` keeps at zero: what a tier or the moves count into."""
    return {count: count.zero() for count in KEPT_COUNTS[keeper]}


def read_counts(counts: Mapping[Count, Any]) -> dict[Count, Any]:
    """Return ``counts`` as a snapshot shows them: integers as they are, counts by reason as plain dicts (most
    common first). The caller holds the lock they are counted under."""
    return {count: ranked_reasons(value) if isinstance(value, Counter) else value for count, value in counts.items()}


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

    def add(self, method: str, counts: Mapping[Count, Any]) -> None:
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

    def total(self, count: Count) -> Any:
        """Return the sum of one count over every method (a Counter for a count by reason)."""
        with self.lock:
            values = [counts.values[count] for counts in self._by_method.values()]
        return sum(values, Counter()) if count.by_reason else sum(values)

    def assign(self, count: Count, total: int, *, reason: str = "") -> None:
        """Make the sum of ``count`` ``total``, as upstream's code assigns ``cache.hits``: 0 resets every
        method's; another value moves encode_prompt's share (under ``reason`` for a count by reason)."""
        with self.lock:
            now = self.total(count)
            default = self._by_method[ENCODE_PROMPT].values
            if total == 0:
                for counts in self._by_method.values():
                    counts.values[count] = count.zero()
            elif count.by_reason:
                default[count][reason] += total - sum(now.values())
            else:
                default[count] += total - now

    def read(self) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """Return every count summed over methods, and each method's, by field name, read at one moment; counts
        by reason are plain dicts, most common first."""
        with self.lock:
            methods = {method: _by_name(counts.values) for method, counts in self._by_method.items()}
            totals = _by_name({count: self.total(count) for count in CALL_COUNTS})
        return totals, methods


def _by_name(counts: Mapping[Count, Any]) -> dict[str, Any]:
    """Return ``counts`` read as a snapshot shows them (see :func:`read_counts`), by their fields' names."""
    return {count.name: value for count, value in read_counts(counts).items()}
