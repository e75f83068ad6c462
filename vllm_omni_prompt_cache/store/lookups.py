"""How one key is served: its entry in device memory, a flight in progress, a lower tier, or an encode.

Follow a miss here: :meth:`Lookups.claim` finds no entry and begins a flight; :meth:`Lookups.complete`
looks in the lower tiers (:mod:`.tier`), encodes when they miss, keeps the entry (evicting what
the budgets push out, down to host memory), writes it through to the directory, and wakes the
callers that joined the flight. A hit is :meth:`Lookups.claim` finding a verified entry. Upstream's
``get`` and ``put`` (:meth:`Lookups.get`, :meth:`Lookups.put`) take the same path without a flight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

from vllm_omni_prompt_cache.counts.counters import (
    CHANGED_ENTRIES,
    ENCODE_PROMPT,
    EVICTIONS,
    OVERSIZE_REJECTIONS,
    Count,
    Outcome,
)
from vllm_omni_prompt_cache.keys.call_key import CallKey, freeze_witness, witness_matches
from vllm_omni_prompt_cache.store.entries import LRU, Departures, Entry
from vllm_omni_prompt_cache.store.flights import Claim, Flight, Flights, Ticket
from vllm_omni_prompt_cache.store.shared_heads import SharedHeads
from vllm_omni_prompt_cache.store.tiers.tier import Stamp, Tiers
from vllm_omni_prompt_cache.store.values import detach_value

T = TypeVar("T")

#: Bypass reason recorded when a key's identity matches but its witness bytes differ.
COLLISION_REASON = "digest collision: identity matched, bytes differed"
#: Bypass reason for a call the encoder makes into the same key while computing it.
REENTRANT_REASON = "re-entrant call for a key being computed by the same thread"

#: How a caller of :meth:`Lookups.serve` counts a call that was not a hit: told what it came to (and why, for a
#: bypass).
CountCall = Callable[[Outcome, "str | None"], None]
#: How evictions are counted: (method, counts).
Record = Callable[[str, dict[Count, Any]], None]


def changed_in_place(versions: tuple[tuple[Any, int], ...]) -> bool:
    """Return True when a tensor of an entry (``versions``: see :func:`~.values.tensor_versions`) was written in
    place since it was stored: a caller wrote into the served value, not a copy. Here, beside the look-ups that
    drop such entries, so that a hit checks it without leaving the module."""
    return any(tensor._version != version for tensor, version in versions)


class Lookups:
    """Entries, flights and lower tiers under one lock, with the :class:`~.flights.Ticket` entries are made under.

    ``verify``: keep each key's witness and compare it on every hit; ``record(method, counts)``
    counts what an insertion evicted, for the method whose entry it was.
    """

    def __init__(self, entries: LRU[Entry], tiers: Tiers, *, verify: bool, record: Record) -> None:
        self.entries = entries
        self.flights = Flights()
        self.tiers = tiers
        self.verify = verify
        self.lock = threading.Lock()  # guards entries, flights and the ticket
        self.ticket = Ticket()  # replaced at each clear() and sleep
        self.heads = SharedHeads()  # the leading positions entries in device memory share
        self._record = record

    def get(self, key: CallKey | Hashable, method: str) -> tuple[bool, Any]:
        """Return ``(True, value)`` from ``key``'s verified entry or a lower tier, else ``(False, None)``.

        Upstream's ``get``: no flight, and no claim on the directory (a get need not be followed by a
        put). A :class:`CallKey` whose entry holds other bytes (a collision) is a miss; lower tiers
        hold only :class:`CallKey` entries. A value found there is kept again, under ``method``.
        """
        identity, witness = (key.identity, key.witness) if type(key) is CallKey else (key, None)
        with self.lock:
            entry = self._intact(identity, method)
            if entry is not None and (
                entry.witness is None or (witness is not None and witness_matches(entry.witness, witness))
            ):
                self.entries.refresh(identity)
                return True, entry.value
            stamp = self._stamp()
        if entry is not None or witness is None:
            return False, None
        found, value = self.tiers.get(key, claim=False)
        if found:
            witness = freeze_witness(witness) if self.verify else None
            self._keep(identity, Entry.of(value, witness, heads=self.heads), method, stamp)
        return found, value

    def put(
        self, key: CallKey | Hashable, value: Any, method: str, made_under: Ticket | None = None, *, write: bool = True
    ) -> None:
        """Keep ``value`` under ``key`` as given (insert or overwrite) and, with ``write``, write it through (a
        :class:`CallKey`'s); ``made_under``: the ticket it was computed under (None: now), void if a clear() or a
        sleep came since."""
        keyed = type(key) is CallKey
        witness = freeze_witness(key.witness) if keyed and self.verify else None
        entry = Entry.of(value, witness, keyed=keyed, heads=self.heads)
        stamp = None if made_under is None else Stamp(made_under, self.tiers.epoch())
        stamp = self._keep(key.identity if keyed else key, entry, method, stamp)
        # A clear() or a sleep since voids the write, as it voids an encode's.
        if write and keyed and stamp.ticket is self.ticket:
            self.tiers.write(key, entry, stamp)

    def held_bytes(self) -> int:
        """Return the bytes device memory holds: each entry's, a shared head once (the budgets count every entry's
        heads in full, so they bound what is held). The caller holds :attr:`lock`."""
        shared = sum(entry.shared for entry in self.entries.values())
        return self.entries.bytes - shared + self.heads.nbytes

    def forget(self, identity: Hashable) -> None:
        """Drop ``identity``'s entry from device memory, if any (the lower tiers keep theirs)."""
        with self.lock:
            self.entries.pop(identity)

    def serve(
        self, key: CallKey, compute: Callable[[], T], count: CountCall, method: str, made_under: Ticket | None = None
    ) -> T:
        """Return the value for ``key``: its entry, another caller's encode of it, or ``compute()`` (once).
        ``made_under``: the ticket a value ``compute`` returns was made under, when it was made before the call
        (None: now); one a clear() or a sleep has voided since is returned, not kept.

        ``count(outcome, reason)`` is called once, before this returns or raises, for a miss (this call
        encoded, or tried to) or a bypass (a collision, a re-entrant call) with its reason; never for a hit
        (a value this call did not compute), which the caller counts (it may first have to prove it).
        """
        while True:
            with self.lock:
                decision, claimed = self._claim(key, method, made_under)
            if decision is Claim.HIT:
                return claimed
            if decision is Claim.DIRECT:
                count(Outcome.BYPASS, claimed)
                return compute()
            if decision is Claim.OWN:
                encoded = True  # unless a lower tier serves it
                try:
                    result, encoded = self.complete(key, claimed, compute, method)
                    return result
                finally:
                    if encoded:
                        count(Outcome.MISS, None)
            if claimed.wait():
                return claimed.value
            # The owner's encode raised and its caller got the error; try again ourselves.

    def claim(self, keys: Sequence[CallKey], method: str) -> list[tuple[Claim, Any]]:
        """Decide how each of ``keys`` is served, under one lock: ``(HIT, value)``, ``(OWN, flight)``
        (the caller must :meth:`complete` or :meth:`abandon` it), ``(JOIN, flight)`` or
        ``(DIRECT, reason)``. Counts nothing."""
        claims: list[tuple[Claim, Any]] = []
        with self.lock:
            try:
                for key in keys:
                    claims.append(self._claim(key, method))
            except BaseException:  # never leave a claimed flight unrun
                for key, (decision, flight) in zip(keys, claims, strict=False):
                    if decision is Claim.OWN:
                        self.flights.fail(key.identity, flight)
                        flight.finish()  # under the lock: no waiter can have joined it yet
                raise
        return claims

    def _intact(self, identity: Hashable, method: str) -> Entry | None:
        """Return ``identity``'s entry, or None; one changed in place since it was stored is dropped (counted
        under ``method``). The lock is held."""
        entry = self.entries.get(identity)
        if entry is not None and changed_in_place(entry.versions):
            self.entries.pop(identity)
            self._record(method, {CHANGED_ENTRIES: 1})
            return None
        return entry

    def _claim(self, key: CallKey, method: str, made_under: Ticket | None = None) -> tuple[Claim, Any]:
        """Decide how ``key`` is served (an owned flight under ``made_under``, None: the ticket now); the lock is
        held."""
        entry = self._intact(key.identity, method)
        if entry is not None:
            if entry.witness is None or witness_matches(entry.witness, key.witness):
                self.entries.refresh(key.identity)
                return Claim.HIT, entry.value
            return Claim.DIRECT, COLLISION_REASON
        flight = self.flights.get(key.identity)
        if flight is None:
            witness = freeze_witness(key.witness) if self.verify else None
            ticket = self.ticket if made_under is None else made_under
            return Claim.OWN, self.flights.begin(key.identity, witness, ticket, self.tiers.epoch())
        if flight.witness is not None and not witness_matches(flight.witness, key.witness):
            return Claim.DIRECT, COLLISION_REASON
        if flight.owner == threading.get_ident():
            return Claim.DIRECT, REENTRANT_REASON
        flight.waiters += 1
        return Claim.JOIN, flight

    def complete(self, key: CallKey, flight: Flight, compute: Callable[[], T], method: str) -> tuple[T, bool]:
        """Serve an owned flight from a lower tier, or run ``compute`` and write the result through; keep
        the value and wake the waiters in every case. Returns the value and whether it was encoded."""
        tiers = self.tiers
        try:
            found, result = tiers.get(key, claim=True, epoch=flight.tiers_epoch) if tiers else (False, None)
            if not found:
                result = compute()
            value = result if found else detach_value(result)
            entry = Entry.of(value, flight.witness, heads=self.heads)
        except BaseException:  # the encode raised, or the lookup was interrupted
            self.abandon([(key, flight)])  # waiters try again; nothing is stored
            tiers.release(key, flight.tiers_epoch)  # other processes waiting for it encode it themselves
            raise
        stamp = self._keep(key.identity, entry, method, Stamp(flight.ticket, flight.tiers_epoch), flight)
        if not found and stamp.ticket is self.ticket:
            tiers.write(key, entry, stamp)
        elif not found:
            tiers.release(key, flight.tiers_epoch)
        return result, not found

    def abandon(self, flights: list[tuple[CallKey, Flight]]) -> None:
        """Retire owned flights whose encode will not run or raised: their waiters try again."""
        with self.lock:
            for key, flight in flights:
                self.flights.fail(key.identity, flight)
        for _, flight in flights:
            flight.finish()

    def _stamp(self) -> Stamp:
        """Return what entries are made under now; the lock is held."""
        return Stamp(self.ticket, self.tiers.epoch())

    def _keep(
        self, identity: Hashable, entry: Entry, method: str, stamp: Stamp | None = None, flight: Flight | None = None
    ) -> Stamp:
        """Keep ``entry`` in device memory, made under ``stamp`` (None: now), unless a clear() or a sleep since
        voided it; land ``flight`` with its value in any case. What the insertion pushed out is counted
        under ``method`` and goes down to the tiers that keep departures. Returns the stamp."""
        with self.lock:
            if flight is not None:
                self.flights.land(identity, flight, entry.value)
            stamp = self._stamp() if stamp is None else stamp
            departures = self._insert(identity, entry, method) if stamp.ticket is self.ticket else []
        if flight is not None:
            flight.finish()
        self.tiers.demote(self._unchanged(departures, method), stamp)
        return stamp

    def _insert(self, identity: Hashable, entry: Entry, method: str) -> Departures:
        """Store ``entry`` and count what its insertion pushed out, under ``method``; the lock is held."""
        departures, too_large = self.entries.put(identity, entry)
        if too_large:
            self._record(method, {OVERSIZE_REJECTIONS: 1})
        elif departures:
            self._record(method, {EVICTIONS: len(departures)})
        return departures

    def clear(self) -> None:
        """Forget every entry and flight, and what the lower tiers hold: their values are wrong now (new weights).

        The weights of the old tickets go stale, so entries leaving under them are not kept in host
        memory either; callers waiting on an encode still get its result.
        """
        with self.lock:
            self.entries.drain()
            self.heads.clear()
            self.flights.clear()
            self.ticket.weights.stale = True  # before the host tier empties: a copy still arriving is dropped
            self.ticket = Ticket()
            self.tiers.clear()

    def release_device_memory(self) -> int:
        """Forget every entry and flight in device memory, the entries still valid going down to the tiers that
        keep departures (oldest first); return how many there were."""
        with self.lock:
            departures = self.entries.drain()
            self.heads.clear()
            self.flights.clear()
            self.ticket = Ticket(self.ticket.weights)
            stamp = self._stamp()
        self.tiers.demote(self._unchanged(departures, ENCODE_PROMPT), stamp, at_sleep=True)
        return len(departures)

    def _unchanged(self, departures: Departures, method: str) -> Departures:
        """Return the departures still as they were stored: one a caller wrote into goes nowhere (counted)."""
        kept = [(identity, entry) for identity, entry in departures if not changed_in_place(entry.versions)]
        if len(kept) < len(departures):
            self._record(method, {CHANGED_ENTRIES: len(departures) - len(kept)})
        return kept
