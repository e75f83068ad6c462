"""Misses being encoded: one encode per key however many callers miss it at once (single-flight).

The first caller to miss a key *owns* its flight and encodes; callers missing the same key
meanwhile *join* it and take its value, or claim the key again when the owner's encode raised.
In-flight state is explicit: a flight is begun, then landed with a value or failed, and only then
are its waiters woken (:meth:`Flight.finish`).

Every flight carries the store's :class:`Ticket` of the moment it began, so a result computed
before a ``clear()`` (new weights) or a sleep is returned to its callers but never stored.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Hashable
from typing import Any


class Claim(enum.Enum):
    """How a key is served (see :meth:`.lookups.Lookups.claim`)."""

    HIT = "served from an entry"
    OWN = "this caller encodes it and lands the flight"
    JOIN = "another caller is encoding it: wait for its flight"
    DIRECT = "encode it without caching (a collision or a re-entrant call)"


class Weights:
    """The text-encoder weights entries are made with: stale once ``clear()`` says they changed."""

    __slots__ = ("stale",)

    def __init__(self) -> None:
        self.stale = False


class Ticket:
    """What entries are made under: the store takes a new ticket at each ``clear()`` and each sleep.

    A flight's result is kept (and written through) only while its ticket is the store's. A sleep's
    new ticket keeps the old one's :class:`Weights`; a ``clear()`` marks them stale and starts new
    ones, so an entry that left device memory under any ticket of the old weights (before or after
    a sleep) is not kept in host memory either.
    """

    __slots__ = ("weights",)

    def __init__(self, weights: Weights | None = None) -> None:
        self.weights = Weights() if weights is None else weights

    @property
    def stale(self) -> bool:
        """True once the weights it was taken under changed: what it made is wrong now."""
        return self.weights.stale


class Flight:
    """One miss being encoded; waiters take its value or, if it failed, try again."""

    __slots__ = ("done", "failed", "owner", "ticket", "tiers_epoch", "value", "waiters", "witness")

    def __init__(self, witness: tuple[bytes, ...] | None, ticket: Ticket, tiers_epoch: int) -> None:
        self.done = threading.Event()
        self.owner = threading.get_ident()
        self.value: Any = None
        self.failed = False
        self.waiters = 0  # callers blocked on ``done``
        self.witness = witness  # the key's bytes, owned (None when verification is off)
        self.ticket = ticket
        self.tiers_epoch = tiers_epoch  # the lower tiers' epoch then: its result is written for it

    def finish(self) -> None:
        """Wake the waiters (after :meth:`Flights.land` or :meth:`Flights.fail`, outside the lock)."""
        self.done.set()

    def wait(self) -> bool:
        """Block until the owner finishes; return True when it landed a value, False when it failed."""
        self.done.wait()
        return not self.failed


class Flights:
    """The flights in progress, by key identity. Not thread-safe: the store's lock guards every call."""

    def __init__(self) -> None:
        self._flights: dict[Hashable, Flight] = {}

    def get(self, identity: Hashable) -> Flight | None:
        """Return the flight encoding ``identity`` now, or None."""
        return self._flights.get(identity)

    def begin(self, identity: Hashable, witness: tuple[bytes, ...] | None, ticket: Ticket, tiers_epoch: int) -> Flight:
        """Start the flight that will encode ``identity``; the caller owns it."""
        flight = self._flights[identity] = Flight(witness, ticket, tiers_epoch)
        return flight

    def land(self, identity: Hashable, flight: Flight, value: Any) -> None:
        """Give ``flight`` its value and retire it (a ``clear()`` may already have replaced it)."""
        flight.value = value
        self._retire(identity, flight)

    def fail(self, identity: Hashable, flight: Flight) -> None:
        """Retire ``flight`` without a value: its waiters claim the key again."""
        flight.failed = True
        self._retire(identity, flight)

    def _retire(self, identity: Hashable, flight: Flight) -> None:
        if self._flights.get(identity) is flight:
            del self._flights[identity]

    def clear(self) -> None:
        """Forget every flight: their owners still finish them, but later callers start anew."""
        self._flights.clear()

    def __len__(self) -> int:
        return len(self._flights)

    def waiters(self, identity: Hashable | None = None) -> int:
        """Return how many callers wait for the flight encoding ``identity`` (0 without one); None: for any."""
        if identity is None:
            return sum(flight.waiters for flight in list(self._flights.values()))
        flight = self._flights.get(identity)
        return 0 if flight is None else flight.waiters
