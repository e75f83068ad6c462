"""Where entries live in device memory: an LRU mapping within an entry budget and a byte budget.

A plain mapping: no lock (the store holds one), no counters, no tiers. What an insertion pushes
out is returned to the caller, which decides where it goes next (the host tier) and counts it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

from vllm_omni_prompt_cache.keys import witness_nbytes
from vllm_omni_prompt_cache.values import value_nbytes


class Entry(NamedTuple):
    """One cached value and what verifies it."""

    value: Any
    witness: tuple[bytes, ...] | None  # the key's bytes; None when verification is off
    nbytes: int  # the value's tensor bytes plus the witness bytes
    keyed: bool = True  # stored under a CallKey (not a plain key given to put()): lower tiers may hold it

    @classmethod
    def of(cls, value: Any, witness: tuple[bytes, ...] | None, *, keyed: bool = True) -> Entry:
        """Return the entry for ``value``, its size measured."""
        return cls(value, witness, value_nbytes(value) + (0 if witness is None else witness_nbytes(witness)), keyed)


#: What left the mapping, oldest first: (identity, entry) pairs.
Departures = list[tuple[Hashable, Entry]]


class Entries:
    """Entries by key identity, least recently used first, within ``max_size`` entries and ``max_bytes``
    bytes (None: no byte budget).

    ``get(identity)`` returns an entry (None: absent) and leaves its recency alone; ``refresh(identity)``
    makes it the most recently used (a verified hit).
    """

    def __init__(self, max_size: int, max_bytes: int | None) -> None:
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()
        # The hit path's two operations are the mapping's own (C) methods, not wrappers around them.
        self.get: Callable[[Hashable], Entry | None] = self._entries.get
        self.refresh: Callable[[Hashable], None] = self._entries.move_to_end

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, identity: Hashable, entry: Entry) -> tuple[Departures, bool]:
        """Insert or replace ``identity``'s entry, then evict the least recently used over the budgets.

        Returns what was evicted, oldest first, and whether ``entry`` itself was too large to keep
        (then it is the one departure, and any entry it replaced is gone too).
        """
        previous = self._entries.pop(identity, None)
        if previous is not None:
            self.bytes -= previous.nbytes
        if self.max_bytes is not None and entry.nbytes > self.max_bytes:
            return [(identity, entry)], True
        self._entries[identity] = entry
        self.bytes += entry.nbytes
        evicted: Departures = []
        while len(self._entries) > self.max_size or (self.max_bytes is not None and self.bytes > self.max_bytes):
            oldest = self._entries.popitem(last=False)
            self.bytes -= oldest[1].nbytes
            evicted.append(oldest)
        return evicted, False

    def pop(self, identity: Hashable) -> Entry | None:
        """Remove ``identity``'s entry and return it (None: absent)."""
        entry = self._entries.pop(identity, None)
        if entry is not None:
            self.bytes -= entry.nbytes
        return entry

    def drain(self) -> Departures:
        """Remove every entry; return them, oldest first."""
        drained = list(self._entries.items())
        self._entries.clear()
        self.bytes = 0
        return drained
