"""The cache as one object: upstream vLLM-Omni's ``PromptEmbedCache`` contract, and what RL needs.

:class:`PromptEmbedCache` keeps upstream's whole public contract (constructor, ``get`` / ``put``
with the :data:`MISS` sentinel, ``clear``, ``stats``, the ``hits`` / ``misses`` / ``bypassed``
counters) and composes what a cache shared by concurrent RL requests needs, each in its own module:

* :mod:`.entries`: the entries in device memory, an LRU within entry and byte budgets (values plus
  the witness bytes kept to verify keys); every hit is verified against its witness (:mod:`.call_key`);
* :mod:`.flights`: single-flight, so concurrent identical misses run the encoder once; if that run
  raises, its caller sees the error and nothing is cached;
* :mod:`.tier`: host memory and a shared directory below device memory, both optional. A device
  miss looks there before it encodes, inside the same flight; a hit there is a hit;
* :mod:`.lookups`: how a key is served (its entry, a flight, a lower tier, or an encode), under the ticket
  entries are made under now. A wrapped method's calls use it directly (:attr:`PromptEmbedCache.lookups`),
  whole or a batched call's rows as entries of their own (:mod:`.row_batches`), so that a hit makes one
  stop here, not two;
* :mod:`.counters` and :mod:`.stats`: counts for every outcome and bypass reason, by method, read
  as one :class:`~.stats.CacheStats` snapshot.

Every decision depends only on the order of calls, never on timing or on memory addresses, so
ranks that see the same calls take the same decisions.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, TypeVar

from vllm_omni_prompt_cache.counts.counters import (
    AUDIT_MISMATCHES,
    AUDITS,
    BYPASS_REASONS,
    ENCODE_PROMPT,
    HITS,
    LAYOUT_CHECK_ROWS,
    LAYOUT_CHECKS,
    LAYOUT_MISMATCHES,
    MISSES,
    WHOLE_HIT,
    Count,
    MethodCounters,
    Outcome,
    tally,
)
from vllm_omni_prompt_cache.counts.stats import CacheStats, kept_counts
from vllm_omni_prompt_cache.encoders.residency import EncoderMoves
from vllm_omni_prompt_cache.keys.call_key import CallKey
from vllm_omni_prompt_cache.store.audit import Audit
from vllm_omni_prompt_cache.store.entries import LRU
from vllm_omni_prompt_cache.store.flights import Flights
from vllm_omni_prompt_cache.store.lookups import COLLISION_REASON, REENTRANT_REASON, Lookups
from vllm_omni_prompt_cache.store.tiers.directory import DirectoryTier
from vllm_omni_prompt_cache.store.tiers.host import HOST_AT_SLEEP, HostTier
from vllm_omni_prompt_cache.store.tiers.tier import Keeps, Tiers

__all__ = [
    "COLLISION_REASON",
    "ENCODE_PROMPT",
    "MISS",
    "REENTRANT_REASON",
    "UNSPECIFIED_REASON",
    "CacheStats",
    "PromptEmbedCache",
]

T = TypeVar("T")

#: Bypass reason for bypasses counted by code that assigns ``cache.bypassed`` itself, as
#: upstream's wrapper does; it knows no reason.
UNSPECIFIED_REASON = "counted by the caller, no reason given"


class _Miss:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISS"


#: What :meth:`PromptEmbedCache.get` returns for an absent key, so that a cached ``None`` is a hit.
MISS: Any = _Miss()


class PromptEmbedCache:
    """Thread-safe LRU of encode results with entry and byte budgets, verified hits and single-flight.

    Values are returned as stored, not cloned: callers must treat them as read-only, exactly as
    with upstream vLLM-Omni's cache.
    """

    def __init__(
        self,
        max_size: int = 32,
        enabled: bool = True,
        *,
        max_bytes: int | None = None,
        verify: bool = True,
        host_bytes: int | str | None = None,
        directory: DirectoryTier | None = None,
    ) -> None:
        """``host_bytes``: the host-memory tier's byte budget (None: no host tier; ``"auto"``: the entries a
        level-1 sleep drops, within ``max_size`` and ``max_bytes``); ``directory``: the directory tier (None: none).
        The store alone keeps upstream's constructor (no tier unless asked); the installs that put it in a
        worker default to ``"auto"``, where sleeps happen."""
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"max_size must be an integer >= 1, got {max_size!r}")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes must be None or an integer >= 1, got {max_bytes!r}")
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.enabled = enabled
        self.verify = verify
        self._counters = MethodCounters()
        self.host = _host_tier(host_bytes, max_size, max_bytes)
        self.directory = directory
        #: The tiers below device memory, fastest first.
        self.tiers = Tiers([tier for tier in (self.host, self.directory) if tier is not None])
        #: How a key is served (entry, flight, lower tier or encode), and the ticket entries are made under now:
        #: what the wrapped methods' calls use directly, a hit's one stop in the store.
        self.lookups = Lookups(LRU(max_size, max_bytes), self.tiers, verify=verify, record=self.record)
        self._max_gap = 0.0
        # What others lend the store, through attach(); read on every call, hence plain attributes.
        #: What moves the text encoders between host and device, counted (None: nothing).
        self.moves: EncoderMoves | None = None
        #: What the wrapper says of each encode method: how it was found, what it is keyed on (stats()).
        self.encode_methods: Callable[[], dict[str, Any]] | None = None
        #: Which hits are encoded again and compared (see audit.py; None: none).
        self.audit: Audit | None = None
        #: Why ``enabled`` was turned off for good (see :meth:`turn_off`), for the bypass counts.
        self.off_reason: str | None = None

    @property
    def _lock(self) -> Any:
        """The lock upstream's wrapper takes to count (``with cache._lock: cache.bypassed += 1``), part of
        its contract: every count is added under it (re-entrant)."""
        return self._counters.lock

    @property
    def flights(self) -> Flights:
        """The misses being encoded now."""
        return self.lookups.flights

    # Upstream's counters are plain attributes that its wrapper assigns (``cache.bypassed += 1``
    # under ``cache._lock``): readable and assignable here too. They are every method's sums.
    @property
    def hits(self) -> int:
        """Calls served from the cache, every method's."""
        return self._counters.total(HITS)

    @hits.setter
    def hits(self, value: int) -> None:
        self._counters.assign(HITS, value)

    @property
    def misses(self) -> int:
        """Calls that ran the encoder and offered its result to the cache, every method's."""
        return self._counters.total(MISSES)

    @misses.setter
    def misses(self, value: int) -> None:
        self._counters.assign(MISSES, value)

    @property
    def bypassed(self) -> int:
        """Calls that did not use the cache, whatever the reason or method."""
        return sum(self._counters.total(BYPASS_REASONS).values())

    @bypassed.setter
    def bypassed(self, value: int) -> None:
        self._counters.assign(BYPASS_REASONS, value, reason=UNSPECIFIED_REASON)

    def __len__(self) -> int:
        return len(self.lookups.entries)

    def get(self, key: CallKey | Hashable) -> Any:
        """Return the value cached under ``key`` (refreshing its recency), or :data:`MISS`.

        Upstream's contract: a hit or a miss is counted. A :class:`CallKey` is verified against
        its witness; a collision is a miss (a later ``put`` replaces the entry). A device miss
        looks in the lower tiers, which hold only :class:`CallKey` entries.
        """
        found, value = self.lookups.get(key, ENCODE_PROMPT)
        self.record(ENCODE_PROMPT, WHOLE_HIT if found else tally(Outcome.MISS))
        return value if found else MISS

    def peek(self, key: CallKey, method: str = ENCODE_PROMPT) -> tuple[bool, Any]:
        """Return ``(True, value)`` for ``key``'s verified entry (device memory, else a lower tier), else
        ``(False, None)``; counted by the caller, not here (a proof's look-up of an entry kept beside another)."""
        return self.lookups.get(key, method)

    def put(self, key: CallKey | Hashable, value: Any) -> None:
        """Cache ``value`` under ``key`` as given (insert or overwrite), then evict over budget.

        Upstream's contract; a value larger than ``max_bytes`` is not kept.
        """
        self.lookups.put(key, value, ENCODE_PROMPT)

    def get_or_compute(self, key: CallKey, compute: Callable[[], T], *, method: str = ENCODE_PROMPT) -> T:
        """Return the cached value for ``key``, or run ``compute`` once and cache its result; count the
        call under ``method`` (the pipeline method whose call it is)."""
        counted: list[Outcome] = []

        def count(outcome: Outcome, reason: str | None) -> None:
            counted.append(outcome)
            self.record(method, tally(outcome, reason=reason))

        value = self.lookups.serve(key, compute, count, method)
        if not counted:  # served without computing: a hit
            self.record(method, WHOLE_HIT)
        return value

    def register(self, method: str) -> None:
        """List ``method`` in the stats from now on, at zero."""
        self._counters.register(method)

    def recorder(self, method: str) -> Callable[[Mapping[Count, Any]], None]:
        """Return the function that adds a :func:`~.counters.tally` to ``method``'s counters (what
        :meth:`record` does, bound once for a method's every call)."""
        return functools.partial(self._counters.add, method)

    def record(self, method: str, counts: Mapping[Count, Any]) -> None:
        """Add one call's :func:`~.counters.tally` to ``method``'s counters."""
        self._counters.add(method, counts)

    def record_audit(self, *, mismatch: bool, method: str = ENCODE_PROMPT) -> None:
        """Count a hit encoded again and compared with what was served (``mismatch``: they differed)."""
        self.record(method, {AUDITS: 1, AUDIT_MISMATCHES: int(mismatch)})

    def record_layout_check(self, rows: int, gap: float | None, *, method: str = ENCODE_PROMPT) -> None:
        """Count one layout check whose uncached call encoded ``rows``; ``gap``: what it measured, None: mismatch."""
        with self._counters.lock:
            self.record(method, {LAYOUT_CHECKS: 1, LAYOUT_CHECK_ROWS: rows, LAYOUT_MISMATCHES: int(gap is None)})
            if gap is not None:
                self._max_gap = max(self._max_gap, gap)

    def clear(self) -> None:
        """Drop every entry of every tier, and any result still being computed; counters are kept.

        For when entries are stale (new text-encoder weights): the host tier is emptied, and the
        directory tier fingerprints the weights again before its next use, so files of the old
        weights are never read. Callers already waiting on an encode get its result; callers
        arriving after the clear encode again.
        """
        self.lookups.clear()

    def release_device_memory(self) -> int:
        """Drop every entry from device memory (the worker goes to sleep); return how many there were.

        Entries still valid move to the host tier when there is one (oldest first, so the newest
        survive its budget); the directory tier already holds every encoded entry. Results still
        being computed are returned to their callers but not stored.
        """
        return self.lookups.release_device_memory()

    def turn_off(self, reason: str) -> None:
        """Bypass every later call, counted under ``reason``, for good (an audit found a wrong entry), and
        drop every entry."""
        self.off_reason = reason
        self.enabled = False
        self.clear()

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Bypass calls while the block runs (counted as the cache disabled), then switch back as it was."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def attach(
        self,
        *,
        moves: EncoderMoves | None = None,
        audit: Audit | None = None,
        encode_methods: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """Lend the store what others keep: the counted moves of the text encoders (the worker's), the audit
        of hits, and what the wrapper says of each encode method for ``stats()``. None keeps what it has."""
        if moves is not None:
            self.moves = moves
        if audit is not None:
            self.audit = audit
        if encode_methods is not None:
            self.encode_methods = encode_methods

    def snapshot(self) -> CacheStats:
        """Return the counters, sizes and settings now, as one :class:`CacheStats`."""
        moves = self.moves
        levels: dict[str, Any] = {}
        if moves is not None:  # outside the lock: a placement in progress holds the placement's lock
            levels.update(encoder_device_bytes=moves.device_bytes(), encoder_placer=moves.placer)
        with self._counters.lock:  # the largest gap is written with its check's counts, under this lock
            (counts, methods), max_gap = self._counters.read(), self._max_gap
        lookups = self.lookups
        with lookups.lock:
            return CacheStats(
                **levels,
                **self.tiers.levels(),
                **kept_counts({**self.tiers.counts(), **(moves.counts() if moves is not None else {})}),
                **counts,
                size=len(lookups.entries),
                max_size=self.max_size,
                bypassed=sum(counts[BYPASS_REASONS.name].values()),
                bytes=lookups.held_bytes(),
                max_bytes=self.max_bytes,
                enabled=self.enabled,
                verify=self.verify,
                layout_check_max_gap=max_gap,
                methods=methods,
            )

    def stats(self) -> dict[str, Any]:
        """Return upstream's keys (size, max_size, hits, misses, bypassed) and ours, as a dict; with
        ``encode_methods``: each wrapped method, how it was found and what its key holds."""
        stats = self.snapshot().as_dict()
        if self.encode_methods is not None:
            stats["encode_methods"] = self.encode_methods()
        return stats


def _host_tier(host_bytes: int | str | None, max_size: int, max_bytes: int | None) -> HostTier | None:
    """The host tier ``host_bytes`` asks for (see :class:`PromptEmbedCache`)."""
    if host_bytes is None:
        return None
    if host_bytes == HOST_AT_SLEEP:
        return HostTier(max_bytes, max_entries=max_size, keeps=Keeps.SLEEP_DEPARTURES)
    if isinstance(host_bytes, str):
        raise ValueError(f"host_bytes must be None, {HOST_AT_SLEEP!r} or an integer >= 1, got {host_bytes!r}")
    return HostTier(host_bytes)
