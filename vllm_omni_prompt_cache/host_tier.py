"""Where entries go when they leave device memory: an LRU in host memory with a byte budget.

An entry evicted from the device tier by a budget, or dropped there because the worker goes to
sleep, is copied to host memory (pinned when CUDA is present, so the copy back is fast) instead
of being lost. A device miss that finds it here takes it back: the tensors return to the devices
they came from and the entry leaves this tier (each entry lives in one in-memory tier at a time).
On a CPU-only machine the tensors already are in host memory and nothing is copied.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any, NamedTuple

import torch

from vllm_omni_prompt_cache.entries import LRU
from vllm_omni_prompt_cache.flights import Ticket
from vllm_omni_prompt_cache.keys import witness_matches
from vllm_omni_prompt_cache.values import map_tensors


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
    """Thread-safe LRU of :class:`HostEntry` values within ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"host max_bytes must be an integer >= 1, got {max_bytes!r}")
        self._entries: LRU[HostEntry] = LRU(None, max_bytes)
        self._lock = threading.Lock()
        # Counts since the tier was made (clear() keeps them), read by the store's snapshot.
        self.hits = 0  # device misses served from here
        self.misses = 0  # device misses that looked here and found nothing
        self.demotions = 0  # entries that arrived from the device tier
        self.evictions = 0  # entries dropped to stay within max_bytes (or larger than it)

    @property
    def max_bytes(self) -> int:
        """The byte budget."""
        return self._entries.max_bytes

    @property
    def bytes(self) -> int:
        """Bytes held now."""
        return self._entries.bytes

    def __len__(self) -> int:
        return len(self._entries)

    def held(self) -> list[HostEntry]:
        """Return the entries in host memory now, least recently arrived first."""
        with self._lock:
            return self._entries.values()

    def put(
        self, identity: Hashable, value: Any, witness: tuple[bytes, ...] | None, nbytes: int, ticket: Ticket
    ) -> None:
        """Copy an entry leaving the device tier into host memory, then evict the oldest over budget.

        ``ticket``: the store's ticket when the entry left the device tier; a clear() since then made
        it stale (before emptying this tier), and the entry is dropped.
        """
        if nbytes > self.max_bytes:
            with self._lock:
                self.evictions += 1
            return
        host_value, devices = to_host(value)  # outside the lock: a device-to-host copy
        with self._lock:
            if ticket.stale:
                return
            self.demotions += 1
            evicted, _ = self._entries.put(identity, HostEntry(host_value, devices, witness, nbytes))
            self.evictions += len(evicted)

    def take(self, identity: Hashable, witness: tuple) -> HostEntry | None:
        """Remove and return the entry for ``identity`` if its witness matches ``witness`` (None: a miss).

        The returned entry's value is still in host memory: :func:`to_devices` puts it back.
        """
        with self._lock:
            entry = self._entries.get(identity)
            if entry is None or (entry.witness is not None and not witness_matches(entry.witness, witness)):
                self.misses += 1
                return None
            self._entries.pop(identity)
            self.hits += 1
            return entry

    def clear(self) -> None:
        """Drop every entry (they are stale); counts are kept."""
        with self._lock:
            self._entries.drain()
