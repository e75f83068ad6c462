"""Where entries go when they leave device memory: an LRU in host memory with a budget.

An entry evicted from the device tier by a budget, or dropped there because the worker goes to
sleep, is copied to host memory (pinned when CUDA is present, so the copy back is fast) instead of
being lost. By default only a level-1 sleep's entries come here, within the device tier's own
limits: an RL trainer that sleeps the engine every step finds them again after the wake. A device
miss that finds one here takes it back: the tensors return to the devices they came from and the
entry leaves this tier (each entry lives in one in-memory tier at a time). On a CPU-only machine the
tensors already are in host memory and nothing is copied.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any, NamedTuple

import torch

from vllm_omni_prompt_cache.counts.counters import (
    HOST_DEMOTIONS,
    HOST_EVICTIONS,
    HOST_HITS,
    HOST_MISSES,
    Count,
    Keeper,
    read_counts,
    zero_counts,
)
from vllm_omni_prompt_cache.keys.call_key import CallKey, witness_matches
from vllm_omni_prompt_cache.logs import warn_once
from vllm_omni_prompt_cache.store.entries import LRU, Entry
from vllm_omni_prompt_cache.store.shared_heads import whole_value
from vllm_omni_prompt_cache.store.tiers.tier import Keeps, Stamp
from vllm_omni_prompt_cache.store.values import map_tensors

#: The host tier's default budget: what device memory holds when the worker sleeps (level 1) waits in
#: host memory, within the device tier's own limits, and comes back on first use after the wake.
HOST_AT_SLEEP = "auto"


class HostEntry(NamedTuple):
    """One entry in host memory: its value with every tensor on the CPU, and where each tensor came from."""

    value: Any
    devices: tuple[torch.device, ...]  # of the value's tensors, in the order map_tensors visits them
    witness: tuple[bytes, ...] | None
    nbytes: int


def to_host(value: Any) -> tuple[Any, tuple[torch.device, ...]]:
    """Return ``value`` with every tensor in host memory (pinned if it came from CUDA), and their devices."""
    devices: list[torch.device] = []

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        devices.append(tensor.device)
        if tensor.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.device.type == "cuda")
        return host.copy_(tensor)

    return map_tensors(value, convert), tuple(devices)


def to_devices(value: Any, devices: tuple[torch.device, ...]) -> Any:
    """Return ``value`` with its tensors back on ``devices`` (what :func:`to_host` returned with it)."""
    remaining = iter(devices)
    return map_tensors(value, lambda tensor: tensor.to(next(remaining)))


class HostTier:
    """Thread-safe LRU of :class:`HostEntry` values within ``max_bytes`` (and ``max_entries``; None: no such
    budget, but one of them must be given): a :class:`~.tier.Tier` that keeps the entries leaving device
    memory, or with ``keeps=Keeps.SLEEP_DEPARTURES`` only those a level-1 sleep drops."""

    epoch = 0  # entries made under old weights are voided by the store's tickets (see put)

    def __init__(
        self, max_bytes: int | None, *, max_entries: int | None = None, keeps: Keeps = Keeps.DEPARTURES
    ) -> None:
        for name, budget in (("max_bytes", max_bytes), ("max_entries", max_entries)):
            if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
                raise ValueError(f"host {name} must be None or an integer >= 1, got {budget!r}")
        if max_bytes is None and max_entries is None:
            raise ValueError("a host tier needs a budget: max_bytes, max_entries or both")
        self.keeps = keeps
        self._entries: LRU[HostEntry] = LRU(max_entries, max_bytes)
        self._lock = threading.Lock()
        # Counts since the tier was made (clear() keeps them), read by the store's snapshot through counts().
        self._counts = zero_counts(Keeper.HOST)

    def __len__(self) -> int:
        return len(self._entries)

    def held(self) -> list[HostEntry]:
        """Return the entries in host memory now, least recently arrived first."""
        with self._lock:
            return self._entries.values()

    def get(self, key: CallKey, *, claim: bool = False, epoch: int | None = None) -> tuple[bool, Any]:
        """Take ``key``'s entry out of host memory, back on the devices it came from: ``(True, value)``, or
        ``(False, None)`` when absent or of other key bytes. Nothing here is claimed, nor voided by an
        epoch. Raises when the copy back fails (no device memory left): the entry is gone then."""
        with self._lock:
            entry = self._entries.get(key.identity)
            if entry is None or (entry.witness is not None and not witness_matches(entry.witness, key.witness)):
                self._counts[HOST_MISSES] += 1
                return False, None
            self._entries.pop(key.identity)
            self._counts[HOST_HITS] += 1
        return True, to_devices(entry.value, entry.devices)

    def put(self, identity: Hashable, entry: Entry, stamp: Stamp) -> None:
        """Copy an entry leaving the device tier into host memory, then evict the oldest over budget.

        ``stamp``: the store's ticket when the entry left the device tier; a clear() since then made
        it stale (before emptying this tier), and the entry is dropped. An entry that cannot be copied
        (no pinned memory left) is dropped too, as without this tier.
        """
        if self.max_bytes is not None and entry.nbytes > self.max_bytes:
            with self._lock:
                self._counts[HOST_EVICTIONS] += 1  # larger than the budget: dropped as it arrives
            return
        try:  # whole tensors (shared heads are device memory's); outside the lock: a device-to-host copy
            host_value, devices = to_host(whole_value(entry.value))
        except Exception as error:
            warn_once(f"an entry could not move to host memory ({type(error).__qualname__}); it was dropped")
            return
        with self._lock:
            if stamp.ticket.stale:
                return
            self._counts[HOST_DEMOTIONS] += 1
            evicted, _ = self._entries.put(identity, HostEntry(host_value, devices, entry.witness, entry.nbytes))
            self._counts[HOST_EVICTIONS] += len(evicted)

    def release(self, identity: Hashable, epoch: int) -> None:
        """Nothing to end: a lookup here claims nothing."""

    def clear(self) -> None:
        """Drop every entry (they are stale); counts are kept."""
        with self._lock:
            self._entries.drain()

    @property
    def max_bytes(self) -> int | None:
        """The byte budget (None: none)."""
        return self._entries.max_bytes

    @property
    def max_entries(self) -> int | None:
        """The entry budget (None: none)."""
        return self._entries.max_entries

    @property
    def bytes(self) -> int:
        """Bytes held now."""
        return self._entries.bytes

    def levels(self) -> dict[str, Any]:
        """Return the entries and bytes held now, and the budget, as :class:`~.stats.CacheStats` fields."""
        return {
            "host_entries": len(self),
            "host_bytes": self.bytes,
            "host_max_bytes": self.max_bytes,
            "host_max_entries": self.max_entries,
            "host_keeps": self.keeps.name.lower(),
        }

    def counts(self) -> dict[Count, Any]:
        """Return the host tier's counts since it was made: hits, misses, demotions (entries that arrived from
        device memory) and evictions."""
        with self._lock:
            return read_counts(self._counts)
