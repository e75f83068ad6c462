"""Where entries live in memory: an LRU mapping within an entry budget and a byte budget.

A plain mapping (cachetools' ``Cache`` shape: a size function makes a byte budget): no lock (its
owner holds one), no counters, no tiers. What an insertion pushes out is returned to the caller,
which decides where it goes next and counts it. Device memory and the host tier both keep their
entries in one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, NamedTuple, TypeVar

from vllm_omni_prompt_cache.keys.call_key import witness_nbytes
from vllm_omni_prompt_cache.store.shared_heads import SharedHeads, head_nbytes
from vllm_omni_prompt_cache.store.values import owned_by_cache, tensor_versions, value_nbytes

V = TypeVar("V")


class Entry(NamedTuple):
    """One cached value and what verifies it."""

    value: Any
    witness: tuple[bytes, ...] | None  # the key's bytes; None when verification is off
    nbytes: int  # the value's tensor bytes plus the witness bytes (a shared head's in full: what the budgets count)
    keyed: bool = True  # stored under a CallKey (not a plain key given to put()): lower tiers may hold it
    #: each tensor of the value with its version counter when stored: a caller that writes into a served
    #: tensor (``embeds.mul_(2)``) changes the entry, which is then dropped instead of served
    versions: tuple = ()
    shared: int = 0  #: the bytes of the shared heads the value is joined to (kept once for all entries joined to them)

    @classmethod
    def of(
        cls, value: Any, witness: tuple[bytes, ...] | None, *, keyed: bool = True, heads: SharedHeads | None = None
    ) -> Entry:
        """Return the entry for ``value`` (inference-mode tensors copied, so that writes to them are seen; leading
        positions equal to a head of ``heads`` shared), its size measured and its tensors' versions noted."""
        value = owned_by_cache(value)
        if heads is not None:
            value = heads.share(value)
        nbytes = value_nbytes(value) + (0 if witness is None else witness_nbytes(witness))
        return cls(value, witness, nbytes, keyed, tensor_versions(value), head_nbytes(value))


#: What left a mapping, oldest first: (identity, entry) pairs.
Departures = list[tuple[Hashable, Entry]]


def _nbytes(value: Any) -> int:
    return value.nbytes


class LRU(Generic[V]):
    """Values by key identity, least recently used first, within ``max_entries`` values and ``max_bytes``
    bytes (None: no such budget); ``sizeof(value)`` says what a value weighs (by default its ``nbytes``).

    ``get(identity)`` returns a value (None: absent) and leaves its recency alone; ``refresh(identity)``
    makes it the most recently used (a verified hit).
    """

    def __init__(self, max_entries: int | None, max_bytes: int | None, sizeof: Callable[[V], int] = _nbytes) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._sizeof = sizeof
        self._values: OrderedDict[Hashable, V] = OrderedDict()
        # The hit path's two operations are the mapping's own (C) methods, not wrappers around them.
        self.get: Callable[[Hashable], V | None] = self._values.get
        self.refresh: Callable[[Hashable], None] = self._values.move_to_end

    def __len__(self) -> int:
        return len(self._values)

    def values(self) -> list[V]:
        """Return the values held now, least recently used first."""
        return list(self._values.values())

    def put(self, identity: Hashable, value: V) -> tuple[list[tuple[Hashable, V]], bool]:
        """Insert or replace ``identity``'s value, then evict the least recently used over the budgets.

        Returns what was evicted, oldest first, and whether ``value`` itself was too large to keep
        (then it is the one departure, and any value it replaced is gone too).
        """
        self.pop(identity)
        nbytes = self._sizeof(value)
        if self.max_bytes is not None and nbytes > self.max_bytes:
            return [(identity, value)], True
        self._values[identity] = value
        self.bytes += nbytes
        evicted: list[tuple[Hashable, V]] = []
        while self._over_budget():
            oldest = self._values.popitem(last=False)
            self.bytes -= self._sizeof(oldest[1])
            evicted.append(oldest)
        return evicted, False

    def _over_budget(self) -> bool:
        return (self.max_entries is not None and len(self._values) > self.max_entries) or (
            self.max_bytes is not None and self.bytes > self.max_bytes
        )

    def pop(self, identity: Hashable) -> V | None:
        """Remove ``identity``'s value and return it (None: absent)."""
        value = self._values.pop(identity, None)
        if value is not None:
            self.bytes -= self._sizeof(value)
        return value

    def drain(self) -> list[tuple[Hashable, V]]:
        """Remove every value; return them with their identities, oldest first."""
        drained = list(self._values.items())
        self._values.clear()
        self.bytes = 0
        return drained
