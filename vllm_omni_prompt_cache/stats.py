"""One snapshot of a cache's counts and levels: what ``stats()``, the worker RPC, ``/metrics``, the log
line and the demo show.

:class:`CacheStats` holds every :class:`~.counters.Counters` field (summed over methods, and by
method in ``methods``), the counts the tiers below device memory keep (:data:`TIER_COUNTERS`),
and levels: sizes, budgets and switches at the moment of the snapshot.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from vllm_omni_prompt_cache.counters import ENCODE_PROMPT, METHOD_COUNTER_FIELDS, ranked_reasons

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
COUNTER_FIELDS = METHOD_COUNTER_FIELDS + tuple(TIER_COUNTERS)


def tier_counts(**tiers: Any) -> dict[str, Any]:
    """Return every :data:`TIER_COUNTERS` count from ``tiers`` (by name; None: that tier is off, counted 0)."""
    counts = {}
    for name, (tier_name, attribute) in TIER_COUNTERS.items():
        tier = tiers[tier_name]
        if tier is None:
            counts[name] = {} if name == "dir_rejections" else 0  # the one count by reason
        else:
            value = getattr(tier, attribute)
            counts[name] = ranked_reasons(value) if isinstance(value, Counter) else value
    return counts


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
