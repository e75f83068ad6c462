"""The tiers below device memory, behind one interface: host memory first, then a shared directory.

A device miss walks them in order and the first hit wins; the store then keeps the value in device
memory again (a host entry leaves host memory, each entry living in one in-memory tier at a time;
a file stays). Entries leaving device memory go down to host memory; every encoded entry is
written to the directory. A lookup made for an encode takes the directory's claim on the entry,
so other processes wait for its file instead of encoding it too; :meth:`LowerTiers.write` or
:meth:`LowerTiers.release` ends it. Nothing here raises into the store: a tier that fails is a miss.
"""

from __future__ import annotations

from typing import Any

from vllm_omni_prompt_cache.directory_tier import DirectoryTier
from vllm_omni_prompt_cache.entries import Departures
from vllm_omni_prompt_cache.flights import Ticket
from vllm_omni_prompt_cache.host_tier import HostTier, to_devices
from vllm_omni_prompt_cache.keys import CallKey
from vllm_omni_prompt_cache.logs import warn_once


class LowerTiers:
    """The host-memory tier and the directory tier (each None when not configured), in that order."""

    def __init__(self, host: HostTier | None, directory: DirectoryTier | None) -> None:
        self.host = host
        self.directory = directory

    def __bool__(self) -> bool:
        return self.host is not None or self.directory is not None

    def directory_epoch(self) -> int:
        """Return the directory's epoch now (it moves when the weights change): what a flight writes for."""
        return 0 if self.directory is None else self.directory.epoch

    def lookup(self, key: CallKey, *, claim: bool, epoch: int | None = None) -> tuple[bool, Any]:
        """Return ``(True, value)`` from the first tier holding ``key``, else ``(False, None)``.

        The value is on the devices the encoder's output was on. ``claim``: the caller encodes on a
        miss, under the directory ``epoch`` it began at; until it writes or releases, other
        processes missing the entry wait for its file.
        """
        try:
            if self.host is not None:
                entry = self.host.take(key.identity, key.witness)
                if entry is not None:
                    return True, to_devices(entry.value, entry.devices)
            if self.directory is not None:
                return self.directory.load(key.identity, key.witness, claim=claim, epoch=epoch)
        except Exception as error:  # e.g. no device memory left to copy into: encode instead
            warn_once(f"a lower tier failed a lookup ({type(error).__qualname__}: {error}); encoding instead")
        return False, None

    def write(self, key: CallKey, witness: tuple[bytes, ...], value: Any, epoch: int) -> None:
        """Write an encoded entry to the directory (for ``epoch``), ending its claim."""
        if self.directory is not None:
            self.directory.save(key.identity, witness, value, epoch)

    def release(self, key: CallKey, epoch: int) -> None:
        """End the claim a lookup took for an encode that is not written (it raised, or a clear() voided it)."""
        if self.directory is not None:
            self.directory.release(key.identity, epoch)

    def demote(self, departures: Departures, ticket: Ticket) -> None:
        """Move entries that left device memory under ``ticket`` to host memory (when there is a host tier).
        Never raises: an entry the host cannot take (no pinned memory left) is dropped, as without it."""
        if self.host is None:
            return
        for identity, entry in departures:
            if not entry.keyed:  # lower tiers are looked up by CallKey only
                continue
            try:
                self.host.put(identity, entry.value, entry.witness, entry.nbytes, ticket)
            except Exception as error:
                warn_once(f"an entry could not move to host memory ({type(error).__qualname__}); it was dropped")

    def clear(self) -> None:
        """Drop host memory's entries and make the directory fingerprint the weights again before its next use."""
        if self.host is not None:
            self.host.clear()
        if self.directory is not None:
            self.directory.invalidate()

    def levels(self) -> dict[str, Any]:
        """Return the tiers' sizes and budgets now, as :class:`~.stats.CacheStats` fields."""
        levels: dict[str, Any] = {}
        host, directory = self.host, self.directory
        if host is not None:
            levels.update(host_entries=len(host), host_bytes=host.bytes, host_max_bytes=host.max_bytes)
        if directory is not None:
            levels.update(
                dir_files=directory.files,
                dir_bytes=directory.bytes,
                dir_max_bytes=directory.max_bytes,
                directory=str(directory.root),
                dir_off_reason=directory.off_reason,
            )
        return levels
