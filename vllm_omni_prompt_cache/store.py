"""Where cached embeddings live: an LRU with entry and byte budgets.

:class:`PromptEmbedCache` keeps upstream vLLM-Omni's whole public contract (constructor,
``get`` / ``put`` with the :data:`MISS` sentinel, ``clear``, ``stats``, the ``hits`` / ``misses`` /
``bypassed`` counters) and adds what a cache shared by concurrent RL requests needs:

* a byte budget (``max_bytes``) counting the tensors held in values plus the
  witness bytes kept to verify keys;
* exact verification of every hit against the witness (see :mod:`.keys`);
* single-flight (:meth:`PromptEmbedCache.get_or_compute`): concurrent identical misses run the
  encoder once; if that run raises, its caller sees the error and nothing is cached;
* rows (:meth:`PromptEmbedCache.get_or_compute_rows`): a batched call's rows are entries of their
  own, with the same verification and single-flight per row (see :mod:`.rows`);
* statistics with a count for every bypass reason, for calls and for rows, as one
  :class:`CacheStats` snapshot;
* tiers below device memory, both optional: entries leaving it (evicted, or released at sleep)
  move to a host-memory LRU (:mod:`.host_tier`), and every encoded entry is also written to a
  directory other processes share (:mod:`.directory_tier`). A device miss looks there before it
  encodes, inside the same single flight; a hit there is a hit.

Every decision depends only on the order of calls, never on timing or on
memory addresses, so ranks that see the same calls take the same decisions.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

from vllm_omni_prompt_cache.audit import Audit
from vllm_omni_prompt_cache.directory_tier import DirectoryTier
from vllm_omni_prompt_cache.host_tier import HostTier, map_tensors, to_devices
from vllm_omni_prompt_cache.keys import CallKey, freeze_witness, witness_matches, witness_nbytes
from vllm_omni_prompt_cache.logs import warn_once
from vllm_omni_prompt_cache.residency import EncoderMoves

T = TypeVar("T")

#: Bypass reason recorded when a key's identity matches but its witness bytes differ.
COLLISION_REASON = "digest collision: identity matched, bytes differed"
#: Bypass reason for a call the encoder makes into the same key while computing it.
REENTRANT_REASON = "re-entrant call for a key being computed by the same thread"
#: Bypass reason for bypasses counted by code that assigns ``cache.bypassed`` itself, as
#: upstream's wrapper does; it knows no reason.
UNSPECIFIED_REASON = "counted by the caller, no reason given"
#: The method every pipeline encodes prompts with, upstream's one cached method: a count belongs to
#: it when its caller names none.
ENCODE_PROMPT = "encode_prompt"


class _Miss:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISS"


#: What :meth:`PromptEmbedCache.get` returns for an absent key, so that a cached ``None`` is a hit.
MISS: Any = _Miss()


class _Outcome(enum.Enum):
    """How a key is served (see PromptEmbedCache._claim)."""

    HIT = "served from an entry"
    OWN = "this caller encodes it and lands the flight"
    JOIN = "another caller is encoding it: wait for its flight"
    DIRECT = "encode it without caching (a collision or a re-entrant call)"


@dataclasses.dataclass
class Counters:
    """Every count a cache keeps, in one place: a snapshot copies it field by field.

    Integers are event counts since the cache was made (``clear()`` keeps them); mappings count
    events by reason. :class:`CacheStats` has a field of the same name for each.
    """

    hits: int = 0  # calls served without encoding
    misses: int = 0  # calls that ran the encoder and offered the result to the cache
    bypass_reasons: Counter[str] = dataclasses.field(default_factory=Counter)  # calls not using the cache
    evictions: int = 0
    oversize_rejections: int = 0
    # Rows of batched calls (pipelines with a row layout): each row is an entry of its own.
    row_hits: int = 0  # rows served without this call encoding them (cache, another call's encode, a duplicate)
    row_misses: int = 0  # rows encoded and offered to the store (kept unless a clear() or a budget intervened)
    row_bypass_reasons: Counter[str] = dataclasses.field(default_factory=Counter)  # rows encoded, not stored
    rows_encoded: int = 0  # rows that reached the encoder to be served: row misses and bypasses, whole calls
    whole_call_reasons: Counter[str] = dataclasses.field(default_factory=Counter)  # calls not split, and why
    # First-use checks of a row layout against the uncached call (see wrapper.py).
    layout_checks: int = 0  # calls served uncached and compared with their assembled rows
    layout_check_rows: int = 0  # rows those uncached calls sent to the encoder
    layout_mismatches: int = 0  # checks that turned rows off
    # Audits: hits encoded again and compared with what was served (see audit.py).
    audits: int = 0
    audit_mismatches: int = 0  # audits that found another output (the cache turned off)


#: Counts the tiers below device memory keep, by :class:`CacheStats` field: (tier, its attribute).
TIER_COUNTERS = {
    "host_hits": ("host", "hits"),  # device misses served from host memory
    "host_misses": ("host", "misses"),
    "host_demotions": ("host", "demotions"),  # entries moved to host memory from the device
    "host_evictions": ("host", "evictions"),
    "dir_hits": ("directory", "hits"),  # device (and host) misses served from a file
    "dir_misses": ("directory", "misses"),
    "dir_writes": ("directory", "writes"),
    "dir_write_errors": ("directory", "write_errors"),
    "dir_evictions": ("directory", "evictions"),  # files removed to stay within the directory's budget
    "dir_rejections": ("directory", "rejections"),  # files removed on read (corrupt, foreign...), by reason
    "dir_waits": ("directory", "waits"),  # misses served by waiting for another process's encode
    "dir_stale_claims": ("directory", "stale_claims"),  # claims of a gone (or silent) process taken over
    "dir_wait_timeouts": ("directory", "wait_timeouts"),  # waits for another process that ended without its file
    "dir_leftovers_removed": ("directory", "leftovers_removed"),  # crashed writers' temporary and claim files
    # Moves of the text encoders (and the DiTs they swap with) between host and device, whoever made
    # them: vLLM-Omni's module offload, or this package's placement on a miss (see residency.py).
    "encoder_placements": ("moves", "encoder_placements"),
    "encoder_evictions": ("moves", "encoder_evictions"),
    "dit_placements": ("moves", "dit_placements"),
    "dit_evictions": ("moves", "dit_evictions"),
    "bytes_moved": ("moves", "bytes_moved"),
    "placements_avoided": ("moves", "placements_avoided"),  # placements calls served from the cache did not make
    "bytes_not_moved": ("moves", "bytes_not_moved"),
}

#: The counters, by name: what snapshots copy, ``since`` subtracts and ``merged`` adds.
COUNTER_FIELDS = tuple(field.name for field in dataclasses.fields(Counters)) + tuple(TIER_COUNTERS)


class MethodCounters:
    """Every cached method's :class:`Counters`, by method: each count is made under the method whose
    call made it, and a store's totals are their sums. A method's counters are made on first use."""

    def __init__(self) -> None:
        self._by_method: dict[str, Counters] = {ENCODE_PROMPT: Counters()}
        self._lock = threading.Lock()  # taken only to add a method

    def of(self, method: str) -> Counters:
        """Return ``method``'s counters (made at zero on first use, so snapshots list it from then on)."""
        counts = self._by_method.get(method)  # on every call: a read needs no lock
        if counts is None:
            with self._lock:
                counts = self._by_method.setdefault(method, Counters())
        return counts

    def total(self, name: str) -> Any:
        """Return the sum of one :class:`Counters` field over every method (a Counter for counts by reason)."""
        values = [getattr(counts, name) for counts in list(self._by_method.values())]
        return sum(values, Counter()) if isinstance(values[0], Counter) else sum(values)

    def assign(self, name: str, total: int, *, reason: str = "") -> None:
        """Make the sum of ``name`` ``total``, as upstream's code assigns ``cache.hits``: 0 resets every
        method's; another value moves encode_prompt's share (under ``reason`` for a count by reason)."""
        default = self._by_method[ENCODE_PROMPT]
        if total == 0:
            for counts in list(self._by_method.values()):
                setattr(counts, name, Counter() if isinstance(getattr(counts, name), Counter) else 0)
        elif isinstance(kept := getattr(default, name), Counter):
            kept[reason] += total - sum(self.total(name).values())
        else:
            setattr(default, name, kept + total - self.total(name))

    def by_method(self) -> dict[str, dict[str, Any]]:
        """Return each method's counts as plain values, reasons most common first."""
        return {
            method: {
                name: ranked_reasons(value) if isinstance(value := getattr(counts, name), Counter) else value
                for name in METHOD_COUNTER_FIELDS
            }
            for method, counts in list(self._by_method.items())
        }


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """One snapshot of a cache's counters: what ``stats()``, the worker RPC, the log line and the demo show.

    Every :class:`Counters` field appears here under its name; the other fields are levels
    (sizes, budgets, switches) that describe the cache at the moment of the snapshot.
    """

    # Upstream's stats() keys first, in its order; ours after.
    size: int = 0
    max_size: int = 0
    hits: int = 0
    misses: int = 0
    bypassed: int = 0
    bypass_reasons: Mapping[str, int] = dataclasses.field(default_factory=dict)  # most common first
    evictions: int = 0
    oversize_rejections: int = 0
    bytes: int = 0
    max_bytes: int | None = None
    enabled: bool = True
    verify: bool = True
    row_hits: int = 0
    row_misses: int = 0
    row_bypass_reasons: Mapping[str, int] = dataclasses.field(default_factory=dict)
    rows_encoded: int = 0
    whole_call_reasons: Mapping[str, int] = dataclasses.field(default_factory=dict)
    layout_checks: int = 0
    layout_check_rows: int = 0
    layout_mismatches: int = 0
    audits: int = 0
    audit_mismatches: int = 0
    #: The largest difference a passing layout check measured (relative to each row's largest value).
    layout_check_max_gap: float = 0.0
    # The host-memory tier (counts, then levels; max None: no host tier).
    host_hits: int = 0
    host_misses: int = 0
    host_demotions: int = 0
    host_evictions: int = 0
    host_entries: int = 0
    host_bytes: int = 0
    host_max_bytes: int | None = None
    # The directory tier (counts, then levels; directory None: no directory tier).
    dir_hits: int = 0
    dir_misses: int = 0
    dir_writes: int = 0
    dir_write_errors: int = 0
    dir_evictions: int = 0
    dir_rejections: Mapping[str, int] = dataclasses.field(default_factory=dict)
    dir_waits: int = 0
    dir_stale_claims: int = 0
    dir_wait_timeouts: int = 0
    dir_leftovers_removed: int = 0
    dir_files: int = 0  # under the root at this process's last rescan
    dir_bytes: int = 0  # that rescan plus this process's writes since
    dir_max_bytes: int | None = None
    directory: str | None = None
    dir_off_reason: str | None = None  # why the directory tier is not used now (None: in use)
    # The text encoders' moves (counts above, in TIER_COUNTERS; placer None: nothing moves them).
    encoder_placements: int = 0
    encoder_evictions: int = 0
    dit_placements: int = 0
    dit_evictions: int = 0
    bytes_moved: int = 0
    placements_avoided: int = 0
    bytes_not_moved: int = 0
    encoder_device_bytes: int | None = None  # text-encoder bytes on the device at the snapshot (None: not known)
    encoder_placer: str | None = None  # who moves the text encoders: vLLM-Omni's module offload, "on a miss"
    #: The store's counts (every :class:`Counters` field) by the pipeline method that made them;
    #: the fields above are their sums. A method the cache wraps appears from install on.
    methods: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def calls(self) -> int:
        """Return every call the cache saw: hits, misses and bypasses."""
        return self.hits + self.misses + self.bypassed

    @property
    def hit_rate(self) -> float:
        """Return hits over all calls, bypasses included (0.0 before any call)."""
        return self.hits / self.calls if self.calls else 0.0

    @property
    def row_bypassed(self) -> int:
        """Return the rows of split calls that were encoded without being cached."""
        return sum(self.row_bypass_reasons.values())

    def since(self, earlier: CacheStats) -> CacheStats:
        """Return the counts between ``earlier`` and this snapshot; levels stay as now."""
        counts = _counts_since(self._fields(COUNTER_FIELDS), earlier._fields(COUNTER_FIELDS))
        methods = {
            method: _counts_since(mine, earlier.methods.get(method, {})) for method, mine in self.methods.items()
        }
        # Upstream's stats() has no reasons, only the count: subtract the count itself.
        return dataclasses.replace(self, bypassed=self.bypassed - earlier.bypassed, methods=methods, **counts)

    @classmethod
    def merged(cls, snapshots: Iterable[CacheStats]) -> CacheStats:
        """Return the sum of several caches' snapshots (one per replica); switches are the first's."""
        snapshots = list(snapshots)
        if not snapshots:
            raise ValueError("no snapshots to merge")
        first = snapshots[0]
        added = (*COUNTER_FIELDS, "size", "max_size", "bytes", "bypassed", "host_entries", "host_bytes")
        summed = functools.reduce(_counts_added, (each._fields(added) for each in snapshots), {})
        methods: dict[str, dict[str, Any]] = {}
        for each in snapshots:
            for method, counts in each.methods.items():
                methods[method] = _counts_added(methods.get(method, {}), counts)
        budgets = [each.max_bytes for each in snapshots]
        host_budgets = [each.host_max_bytes for each in snapshots]
        on_devices = [each.encoder_device_bytes for each in snapshots if each.encoder_device_bytes is not None]
        return dataclasses.replace(
            first,  # the directory's levels are the first replica's view of a directory they share
            max_bytes=None if None in budgets else sum(budgets),
            host_max_bytes=None if None in host_budgets else sum(host_budgets),
            layout_check_max_gap=max(each.layout_check_max_gap for each in snapshots),
            encoder_device_bytes=sum(on_devices) if on_devices else None,
            methods=methods,
            **summed,
        )

    def _fields(self, names: Iterable[str]) -> dict[str, Any]:
        return {name: getattr(self, name) for name in names}

    def as_dict(self) -> dict[str, Any]:
        """Return upstream's ``stats()`` keys (size, max_size, hits, misses, bypassed) and ours, ``hit_rate`` too."""
        return {**dataclasses.asdict(self), "hit_rate": self.hit_rate}

    @classmethod
    def from_dict(cls, stats: Mapping[str, Any]) -> CacheStats:
        """Return the snapshot a ``stats()`` dict describes; upstream's five keys suffice."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in stats.items() if key in names})

    def summary(self) -> str:
        """Return the one-line summary the worker logs: calls, rows, size, bytes, top bypass reasons."""
        budget = "no limit" if self.max_bytes is None else f"{self.max_bytes / 2**20:.1f} MiB"
        reasons = "; ".join(f"{reason} x{count}" for reason, count in list(self.bypass_reasons.items())[:3])
        rows = (
            f"rows: {self.row_hits} hits, {self.row_misses} misses, {self.row_bypassed} bypassed, "
            f"{self.rows_encoded} encoded; "
            if self.row_hits or self.rows_encoded
            else ""
        )
        tiers = ""
        if self.host_max_bytes is not None:
            tiers += (
                f"; host: {self.host_hits} hits, {self.host_entries} entries, "
                f"{self.host_bytes / 2**20:.1f} of {self.host_max_bytes / 2**20:.1f} MiB, "
                f"{self.host_evictions} evictions"
            )
        if self.directory is not None:
            rejected = sum(self.dir_rejections.values())
            tiers += (
                f"; directory: {self.dir_hits} hits, {self.dir_writes} writes, {self.dir_files} files, "
                f"{self.dir_bytes / 2**20:.1f} MiB, {self.dir_evictions} evictions, {rejected} bad files removed, "
                f"{self.dir_write_errors} write errors"
                + (f" (off: {self.dir_off_reason})" if self.dir_off_reason else "")
            )
        if self.encoder_placer is not None:
            device_bytes = "?" if self.encoder_device_bytes is None else f"{self.encoder_device_bytes / 2**20:.1f}"
            tiers += (
                f"; text encoder ({self.encoder_placer}): {self.encoder_placements} placements, "
                f"{self.placements_avoided} avoided, {device_bytes} MiB on the device"
            )
        used = {
            method: counts
            for method, counts in self.methods.items()
            if counts.get("hits") or counts.get("misses") or counts.get("bypass_reasons")
        }
        if len(used) > 1 or (used and ENCODE_PROMPT not in used):
            tiers += "; by method: " + ", ".join(
                f"{method} {counts.get('hits', 0)} hits {counts.get('misses', 0)} misses "
                f"{sum(counts.get('bypass_reasons', {}).values())} bypassed"
                for method, counts in used.items()
            )
        return (
            f"Prompt-embed cache: hit rate {self.hit_rate:.1%} "
            f"({self.hits} hits, {self.misses} misses, {self.bypassed} bypassed), {rows}"
            f"{self.size}/{self.max_size} entries, {self.bytes / 2**20:.1f} MiB of {budget}, "
            f"{self.evictions} evictions" + tiers + (f"; top bypass reasons: {reasons}" if reasons else "")
        )


#: The counts a :attr:`CacheStats.methods` entry holds (every :class:`Counters` field).
METHOD_COUNTER_FIELDS = tuple(field.name for field in dataclasses.fields(Counters))
#: Those of them kept by reason.
REASON_FIELDS = tuple(field.name for field in dataclasses.fields(Counters) if field.default_factory is Counter)


def _counts_since(now: Mapping[str, Any], earlier: Mapping[str, Any]) -> dict[str, Any]:
    """Return one method's counts between two snapshots (a field missing earlier counts from zero)."""
    return {
        name: _reasons_since(value, earlier.get(name, {}))
        if isinstance(value, Mapping)
        else value - earlier.get(name, 0)
        for name, value in now.items()
    }


