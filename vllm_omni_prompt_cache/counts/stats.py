"""One snapshot of a cache's counts and levels: what ``stats()``, the worker RPC, ``/metrics``, the log
line and the demo show.

:class:`CacheStats` declares the levels (sizes, budgets and switches at the moment of the snapshot)
and gets a field for every counter of the table, :data:`~.counters.COUNTS`: those calls make
(summed over methods, and by method in ``methods``) and those the tiers below device memory and the
encoder moves keep, which they report through ``counts()`` (:func:`kept_counts`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from vllm_omni_prompt_cache.counts.counters import (
    BYPASS_REASONS,
    COUNTS,
    ENCODE_PROMPT,
    HITS,
    MISSES,
    Count,
    Keeper,
    count_fields,
    ranked_reasons,
    with_fields,
)

#: The counters, by name: what snapshots copy, ``since`` subtracts and ``merged`` adds.
COUNTER_FIELDS = tuple(count.name for count in COUNTS)
#: Upstream's ``stats()`` keys, which come first in a snapshot, in upstream's order.
UPSTREAM_KEYS = ("size", "max_size", HITS.name, MISSES.name, "bypassed")
#: Where the counts of each keeper go among the snapshot's levels: before this level (else before ``methods``).
COUNTS_BEFORE = {
    Keeper.CALLS: "bypassed",
    Keeper.HOST: "host_entries",
    Keeper.DIRECTORY: "dir_files",
    Keeper.MOVES: "encoder_device_bytes",
}


def kept_counts(reported: Mapping[Count, Any]) -> dict[str, Any]:
    """Return every count calls do not make, by field, from what their keepers reported through ``counts()`` (a
    count no keeper reported, its tier off or nothing moving the encoders, is 0)."""
    return {
        count.name: reported.get(count, {} if count.by_reason else 0)
        for count in COUNTS
        if count.kept_by is not Keeper.CALLS
    }


def with_counts(levels: type) -> type:
    """Give a snapshot class whose body declares its levels a field for every count, for ``@dataclass``: each
    keeper's counts before the level :data:`COUNTS_BEFORE` names, upstream's keys first."""
    counts = count_fields(COUNTS, Mapping[str, int], dict)
    before: dict[str, list[str]] = {}
    for count in COUNTS:
        before.setdefault(COUNTS_BEFORE.get(count.kept_by, "methods"), []).append(count.name)
    fields: dict[str, tuple[Any, Any]] = {}
    for name, hint in levels.__annotations__.items():
        if name in counts:
            raise TypeError(f"{levels.__name__} declares {name}, a count of the table, as a level")
        fields.update({count: counts[count] for count in before.pop(name, [])})
        fields[name] = (hint, levels.__dict__[name])
    if before:
        raise TypeError(f"{levels.__name__} has no level {', '.join(before)} to place counts before")
    return with_fields({**{name: fields[name] for name in UPSTREAM_KEYS}, **fields})(levels)


@dataclasses.dataclass(frozen=True)
@with_counts
class CacheStats:
    """One snapshot of a cache: its levels, declared here, and its counts, one field for each entry of the
    table (:data:`~.counters.COUNTS`), of the same name.

    Counts are integers, or mappings of counts by reason (most common first); levels describe the
    cache at the moment of the snapshot.
    """

    # Upstream's stats() keys first, in its order (hits and misses are counts); ours after.
    size: int = 0
    max_size: int = 0
    bypassed: int = 0  # upstream's count: the sum of bypass_reasons
    bytes: int = 0
    max_bytes: int | None = None
    enabled: bool = True
    verify: bool = True
    #: The largest difference a passing layout check measured (relative to each row's largest value).
    layout_check_max_gap: float = 0.0
    # The host-memory tier (keeps None: no host tier; a budget None: none of that kind).
    host_entries: int = 0
    host_bytes: int = 0
    host_max_bytes: int | None = None
    host_max_entries: int | None = None
    host_keeps: str | None = None  # "departures" (evictions and sleep) or "sleep_departures" (a sleep's only)
    # The directory tier (directory None: no directory tier).
    dir_files: int = 0  # under the root at this process's last rescan
    dir_bytes: int = 0  # that rescan plus this process's writes since
    dir_max_bytes: int | None = None
    directory: str | None = None
    dir_off_reason: str | None = None  # why the directory tier is not used now (None: in use)
    # The text encoders' moves (placer None: nothing moves them).
    encoder_device_bytes: int | None = None  # text-encoder bytes on the device at the snapshot (None: not known)
    encoder_placer: str | None = None  # who moves the text encoders: vLLM-Omni's module offload, "on a miss"
    #: The counts calls make (:data:`~.counters.CALL_COUNTS`, by name) by the pipeline method that made them;
    #: the counts of the same names are their sums. A method the cache wraps appears from install on.
    methods: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def host_on(self) -> bool:
        """Whether there is a host-memory tier (a snapshot rebuilt from /metrics levels has its budgets only)."""
        return self.host_keeps is not None or self.host_max_bytes is not None or self.host_max_entries is not None

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
        host_entry_budgets = [each.host_max_entries for each in snapshots]
        on_devices = [each.encoder_device_bytes for each in snapshots if each.encoder_device_bytes is not None]
        return dataclasses.replace(
            first,  # the directory's levels are the first replica's view of a directory they share
            max_bytes=None if None in budgets else sum(budgets),
            host_max_bytes=None if None in host_budgets else sum(host_budgets),
            host_max_entries=None if None in host_entry_budgets else sum(host_entry_budgets),
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
        if self.host_on:
            of_entries = "" if self.host_max_entries is None else f" of {self.host_max_entries}"
            of_bytes = "" if self.host_max_bytes is None else f" of {self.host_max_bytes / 2**20:.1f}"
            tiers += (
                f"; host{' (sleep only)' if self.host_keeps == 'sleep_departures' else ''}: {self.host_hits} hits, "
                f"{self.host_entries}{of_entries} entries, {self.host_bytes / 2**20:.1f}{of_bytes} MiB, "
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
            if counts.get(HITS.name) or counts.get(MISSES.name) or counts.get(BYPASS_REASONS.name)
        }
        if len(used) > 1 or (used and ENCODE_PROMPT not in used):
            tiers += "; by method: " + ", ".join(
                f"{method} {counts.get(HITS.name, 0)} hits {counts.get(MISSES.name, 0)} misses "
                f"{sum(counts.get(BYPASS_REASONS.name, {}).values())} bypassed"
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
