"""The tiers below device memory: an ordered list of backends behind one small interface.

The shape is LMCache's storage manager: a device miss walks the tiers, fastest first, and the first
hit wins; the store then keeps the value in device memory again (the write-back to the faster tier).
Each tier implements :class:`Tier` and says which entries it keeps (:class:`Keeps`): host memory
keeps the entries that leave device memory (and gives one up when a miss takes it back: each entry
lives in one in-memory tier at a time); a shared directory keeps every encoded entry, written
through. A lookup made for an encode may take a tier's claim on the entry (the directory's makes
other processes wait for its file instead of encoding it too); :meth:`Tiers.write` or
:meth:`Tiers.release` ends it. Nothing here raises into the store: a tier that fails is a miss.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple, Protocol

from vllm_omni_prompt_cache.counts.counters import Count
from vllm_omni_prompt_cache.keys.call_key import CallKey, freeze_witness
from vllm_omni_prompt_cache.logs import warn_once
from vllm_omni_prompt_cache.store.entries import Departures, Entry
from vllm_omni_prompt_cache.store.flights import Ticket


class Keeps(enum.Enum):
    """Which entries a tier keeps."""

    DEPARTURES = "entries leaving device memory (evicted by its budgets, or dropped at sleep)"
    SLEEP_DEPARTURES = "entries device memory dropped when the worker went to sleep (level 1)"
    ENCODES = "every encoded entry, written through"


class Stamp(NamedTuple):
    """When an entry was made: the store's ticket then (a ``clear()`` since makes it stale) and the
    epoch of the tier that keeps encodes (a change of weights since moves it)."""

    ticket: Ticket
    epoch: int


class Tier(Protocol):
    """What every tier below device memory implements. Only :meth:`get` may raise (the lookup is then a
    miss); an entry a tier cannot keep is dropped. Counts stay on the tier, which reports them through
    :meth:`counts` for the store's snapshot."""

    keeps: Keeps
    #: What voids a result being encoded: only the tier that keeps encodes moves it, when weights change.
    epoch: int

    def get(self, key: CallKey, *, claim: bool = False, epoch: int | None = None) -> tuple[bool, Any]:
        """Return ``(True, value)`` for ``key``, the value on the devices it was encoded on, else
        ``(False, None)``. ``claim``: the caller encodes on a miss, under the tiers' ``epoch`` then."""
        ...

    def put(self, identity: Hashable, entry: Entry, stamp: Stamp) -> None:
        """Keep ``entry`` under ``identity`` unless ``stamp`` is stale; end any claim on it."""
        ...

    def release(self, identity: Hashable, epoch: int) -> None:
        """End the claim a :meth:`get` took for an encode, begun at ``epoch``, that is not :meth:`put`."""
        ...

    def clear(self) -> None:
        """Forget every entry: they are stale (new text-encoder weights)."""
        ...

    def levels(self) -> dict[str, Any]:
        """Return the tier's sizes and budgets now, as :class:`~.stats.CacheStats` fields."""
        ...

    def counts(self) -> dict[Count, Any]:
        """Return the counts the tier keeps (those of its :class:`~.counters.Keeper`) since it was made, read at
        one moment (see :func:`~.counters.read_counts`)."""
        ...


class Tiers:
    """The tiers below device memory, fastest first (none: every method does nothing)."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self.tiers = tuple(tiers)
        self._victims = tuple(tier for tier in self.tiers if tier.keeps is Keeps.DEPARTURES)
        self._sleepers = tuple(tier for tier in self.tiers if tier.keeps in (Keeps.DEPARTURES, Keeps.SLEEP_DEPARTURES))
        self._write_through = tuple(tier for tier in self.tiers if tier.keeps is Keeps.ENCODES)
        if len(self._write_through) > 1:  # the one whose epoch a flight carries
            raise ValueError("at most one tier keeps every encoded entry")

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def epoch(self) -> int:
        """Return the epoch now of the tier that keeps encodes (it moves when the weights change): what a
        flight writes for (0 without such a tier)."""
        return self._write_through[0].epoch if self._write_through else 0

    def get(self, key: CallKey, *, claim: bool, epoch: int | None = None) -> tuple[bool, Any]:
        """Return ``(True, value)`` from the first tier holding ``key``, else ``(False, None)``.

        ``claim``: the caller encodes on a miss, under the ``epoch`` it began at; until it writes or
        releases, other processes missing the entry wait for its file.
        """
        try:
            for tier in self.tiers:
                found, value = tier.get(key, claim=claim, epoch=epoch)
                if found:
                    return True, value
        except Exception as error:  # e.g. no device memory left to copy into: encode instead
            warn_once(f"a lower tier failed a lookup ({type(error).__qualname__}: {error}); encoding instead")
        return False, None

    def write(self, key: CallKey, entry: Entry, stamp: Stamp) -> None:
        """Write an encoded entry through (ending its claim). Files carry the key's bytes whatever
        ``verify``: a process reading them may verify."""
        if entry.witness is None:
            entry = entry._replace(witness=freeze_witness(key.witness))
        for tier in self._write_through:
            tier.put(key.identity, entry, stamp)

    def release(self, key: CallKey, epoch: int) -> None:
        """End the claim a lookup took for an encode that is not written (it raised, or a clear() voided it)."""
        for tier in self.tiers:
            tier.release(key.identity, epoch)

    def demote(self, departures: Departures, stamp: Stamp, *, at_sleep: bool = False) -> None:
        """Move entries that left device memory, under ``stamp``, to the tier that keeps them (if any);
        ``at_sleep``: device memory dropped them as the worker went to sleep (not a budget's eviction)."""
        for tier in self._sleepers if at_sleep else self._victims:
            for identity, entry in departures:
                if entry.keyed:  # lower tiers are looked up by CallKey only
                    tier.put(identity, entry, stamp)

    def clear(self) -> None:
        """Forget every tier's entries: host memory empties, the directory fingerprints the weights again."""
        for tier in self.tiers:
            tier.clear()

    def levels(self) -> dict[str, Any]:
        """Return the tiers' sizes and budgets now, as :class:`~.stats.CacheStats` fields."""
        levels: dict[str, Any] = {}
        for tier in self.tiers:
            levels.update(tier.levels())
        return levels

    def counts(self) -> dict[Count, Any]:
        """Return every tier's counts (a tier that is off reports none)."""
        counts: dict[Count, Any] = {}
        for tier in self.tiers:
            counts.update(tier.counts())
        return counts
