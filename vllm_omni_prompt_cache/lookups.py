"""How one key is served: its entry in device memory, a flight in progress, a lower tier, or an encode.

Follow a miss here: :meth:`Lookups.claim` finds no entry and begins a flight; :meth:`Lookups.complete`
looks in the lower tiers (:mod:`.tiers`), encodes when they miss, keeps the entry (evicting what
the budgets push out, down to host memory), writes it through to the directory, and wakes the
callers that joined the flight. A hit is :meth:`Lookups.claim` finding a verified entry.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

from vllm_omni_prompt_cache.counters import Outcome
from vllm_omni_prompt_cache.entries import LRU, Departures, Entry
from vllm_omni_prompt_cache.flights import Claim, Flight, Flights, Ticket
from vllm_omni_prompt_cache.keys import CallKey, freeze_witness, witness_matches
from vllm_omni_prompt_cache.tiers import LowerTiers
from vllm_omni_prompt_cache.values import detach_value

T = TypeVar("T")

#: Bypass reason recorded when a key's identity matches but its witness bytes differ.
COLLISION_REASON = "digest collision: identity matched, bytes differed"
#: Bypass reason for a call the encoder makes into the same key while computing it.
REENTRANT_REASON = "re-entrant call for a key being computed by the same thread"

#: How a caller of :meth:`Lookups.serve` counts its call: told what it came to (and why, for a bypass).
CountCall = Callable[[Outcome, "str | None"], None]
#: How evictions are counted: (method, counts).
Record = Callable[[str, dict[str, Any]], None]


class Lookups:
    """Entries, flights and lower tiers under one lock, with the :class:`~.flights.Ticket` entries are made under.

    ``verify``: keep each key's witness and compare it on every hit; ``record(method, counts)``
    counts what an insertion evicted, for the method whose entry it was.
    """

    def __init__(self, entries: LRU[Entry], tiers: LowerTiers, *, verify: bool, record: Record) -> None:
        self.entries = entries
        self.flights = Flights()
        self.tiers = tiers
        self.verify = verify
        self.lock = threading.Lock()  # guards entries, flights and the ticket
        self.ticket = Ticket()  # replaced at each clear() and sleep
        #: Set by a compute on its thread when its result must not be written through under its key (the
        #: encode read state the key does not hold; the caller keeps it under a key that does).
        self.withheld = threading.local()
        self._record = record

    def serve(self, key: CallKey, compute: Callable[[], T], count: CountCall, method: str) -> T:
        """Return the value for ``key``: its entry, another caller's encode of it, or ``compute()`` (once).

        ``count(outcome, reason)`` is called once, before this returns or raises: a hit, a miss (this
        call encoded, or tried to), or a bypass (a collision, a re-entrant call) with its reason.
        """
        while True:
            with self.lock:
                decision, claimed = self._claim(key)
            if decision is Claim.HIT:
                count(Outcome.HIT, None)
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
                    count(Outcome.MISS if encoded else Outcome.HIT, None)
            if claimed.wait():
                count(Outcome.HIT, None)
                return claimed.value
            # The owner's encode raised and its caller got the error; try again ourselves.

    def claim(self, keys: Sequence[CallKey]) -> list[tuple[Claim, Any]]:
        """Decide how each of ``keys`` is served, under one lock: ``(HIT, value)``, ``(OWN, flight)``
        (the caller must :meth:`complete` or :meth:`abandon` it), ``(JOIN, flight)`` or
        ``(DIRECT, reason)``. Counts nothing."""
        claims: list[tuple[Claim, Any]] = []
        with self.lock:
            try:
                for key in keys:
                    claims.append(self._claim(key))
            except BaseException:  # never leave a claimed flight unrun
                for key, (decision, flight) in zip(keys, claims, strict=False):
                    if decision is Claim.OWN:
                        self.flights.fail(key.identity, flight)
                        flight.finish()  # under the lock: no waiter can have joined it yet
                raise
        return claims

    def _claim(self, key: CallKey) -> tuple[Claim, Any]:
        """Decide how ``key`` is served; the lock is held."""
        entry = self.entries.get(key.identity)
        if entry is not None:
            if entry.witness is None or witness_matches(entry.witness, key.witness):
                self.entries.refresh(key.identity)
                return Claim.HIT, entry.value
            return Claim.DIRECT, COLLISION_REASON
        flight = self.flights.get(key.identity)
        if flight is None:
            witness = freeze_witness(key.witness) if self.verify else None
            return Claim.OWN, self.flights.begin(key.identity, witness, self.ticket, self.tiers.directory_epoch())
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
            found, result = tiers.lookup(key, claim=True, epoch=flight.tiers_epoch) if tiers else (False, None)
            if not found:
                result = compute()
            value = result if found else detach_value(result)
            entry = Entry.of(value, flight.witness)
        except BaseException:  # the encode raised, or the lookup was interrupted
            self.withheld.active = False
            self.abandon([(key, flight)])  # waiters try again; nothing is stored
            tiers.release(key, flight.tiers_epoch)  # other processes waiting for it encode it themselves
            raise
        with self.lock:
            self.flights.land(key.identity, flight, value)
            # A clear() or a sleep meanwhile voids the result (weights may have changed): return it, keep nothing.
            current = flight.ticket is self.ticket
            departures = self.keep(key.identity, entry, method) if current else []
        flight.finish()
        tiers.demote(departures, flight.ticket)
        withheld = getattr(self.withheld, "active", False)
        self.withheld.active = False
        if not found and flight.ticket is self.ticket and not withheld:  # files carry the key bytes whatever ``verify``
            witness = flight.witness if flight.witness is not None else freeze_witness(key.witness)
            tiers.write(key, witness, value, flight.tiers_epoch)
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

    def keep(self, identity: Hashable, entry: Entry, method: str) -> Departures:
        """Store ``entry`` and count what its insertion pushed out, under ``method``; the lock is held.
        Returns the entries that left device memory, for the caller to demote once the lock is released."""
        departures, too_large = self.entries.put(identity, entry)
        if too_large:
            self._record(method, {"oversize_rejections": 1})
        elif departures:
            self._record(method, {"evictions": len(departures)})
        return departures

    def drop_all(self, *, stale: bool) -> tuple[Departures, Ticket]:
        """Forget every entry and flight and take a new ticket; return the entries that were held and it.

        ``stale``: their values are wrong now (new weights): the weights of the old tickets go stale,
        so entries leaving under them are not kept in host memory either, and the lower tiers are cleared.
        """
        with self.lock:
            departures = self.entries.drain()
            self.flights.clear()
            if stale:
                self.ticket.weights.stale = True  # before the host tier empties: a copy still arriving is dropped
                self.ticket = ticket = Ticket()
                self.tiers.clear()
            else:
                self.ticket = ticket = Ticket(self.ticket.weights)
        return departures, ticket
