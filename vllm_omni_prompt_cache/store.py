"""Where cached embeddings live: an LRU with entry and byte budgets.

:class:`PromptEmbedCache` keeps upstream vLLM-Omni's name, constructor and
``clear()`` / ``stats()`` contract, and adds what a cache shared by concurrent
RL requests needs:

* a byte budget (``max_bytes``) counting the tensors held in values plus the
  witness bytes kept to verify keys;
* exact verification of every hit against the witness (see :mod:`.keys`);
* single-flight: concurrent identical misses run the encoder once; if that run
  raises, its caller sees the error and nothing is cached;
* statistics with a count for every bypass reason.

Every decision depends only on the order of calls, never on timing or on
memory addresses, so ranks that see the same calls take the same decisions.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, TypeVar

import torch

from vllm_omni_prompt_cache.keys import CallKey, freeze_witness, witness_matches, witness_nbytes

T = TypeVar("T")

#: Bypass reason recorded when a key's identity matches but its witness bytes differ.
COLLISION_REASON = "digest collision: identity matched, bytes differed"
#: Bypass reason for a call the encoder makes into the same key while computing it.
REENTRANT_REASON = "re-entrant call for a key being computed by the same thread"


class CacheInfo(NamedTuple):
    """Counters of a :class:`PromptEmbedCache`, in the spirit of ``functools.lru_cache``."""

    hits: int
    misses: int
    bypassed: int
    evictions: int
    size: int
    max_size: int
    bytes: int
    max_bytes: int | None


class _Entry(NamedTuple):
    value: Any
    witness: tuple[bytes, ...] | None  # None when verification is off
    nbytes: int


class _Flight:
    """A miss being computed; waiters take its value or, if it failed, try again."""

    __slots__ = ("done", "failed", "generation", "owner", "value", "witness")

    def __init__(self, witness: tuple[bytes, ...] | None, generation: int) -> None:
        self.done = threading.Event()
        self.owner = threading.get_ident()
        self.value: Any = None
        self.failed = False
        self.witness = witness
        self.generation = generation  # the cache's clear() count when the encode started


def detach_value(value: Any) -> Any:
    """Return ``value`` with every tensor detached from autograd (containers rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        detached = [detach_value(item) for item in value]
        return type(value)(*detached) if hasattr(value, "_fields") else type(value)(detached)
    if isinstance(value, list):
        return [detach_value(item) for item in value]
    if isinstance(value, dict):
        return {key: detach_value(item) for key, item in value.items()}
    return value


def value_nbytes(value: Any) -> int:
    """Return the bytes of tensor storage that keeping ``value`` holds alive (shared storage once)."""
    seen: dict[tuple[str, int], int] = {}

    def visit(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            seen[(str(item.device), storage.data_ptr())] = storage.nbytes()
        elif isinstance(item, (tuple, list)):
            for element in item:
                visit(element)
        elif isinstance(item, dict):
            for element in item.values():
                visit(element)

    visit(value)
    return sum(seen.values())


class PromptEmbedCache:
    """Thread-safe LRU of ``encode_prompt`` results with entry and byte budgets.

    Values are returned as stored, not cloned: callers must treat them as
    read-only, exactly as with upstream vLLM-Omni's cache.
    """

    def __init__(
        self,
        max_size: int = 32,
        enabled: bool = True,
        *,
        max_bytes: int | None = None,
        verify: bool = True,
    ) -> None:
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"max_size must be an integer >= 1, got {max_size!r}")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes must be None or an integer >= 1, got {max_bytes!r}")
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.enabled = enabled
        self.verify = verify
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._flights: dict[Hashable, _Flight] = {}
        self._lock = threading.Lock()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._oversize = 0
        self._bypass_reasons: Counter[str] = Counter()
        self._generation = 0  # bumped by clear(): results computed before it are not stored

    # Upstream exposes these counters as attributes; keep them readable.
    @property
    def hits(self) -> int:
        return self._hits

    @property
    def misses(self) -> int:
        return self._misses

    @property
    def bypassed(self) -> int:
        return sum(self._bypass_reasons.values())

    def __len__(self) -> int:
        return len(self._entries)

    def get_or_compute(self, key: CallKey, compute: Callable[[], T]) -> T:
        """Return the cached value for ``key``, or run ``compute`` once and cache its result."""
        while True:
            with self._lock:
                entry = self._entries.get(key.identity)
                if entry is not None:
                    if entry.witness is None or witness_matches(entry.witness, key.witness):
                        self._entries.move_to_end(key.identity)
                        self._hits += 1
                        return entry.value
                    self._bypass_reasons[COLLISION_REASON] += 1
                    flight = None
                    owner = False
                else:
                    flight = self._flights.get(key.identity)
                    owner = flight is None
                    if owner:
                        witness = freeze_witness(key.witness) if self.verify else None
                        flight = self._flights[key.identity] = _Flight(witness, self._generation)
                        self._misses += 1
                    elif flight.owner == threading.get_ident():
                        self._bypass_reasons[REENTRANT_REASON] += 1
                        flight = None
                    elif flight.witness is not None and not witness_matches(flight.witness, key.witness):
                        self._bypass_reasons[COLLISION_REASON] += 1
                        flight = None
            if flight is None:
                return compute()
            if owner:
                return self._run_flight(key, flight, compute)
            flight.done.wait()
            if not flight.failed:
                with self._lock:
                    self._hits += 1
                return flight.value
            # The owner's encode raised and its caller got the error; try again ourselves.

    def _run_flight(self, key: CallKey, flight: _Flight, compute: Callable[[], T]) -> T:
        try:
            result = compute()
        except BaseException:
            with self._lock:
                flight.failed = True
                del self._flights[key.identity]
            flight.done.set()
            raise
        value = detach_value(result)
        nbytes = value_nbytes(value) + (0 if flight.witness is None else witness_nbytes(flight.witness))
        with self._lock:
            flight.value = value
            del self._flights[key.identity]
            if flight.generation != self._generation:
                pass  # cleared while encoding (weights may have changed): return it, keep nothing
            elif self.max_bytes is not None and nbytes > self.max_bytes:
                self._oversize += 1
            else:
                self._entries[key.identity] = _Entry(value, flight.witness, nbytes)
                self._bytes += nbytes
                self._evict_over_budget()
        flight.done.set()
        return result

    def _evict_over_budget(self) -> None:
        while len(self._entries) > self.max_size or (self.max_bytes is not None and self._bytes > self.max_bytes):
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
            self._evictions += 1

    def record_bypass(self, reason: str) -> None:
        """Count one call that did not use the cache, under ``reason``."""
        with self._lock:
            self._bypass_reasons[reason] += 1

    def clear(self) -> None:
        """Drop every entry, and any result still being computed; counters are kept."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            self._generation += 1

    def info(self) -> CacheInfo:
        """Return the main counters as a named tuple."""
        with self._lock:
            return CacheInfo(
                self._hits,
                self._misses,
                sum(self._bypass_reasons.values()),
                self._evictions,
                len(self._entries),
                self.max_size,
                self._bytes,
                self.max_bytes,
            )

    def stats(self) -> dict[str, Any]:
        """Return upstream's keys (size, max_size, hits, misses, bypassed) and ours."""
        with self._lock:
            bypassed = sum(self._bypass_reasons.values())
            calls = self._hits + self._misses + bypassed
            return {
                "size": len(self._entries),
                "max_size": self.max_size,
                "hits": self._hits,
                "misses": self._misses,
                "bypassed": bypassed,
                "bypass_reasons": dict(self._bypass_reasons.most_common()),
                "evictions": self._evictions,
                "oversize_rejections": self._oversize,
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
                "hit_rate": self._hits / calls if calls else 0.0,
                "enabled": self.enabled,
                "verify": self.verify,
            }