def _counts_added(total: Mapping[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    """Return two replicas' counts for one method, added."""
    added = dict(total)
    for name, value in more.items():
        if isinstance(value, Mapping):
            added[name] = ranked_reasons(Counter(total.get(name, {})) + Counter(value))
        else:
            added[name] = total.get(name, 0) + value
    return added


def _reasons_since(now: Mapping[str, int], earlier: Mapping[str, int]) -> dict[str, int]:
    reasons = Counter(now)
    reasons.subtract(earlier)
    return ranked_reasons(reasons)


def ranked_reasons(reasons: Counter[str]) -> dict[str, int]:
    """Return the non-zero counts, most common first (the order every snapshot shows reasons in)."""
    return {reason: count for reason, count in reasons.most_common() if count}


class _Entry(NamedTuple):
    value: Any
    witness: tuple[bytes, ...] | None  # None when verification is off
    nbytes: int
    keyed: bool = True  # stored under a CallKey (not a plain key given to put()): lower tiers may hold it


class _Departures(NamedTuple):
    """Entries that left device memory, and the host tier's epoch when they did."""

    entries: list[tuple[Hashable, _Entry]]
    host_epoch: int


_NO_DEPARTURES = _Departures([], 0)


class _Flight:
    """A miss being computed; waiters take its value or, if it failed, try again."""

    __slots__ = ("directory_epoch", "done", "failed", "generation", "owner", "value", "waiters", "witness")

    def __init__(self, witness: tuple[bytes, ...] | None, generation: int, directory_epoch: int = 0) -> None:
        self.done = threading.Event()
        self.owner = threading.get_ident()
        self.value: Any = None
        self.failed = False
        self.waiters = 0  # callers blocked on ``done`` (observable, so tests can wait for them)
        self.witness = witness
        self.generation = generation  # the cache's clear() count when the encode started
        self.directory_epoch = directory_epoch  # the directory tier's epoch then: its result is written for it


def detach_value(value: Any) -> Any:
    """Return ``value`` with every tensor detached from autograd (containers rebuilt)."""
    return map_tensors(value, torch.Tensor.detach)


def _memory(tensor: torch.Tensor) -> tuple[str, int, int] | None:
    """Return the memory a tensor's storage spans (device, start, end), or None when it has none to read."""
    try:
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        return (str(tensor.device), start, start + storage.nbytes())
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, wrapper subclasses
        return None


def _input_memory(value: Any, found: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Collect the memory of the tensors and numpy arrays in keyed arguments (acyclic, of known types)."""
    if isinstance(value, torch.Tensor):
        memory = _memory(value)
        if memory is not None:
            found.append(memory)
    elif isinstance(value, np.ndarray):
        start, end = np.lib.array_utils.byte_bounds(value)
        found.append(("cpu", start, end))
    elif isinstance(value, (tuple, list)):
        for item in value:
            _input_memory(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _input_memory(item, found)
    return found


def unaliased(value: Any, inputs: Any) -> Any:
    """Return ``value`` with each tensor whose memory overlaps a tensor or array of ``inputs`` cloned.

    An encode may hand one of its inputs back, or build an output on it (verl-omni's LTX-2
    ``_encode_token_ids`` returns a slice of the mask it was given when the ids need no padding);
    kept as is, the entry would change when the caller reuses that buffer.
    """
    shared = _input_memory(inputs, [])
    if not shared:
        return value

    def own(tensor: torch.Tensor) -> torch.Tensor:
        memory = _memory(tensor)
        if memory is not None and any(
            memory[0] == device and memory[1] < end and start < memory[2] for device, start, end in shared
        ):
            return tensor.clone()
        return tensor

    return map_tensors(value, own)


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
        host_bytes: int | None = None,
        directory: DirectoryTier | None = None,
    ) -> None:
        """``host_bytes``: the host-memory tier's budget (None: no host tier); ``directory``: the
        directory tier (None: none)."""
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
        self._counters = MethodCounters()
        self._counts = self._counters.of(ENCODE_PROMPT)  # what upstream's counters and get/put count in
        self._max_gap = 0.0
        self._generation = 0  # bumped by clear(): results computed before it are not stored
        self.host = None if host_bytes is None else HostTier(host_bytes)
        self.directory = directory
        #: What moves the text encoders between host and device, counted (set by the worker; None: nothing).
        self.moves: EncoderMoves | None = None
        #: Which hits are encoded again and compared (see audit.py; None: none).
        self.audit: Audit | None = None
        #: Why ``enabled`` was turned off for good (an audit's mismatch), for the bypass counts.
        self.off_reason: str | None = None

    # Upstream's counters are plain attributes that its wrapper assigns (``cache.bypassed += 1``
    # under ``cache._lock``): readable and assignable here too, without taking the lock. They are
    # every method's sums (see MethodCounters.assign for an assignment).
    @property
    def hits(self) -> int:
        """Calls served from the cache, every method's."""
        return self._counters.total("hits")

    @hits.setter
    def hits(self, value: int) -> None:
        self._counters.assign("hits", value)

    @property
    def misses(self) -> int:
        """Calls that ran the encoder and offered its result to the cache, every method's."""
        return self._counters.total("misses")

    @misses.setter
    def misses(self, value: int) -> None:
        self._counters.assign("misses", value)

    @property
    def bypassed(self) -> int:
        """Calls that did not use the cache, whatever the reason or method."""
        return sum(self._counters.total("bypass_reasons").values())

    @bypassed.setter
    def bypassed(self, value: int) -> None:
        self._counters.assign("bypass_reasons", value, reason=UNSPECIFIED_REASON)

    def __len__(self) -> int:
        return len(self._entries)

    def method_counters(self, method: str) -> Counters:
        """Return the counters of ``method`` (made at zero on first use, so stats list it from then on)."""
        return self._counters.of(method)

    def get(self, key: CallKey | Hashable) -> Any:
        """Return the value cached under ``key`` (refreshing its recency), or :data:`MISS`.

        Upstream's contract: a hit or a miss is counted. A :class:`CallKey` is verified against
        its witness; a collision is a miss (a later ``put`` replaces the entry). A device miss
        looks in the lower tiers, which hold only :class:`CallKey` entries.
        """
        identity, witness = (key.identity, key.witness) if type(key) is CallKey else (key, None)
        with self._lock:
            entry = self._entries.get(identity)
            if entry is not None and (
                entry.witness is None or (witness is not None and witness_matches(entry.witness, witness))
            ):
                self._entries.move_to_end(identity)
                self._counts.hits += 1
                return entry.value
            generation = self._generation
        # No claim on the directory: a get() need not be followed by a put().
        found, value = (
            (False, None) if entry is not None or witness is None else self._from_lower_tiers(key, claim=False)
        )
        with self._lock:
            if not found:
                self._counts.misses += 1
                return MISS
            self._counts.hits += 1
            departures = self._store_found(key, value, generation)
        self._demote(departures)
        return value

    def put(self, key: CallKey | Hashable, value: Any) -> None:
        """Cache ``value`` under ``key`` as given (insert or overwrite), then evict over budget.

        Upstream's contract; a value larger than ``max_bytes`` is not kept.
        """
        keyed = type(key) is CallKey
        if keyed:
            identity = key.identity
            witness = freeze_witness(key.witness) if self.verify else None
        else:
            identity, witness = key, None
        nbytes = value_nbytes(value) + (0 if witness is None else witness_nbytes(witness))
        with self._lock:
            generation, directory_epoch = self._generation, self._directory_epoch()
            departures = self._store(identity, _Entry(value, witness, nbytes, keyed))
        self._demote(departures)
        if keyed:
            self._write_through(key, witness, value, generation, directory_epoch)

    def _store(self, identity: Hashable, entry: _Entry, counts: Counters | None = None) -> _Departures:
        """Insert or overwrite ``identity`` and evict to the budgets; the lock is held.

        Returns the entries that left device memory (evicted, or too large to keep), oldest first,
        for :meth:`_demote` to hand to the host tier once the lock is released. ``counts``: the
        counters of the method whose entry it is (default: :data:`ENCODE_PROMPT`'s).
        """
        counts = self._counts if counts is None else counts
        previous = self._entries.pop(identity, None)
        if previous is not None:
            self._bytes -= previous.nbytes
        if self.max_bytes is not None and entry.nbytes > self.max_bytes:
            counts.oversize_rejections += 1
            return self._departures([(identity, entry)])
        self._entries[identity] = entry
        self._bytes += entry.nbytes
        leaving = []
        while len(self._entries) > self.max_size or (self.max_bytes is not None and self._bytes > self.max_bytes):
            evicted = self._entries.popitem(last=False)
            self._bytes -= evicted[1].nbytes
            counts.evictions += 1
            leaving.append(evicted)
        return self._departures(leaving)

    def _departures(self, leaving: list[tuple[Hashable, _Entry]]) -> _Departures:
        """Return ``leaving`` with the host tier's epoch now; the lock is held (clear() bumps it under it)."""
        return _Departures(leaving, 0 if self.host is None else self.host.epoch)

    def _directory_epoch(self) -> int:
        """Return the directory tier's epoch now; the lock is held (clear() bumps it under it)."""
        return 0 if self.directory is None else self.directory.epoch

    def _store_found(self, key: CallKey, value: Any, generation: int) -> _Departures:
        """Store a value a lower tier served (unless a clear() came meanwhile); the lock is held."""
        if generation != self._generation:
            return _NO_DEPARTURES
        witness = freeze_witness(key.witness) if self.verify else None
        nbytes = value_nbytes(value) + (0 if witness is None else witness_nbytes(witness))
        return self._store(key.identity, _Entry(value, witness, nbytes))

    def _demote(self, departures: _Departures) -> None:
        """Move entries that left device memory to the host tier (if any); the lock is not held. Never raises:
        an entry the host cannot take (no pinned memory left) is dropped, as without a host tier."""
        if self.host is None:
            return
        for identity, entry in departures.entries:
            if not entry.keyed:  # lower tiers are looked up by CallKey only
                continue
            try:
                self.host.put(identity, entry.value, entry.witness, entry.nbytes, departures.host_epoch)
            except Exception as error:
                warn_once(f"an entry could not move to host memory ({type(error).__qualname__}); it was dropped")

    def _from_lower_tiers(self, key: CallKey, *, claim: bool = True, epoch: int | None = None) -> tuple[bool, Any]:
        """Return ``(True, value)`` from the host tier or the directory for a device miss, else ``(False, None)``.

        The value is on the devices the encoder's output was on. Never raises: a tier that fails
        is a miss.
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

    def _write_through(
        self, key: CallKey, witness: tuple[bytes, ...] | None, value: Any, generation: int, directory_epoch: int
    ) -> None:
        """Write an encoded entry to the directory tier, unless a clear() voided it meanwhile (then only
        give up its claim). Files always carry the key bytes, whatever this cache's ``verify``: another
        process reading them may verify. Never raises."""
        if self.directory is None:
            return
        if generation != self._generation:
            self.directory.release(key.identity, directory_epoch)
            return
        kept = witness if witness is not None else freeze_witness(key.witness)
        self.directory.save(key.identity, kept, value, directory_epoch)

    def _claim(self, key: CallKey) -> tuple[_Outcome, Any]:
        """Decide how ``key`` is served; the lock is held. Counts nothing: callers count calls or rows.

        Returns ``(HIT, value)``, ``(OWN, flight)``, ``(JOIN, flight)`` or ``(DIRECT, reason)``.
        """
        entry = self._entries.get(key.identity)
        if entry is not None:
            if entry.witness is None or witness_matches(entry.witness, key.witness):
                self._entries.move_to_end(key.identity)
                return _Outcome.HIT, entry.value
            return _Outcome.DIRECT, COLLISION_REASON
        flight = self._flights.get(key.identity)
        if flight is None:
            witness = freeze_witness(key.witness) if self.verify else None
            flight = self._flights[key.identity] = _Flight(witness, self._generation, self._directory_epoch())
            return _Outcome.OWN, flight
        if flight.witness is not None and not witness_matches(flight.witness, key.witness):
            return _Outcome.DIRECT, COLLISION_REASON
        if flight.owner == threading.get_ident():
            return _Outcome.DIRECT, REENTRANT_REASON
        flight.waiters += 1
        return _Outcome.JOIN, flight

    def get_or_compute(
        self, key: CallKey, compute: Callable[[], T], *, row: bool = False, method: str = ENCODE_PROMPT
    ) -> T:
        """Return the cached value for ``key``, or run ``compute`` once and cache its result.

        ``row``: the call is one row of a row layout, counted as a call and as a row. ``method``:
        the pipeline method whose call it is, for its counters.
        """
        counts = self._counters.of(method)
        while True:
            with self._lock:
                outcome, claimed = self._claim(key)
                if outcome is _Outcome.HIT:
                    counts.hits += 1
                    counts.row_hits += row
                    return claimed
                if outcome is _Outcome.DIRECT:
                    counts.bypass_reasons[claimed] += 1
                    if row:
                        counts.row_bypass_reasons[claimed] += 1
                        counts.rows_encoded += 1
            if outcome is _Outcome.DIRECT:
                return compute()
            if outcome is _Outcome.OWN:
                encoded = True  # unless a lower tier serves it
                try:
                    result, encoded = self._run_flight(key, claimed, compute, counts)
                    return result
                finally:
                    with self._lock:
                        if encoded:
                            counts.misses += 1
                            counts.row_misses += row
                            counts.rows_encoded += row
                        else:
                            counts.hits += 1
                            counts.row_hits += row
            claimed.done.wait()
            if not claimed.failed:
                with self._lock:
                    counts.hits += 1
                    counts.row_hits += row
                return claimed.value
            # The owner's encode raised and its caller got the error; try again ourselves.

    def get_or_compute_rows(
        self,
        keys: Sequence[CallKey],
        compute: Callable[[int], T],
        *,
        count_call: bool = True,
        method: str = ENCODE_PROMPT,
    ) -> tuple[list[T], int]:
        """Return a value for each of ``keys`` (the rows of one call), running ``compute(i)`` per missing row,
        and how many rows this call encoded.

        Rows with the same key (identity and witness) share one entry and one encode, of the first
        of them; ``compute(i)`` gets that row's index. Each distinct row is looked up, verified,
        encoded once across concurrent calls, and stored on its own. The call counts as a hit when
        it encoded no row itself. It encodes the rows it owns before it waits for rows other calls
        are encoding, so two calls waiting on each other cannot deadlock. ``count_call``: False when
        the caller counts the call itself (:meth:`record_call`). ``method``: whose counters.
        """
        values: list[Any] = [MISS] * len(keys)
        counts = self._counters.of(method)
        pending, copies = self._distinct_rows(keys)
        encoded = 0  # rows this call sent to the encoder, including one that raised
        succeeded = False
        try:
            while pending:
                claims = self._claim_rows(keys, pending, values, counts)
                owned = [(index, flight) for index, outcome, flight in claims if outcome is _Outcome.OWN]
                for position, (index, flight) in enumerate(owned):
                    try:
                        values[index], ran = self._run_flight(
                            keys[index], flight, functools.partial(compute, index), counts
                        )
                    except BaseException:
                        encoded += 1
                        self._abandon([(keys[later], unrun) for later, unrun in owned[position + 1 :]])
                        raise
                    encoded += ran
                    with self._lock:
                        if ran:
                            counts.row_misses += 1
                        else:
                            counts.row_hits += 1
                for index, outcome, _ in claims:
                    if outcome is _Outcome.DIRECT:
                        encoded += 1
                        values[index] = compute(index)
                pending = []
                for index, outcome, flight in claims:
                    if outcome is not _Outcome.JOIN:
                        continue
                    flight.done.wait()
                    if flight.failed:  # its owner's call raised; claim the row again
                        pending.append(index)
                        continue
                    values[index] = flight.value
                    with self._lock:
                        counts.row_hits += 1
            for index, first in copies:
                values[index] = values[first]
            succeeded = True
            return values, encoded
        finally:
            with self._lock:
                counts.rows_encoded += encoded
                if succeeded:
                    counts.row_hits += len(copies)
                if count_call and (encoded or not succeeded):
                    counts.misses += 1
                elif count_call:
                    counts.hits += 1

    def _distinct_rows(self, keys: Sequence[CallKey]) -> tuple[list[int], list[tuple[int, int]]]:
        """Return the first row of each distinct key, and ``(row, first row with its key)`` for the rest.

        Two rows share a key only if their witnesses match too (or verification is off, as for
        every hit); colliding rows stay apart, and the store serves the second one uncached.
        """
        firsts: list[int] = []
        copies: list[tuple[int, int]] = []
        seen: dict[Hashable, list[tuple[int, tuple[bytes, ...] | None]]] = {}  # identity -> (first row, witness)
        for index, key in enumerate(keys):
            same_identity = seen.setdefault(key.identity, [])
            first = next(
                (
                    earlier
                    for earlier, witness in same_identity
                    if witness is None or witness_matches(witness, key.witness)
                ),
                None,
            )
            if first is None:
                same_identity.append((index, freeze_witness(key.witness) if self.verify else None))
                firsts.append(index)
            else:
                copies.append((index, first))
        return firsts, copies

    def _claim_rows(
        self, keys: Sequence[CallKey], pending: Sequence[int], values: list[Any], counts: Counters
    ) -> list[tuple]:
        """Claim every pending row under the lock: fill hits into ``values``; return the other claims."""
        claims: list[tuple[int, _Outcome, Any]] = []
        with self._lock:
            try:
                for index in pending:
                    outcome, claimed = self._claim(keys[index])
                    if outcome is _Outcome.HIT:
                        counts.row_hits += 1
                        values[index] = claimed
                        continue
                    if outcome is _Outcome.DIRECT:
                        counts.row_bypass_reasons[claimed] += 1
                    claims.append((index, outcome, claimed))
            except BaseException:
                for index, outcome, flight in claims:  # never leave a claimed flight unrun
                    if outcome is _Outcome.OWN:
                        flight.failed = True
                        self._land(keys[index].identity, flight)
                        flight.done.set()
                raise
        return claims

    def _abandon(self, flights: list[tuple[CallKey, _Flight]]) -> None:
        """Retire flights whose encode will not run (an earlier row raised): their waiters try again."""
        with self._lock:
            for key, flight in flights:
                flight.failed = True
                self._land(key.identity, flight)
        for _, flight in flights:
            flight.done.set()

    def _run_flight(self, key: CallKey, flight: _Flight, compute: Callable[[], T], counts: Counters) -> tuple[T, bool]:
        """Serve an owned flight from a lower tier, or run ``compute`` (then write the result through);
        store the value and wake the waiters in every case. Returns the value and whether it was encoded."""
        has_lower_tier = self.host is not None or self.directory is not None
        try:
            found, result = (
                self._from_lower_tiers(key, epoch=flight.directory_epoch) if has_lower_tier else (False, None)
            )
            if not found:
                result = compute()
            value = result if found else detach_value(result)
            nbytes = value_nbytes(value) + (0 if flight.witness is None else witness_nbytes(flight.witness))
        except BaseException:  # the encode raised, or the lookup was interrupted
            self._abandon([(key, flight)])  # waiters try again; nothing is stored
            if self.directory is not None:  # other processes waiting for it encode it themselves
                self.directory.release(key.identity, flight.directory_epoch)
            raise
        departures = _NO_DEPARTURES
        with self._lock:
            flight.value = value
            self._land(key.identity, flight)
            # A clear() meanwhile voids the result (weights may have changed): return it, keep nothing.
            if flight.generation == self._generation:
                departures = self._store(key.identity, _Entry(value, flight.witness, nbytes), counts)
        flight.done.set()
        self._demote(departures)
        if not found:
            self._write_through(key, flight.witness, value, flight.generation, flight.directory_epoch)
        return result, not found

    def _land(self, identity: Hashable, flight: _Flight) -> None:
        """Retire ``flight``; a clear() may already have replaced it with a newer one. Lock held."""
        if self._flights.get(identity) is flight:
            del self._flights[identity]

    # Each count below is ``method``'s: the pipeline method whose call it was.

    def record_bypass(self, reason: str, *, method: str = ENCODE_PROMPT) -> None:
        """Count one call that did not use the cache, under ``reason``."""
        with self._lock:
            self._counters.of(method).bypass_reasons[reason] += 1

    def record_whole_call(self, reason: str, *, method: str = ENCODE_PROMPT) -> None:
        """Count one call of a pipeline with a row layout that was keyed as a whole, under ``reason``."""
        with self._lock:
            self._counters.of(method).whole_call_reasons[reason] += 1

    def record_rows_encoded(self, rows: int, *, method: str = ENCODE_PROMPT) -> None:
        """Count ``rows`` rows a whole call sends to the encoder (split calls count their own)."""
        with self._lock:
            self._counters.of(method).rows_encoded += rows

    def record_call(self, *, hit: bool, method: str = ENCODE_PROMPT) -> None:
        """Count one call as a hit (it ran no encoder) or a miss."""
        with self._lock:
            counts = self._counters.of(method)
            if hit:
                counts.hits += 1
            else:
                counts.misses += 1

    def record_audit(self, *, mismatch: bool, method: str = ENCODE_PROMPT) -> None:
        """Count a hit encoded again and compared with what was served (``mismatch``: they differed)."""
        with self._lock:
            counts = self._counters.of(method)
            counts.audits += 1
            counts.audit_mismatches += mismatch

    def record_layout_check(self, rows: int, gap: float | None, *, method: str = ENCODE_PROMPT) -> None:
        """Count one layout check whose uncached call encoded ``rows``; ``gap``: what it measured, None: mismatch."""
        with self._lock:
            counts = self._counters.of(method)
            counts.layout_checks += 1
            counts.layout_check_rows += rows
            if gap is None:
                counts.layout_mismatches += 1
            else:
                self._max_gap = max(self._max_gap, gap)

    def clear(self) -> None:
        """Drop every entry of every tier, and any result still being computed; counters are kept.

        For when entries are stale (new text-encoder weights): the host tier is emptied, and the
        directory tier fingerprints the weights again before its next use, so files of the old
        weights are never read. Callers already waiting on an encode get its result; callers
        arriving after the clear encode again.
        """
        with self._lock:
            self._entries.clear()
            self._flights.clear()
            self._bytes = 0
            self._generation += 1
            if self.host is not None:
                self.host.clear()
            if self.directory is not None:
                self.directory.invalidate()

    def release_device_memory(self) -> int:
        """Drop every entry from device memory (the worker goes to sleep); return how many there were.

        Entries still valid move to the host tier when there is one (oldest first, so the newest
        survive its budget); the directory tier already holds every encoded entry. Results still
        being computed are returned to their callers but not stored.
        """
        with self._lock:
            departures = self._departures(list(self._entries.items()))
            self._entries.clear()
            self._flights.clear()
            self._bytes = 0
            self._generation += 1
        self._demote(departures)
        return len(departures.entries)

    def snapshot(self) -> CacheStats:
        """Return the counters, sizes and settings now, as one :class:`CacheStats`."""
        moves = self.moves
        levels: dict[str, Any] = {}
        if moves is not None:  # outside the lock: a placement in progress holds the placement's lock
            levels.update(encoder_device_bytes=moves.device_bytes(), encoder_placer=moves.placer)
        with self._lock:
            counts = {
                name: ranked_reasons(value) if isinstance(value := self._count(name), Counter) else value
                for name in COUNTER_FIELDS
            }
            methods = self._counters.by_method()
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
            return CacheStats(
                **levels,
                size=len(self._entries),
                max_size=self.max_size,
                bypassed=sum(counts["bypass_reasons"].values()),
                bytes=self._bytes,
                max_bytes=self.max_bytes,
                enabled=self.enabled,
                verify=self.verify,
                layout_check_max_gap=self._max_gap,
                methods=methods,
                **counts,
            )

    def _count(self, name: str) -> Any:
        """Return one counter: the store's own, or a lower tier's (0 without that tier)."""
        if name not in TIER_COUNTERS:  # every method's, added
            return self._counters.total(name)
        tier_name, attribute = TIER_COUNTERS[name]
        tier = getattr(self, tier_name)
        if tier is None:
            return Counter() if name == "dir_rejections" else 0  # the one count by reason
        return getattr(tier, attribute)

    def stats(self) -> dict[str, Any]:
        """Return upstream's keys (size, max_size, hits, misses, bypassed) and ours, as a dict."""
        return self.snapshot().as_dict()
