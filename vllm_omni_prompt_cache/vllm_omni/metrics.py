"""The cache's Prometheus metrics, on the ``/metrics`` page vLLM-Omni's API server already serves.

The counts are made in the diffusion worker, where the cache lives; ``/metrics`` is served by the
API-server process, whose orchestrator receives every diffusion output together with a ``metrics``
dict (vLLM-Omni sends its scheduler's queue depth the same way). The counts ride along:

1. worker (:func:`patch_worker`): after each ``execute_*`` call, the cache's cumulative counters
   are attached to each ``DiffusionOutput`` it returns: one snapshot per forward, nothing per
   ``encode_prompt`` call, so the hit path is untouched;
2. stage process (:func:`patch_diffusion_engine`): ``DiffusionEngine.postprocess_output`` copies
   them into each request output's ``metrics`` as flat float keys (``prompt_embed_cache:*``), so
   any code that sums that dict still sees numbers;
3. API server (:func:`patch_orchestrator`): ``_absorb_diffusion_metrics`` pops those keys for the
   output's ``(stage, replica)`` and advances the counters by the difference from that cache's
   last snapshot. Snapshots are cumulative and numbered: the same one seen twice (every output of
   a batch carries it) counts once, one overtaken on the way by a later one is ignored, and an
   output lost on an error path loses nothing. Each cache object has its own epoch, so a new cache
   (the pipeline was rebuilt, the replica restarted) counts from zero, and several caches behind
   one replica label (data-parallel ranks) add up.

Families follow vLLM's style: counters for events (``vllm:prefix_cache_queries`` / ``_hits``
there), rates left to PromQL, gauges only for levels; labels as vLLM-Omni's own diffusion
families (``model_name``, ``stage``, ``replica``), recorded only when the engine runs with
``log_stats`` (``vllm serve`` does unless ``--disable-log-stats``). In prometheus_client's
multiprocess mode counters are summed across processes (one orchestrator increments each series)
and gauges keep the most recent value, as vLLM's own gauges do. With tensor or sequence
parallelism only the first rank returns outputs, so the series describe its cache (every rank
takes the same decisions: see ``docs/design.md``); with data-parallel ranks each returns its own
outputs, and the gauges show the cache that reported last.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import threading
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_omni_prompt_cache.counts.counters import (
    BYPASS_REASONS,
    CALL_COUNTS,
    COUNTS,
    HITS,
    METHOD_COUNTER_FIELDS,
    MISSES,
    VERIFICATION_FAILURES,
    ranked_reasons,
)
from vllm_omni_prompt_cache.counts.stats import COUNTER_FIELDS, CacheStats
from vllm_omni_prompt_cache.store.prompt_embed_cache import COLLISION_REASON, UNSPECIFIED_REASON, PromptEmbedCache
from vllm_omni_prompt_cache.vllm_omni.imports import replace_once

logger = logging.getLogger("vllm_omni_prompt_cache")

#: Attribute of a ``DiffusionOutput`` that carries the worker's snapshot to the stage process.
OUTPUT_ATTRIBUTE = "prompt_embed_cache_metrics"
#: Prefix of the keys in a request output's ``metrics`` dict; a per-reason count's reason follows a second colon.
KEY_PREFIX = "prompt_embed_cache:"
EPOCH_KEY = f"{KEY_PREFIX}epoch"
SEQUENCE_KEY = f"{KEY_PREFIX}sequence"
#: Prefix of one method's counts: ``prompt_embed_cache:by_method:<method>:<count>[:<reason>]``.
METHOD_KEY_PREFIX = f"{KEY_PREFIX}by_method:"
METRIC_PREFIX = "vllm_omni:prompt_embed_cache_"
LABELS = ("model_name", "stage", "replica")
#: Levels of a snapshot: what the cache holds and may hold when it was taken.
LEVELS = ("size", "bytes", "max_size", "max_bytes")
#: Levels of the tiers below device memory, each a gauge family of its name (a tier that is off has no series).
HOST_LEVELS = ("host_entries", "host_bytes", "host_max_bytes", "host_max_entries")
DIRECTORY_LEVELS = ("dir_files", "dir_bytes", "dir_max_bytes")
#: The text encoders' bytes on the device now, when something moves them (offload, or placement on a miss).
MOVE_LEVELS = ("encoder_device_bytes",)
#: The gauge families, by the level they show: (family, help). A level a snapshot lacks sets no series.
GAUGES = {
    "encoder_device_bytes": (
        "encoder_device_bytes",
        "Text-encoder bytes on the device now (a series only when something moves it).",
    ),
    "host_entries": ("host_entries", "Entries held in the host-memory tier now."),
    "host_bytes": ("host_bytes", "Bytes held in the host-memory tier now."),
    "host_max_bytes": ("host_max_bytes", "The host-memory tier's byte budget (no series when it has none)."),
    "host_max_entries": ("host_max_entries", "The host-memory tier's entry budget (no series when it has none)."),
    "dir_files": ("dir_files", "Files under the directory tier's root at this process's last scan."),
    "dir_bytes": ("dir_bytes", "Bytes of files under the directory tier's root, as this process counts."),
    "dir_max_bytes": ("dir_max_bytes", "The directory tier's byte budget (no series when unbounded)."),
    "size": ("entries", "Entries held now."),
    "bytes": ("bytes", "Bytes held now: embedding tensors and the key bytes kept to verify hits."),
    "max_size": ("max_entries", "Entry budget."),
    "max_bytes": ("max_bytes", "Byte budget (no series when unbounded)."),
}
#: Counter families worked out from several counts, the calls (hits, misses and bypasses): (help, labels after
#: the replica's). Every other counter family is a count's of the table, :data:`~..counters.COUNTS`.
QUERIES = "queries"
METHOD_QUERIES = "method_queries"
DERIVED_FAMILIES = {
    QUERIES: ("encode_prompt calls the prompt-embed cache saw: hits, misses and bypasses.", ()),
    METHOD_QUERIES: ("Calls of one cached pipeline method (label method): hits, misses and bypasses.", ("method",)),
}


def counter_families() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Return every counter family, by name: (help, labels after the replica's). The table's counts each
    advance their family, and their family per method (label ``method``) when they have one."""
    families = dict(DERIVED_FAMILIES)
    for count in COUNTS:
        declared = []
        if count.help is not None:
            declared.append((count.family, count.help, count.label_names))
        if count.by_method is not None:
            declared.append((*count.by_method, ("method", *count.label_names)))
        for name, documentation, labels in declared:
            if families.setdefault(name, (documentation, labels)) != (documentation, labels):
                raise ValueError(f"counter family {name} is declared twice, with other help or labels")
    return families


@dataclass(frozen=True)
class Snapshot:
    """One cache's cumulative counts, as the orchestrator reads them back from a ``metrics`` dict.

    ``epoch`` names the cache object (random, 52 bits); ``sequence`` orders its snapshots, so one
    that arrives after a later one is recognised as stale. ``levels`` holds only the levels the
    cache knows (vLLM-Omni's own cache does not count bytes).
    """

    epoch: int
    sequence: int
    stats: CacheStats
    levels: Mapping[str, float]


def encode_snapshot(
    stats: CacheStats, epoch: int, sequence: int, *, levels: tuple[str, ...] = LEVELS
) -> dict[str, float]:
    """Return ``stats`` as the flat ``{key: float}`` a request output's ``metrics`` dict carries."""
    flat = {EPOCH_KEY: float(epoch), SEQUENCE_KEY: float(sequence)}
    reasons = dict(stats.bypass_reasons)
    unexplained = stats.bypassed - sum(reasons.values())  # vLLM-Omni's own cache counts bypasses without reasons
    if unexplained > 0:
        reasons[UNSPECIFIED_REASON] = reasons.get(UNSPECIFIED_REASON, 0) + unexplained
    for count in COUNTS:
        value = reasons if count is BYPASS_REASONS else getattr(stats, count.name)
        if count.by_reason:
            flat.update({f"{KEY_PREFIX}{count.name}:{reason}": float(n) for reason, n in value.items()})
        else:
            flat[f"{KEY_PREFIX}{count.name}"] = float(value)
    if stats.host_on:  # the tiers that are on
        levels = (*levels, *HOST_LEVELS)
    if stats.directory is not None:
        levels = (*levels, *DIRECTORY_LEVELS)
    if stats.encoder_device_bytes is not None:
        levels = (*levels, *MOVE_LEVELS)
    for name in levels:
        if (value := getattr(stats, name)) is not None:
            flat[f"{KEY_PREFIX}{name}"] = float(value)
    for method, counts in stats.methods.items():
        for name, value in counts.items():
            if isinstance(value, Mapping):
                flat.update({f"{METHOD_KEY_PREFIX}{method}:{name}:{reason}": float(n) for reason, n in value.items()})
            else:
                flat[f"{METHOD_KEY_PREFIX}{method}:{name}"] = float(value)
    return flat


def pop_snapshot(metrics: dict[str, Any]) -> Snapshot | None:
    """Remove our keys from a request output's ``metrics`` dict; return what they said (None if absent)."""
    ours = {key: metrics.pop(key) for key in [key for key in metrics if key.startswith(KEY_PREFIX)]}
    if EPOCH_KEY not in ours:
        return None
    epoch, sequence = int(ours.pop(EPOCH_KEY)), int(ours.pop(SEQUENCE_KEY, 0))
    counts: dict[str, Any] = {}
    levels: dict[str, float] = {}
    methods: dict[str, dict[str, Any]] = {}
    for key, value in ours.items():
        if key.startswith(METHOD_KEY_PREFIX):
            method, _, rest = key[len(METHOD_KEY_PREFIX) :].partition(":")
            name, _, reason = rest.partition(":")
            if name not in METHOD_COUNTER_FIELDS:
                continue  # a count a later release added
            mine = methods.setdefault(method, {})
            if reason:
                mine.setdefault(name, {})[reason] = int(value)
            else:
                mine[name] = int(value)
            continue
        name, _, reason = key[len(KEY_PREFIX) :].partition(":")
        if reason:
            counts.setdefault(name, {})[reason] = int(value)
        elif name in GAUGES:  # a level
            levels[name] = float(value)
        else:
            counts[name] = int(value)
    known = {name: value for name, value in counts.items() if name in COUNTER_FIELDS}
    bypassed = sum(known.get(BYPASS_REASONS.name, {}).values())
    for mine in methods.values():  # a count by reason with no reason left is sent as nothing
        for count in CALL_COUNTS:
            mine.setdefault(count.name, {} if count.by_reason else 0)
            if count.by_reason:
                mine[count.name] = ranked_reasons(Counter(mine[count.name]))
    stats = CacheStats(
        **known, bypassed=bypassed, methods=methods, **{name: int(value) for name, value in levels.items()}
    )
    return Snapshot(epoch, sequence, stats, levels)


# --- worker: attach the snapshot -------------------------------------------------------------

_numbering: weakref.WeakKeyDictionary[Any, tuple[int, Iterator[int]]] = weakref.WeakKeyDictionary()
_numbering_lock = threading.Lock()


def next_snapshot_number(cache: Any) -> tuple[int, int]:
    """Return the cache object's epoch (the same for its lifetime; exact as a float) and its next sequence."""
    with _numbering_lock:
        numbering = _numbering.get(cache)
        if numbering is None:
            numbering = _numbering[cache] = (random.getrandbits(52), itertools.count(1))
        return numbering[0], next(numbering[1])


def cache_snapshot(cache: Any) -> dict[str, float] | None:
    """Return the flat snapshot of a runner's cache, ours or vLLM-Omni's own; None without one."""
    if cache is None:
        return None
    epoch, sequence = next_snapshot_number(cache)
    if isinstance(cache, PromptEmbedCache):
        return encode_snapshot(cache.snapshot(), epoch, sequence)
    # vLLM-Omni's own cache (backend "vllm-omni"): its five stats() keys, no bytes.
    return encode_snapshot(CacheStats.from_dict(cache.stats()), epoch, sequence, levels=("size", "max_size"))


def attach_snapshot(result: Any, snapshot: dict[str, float]) -> None:
    """Set the snapshot on every ``DiffusionOutput`` inside a worker's ``execute_*`` result."""
    if isinstance(result, dict):  # data-parallel execute_model: {"dp_rank": ..., "output": ...}
        result = result.get("output")
    runner_outputs = getattr(result, "runner_outputs", None)
    outputs = [each.result for each in runner_outputs] if runner_outputs is not None else [result]
    for output in outputs:
        if output is not None and hasattr(output, "stage_durations"):  # a DiffusionOutput
            setattr(output, OUTPUT_ATTRIBUTE, snapshot)


#: DiffusionWorker methods whose results reach the engine.
WORKER_EXECUTE_METHODS = ("execute_model", "execute_model_batch", "execute_stepwise")


def patch_worker(module: ModuleType) -> None:
    """Make ``DiffusionWorker``'s execute methods attach the cache's counters to their outputs."""
    for name in WORKER_EXECUTE_METHODS:
        replace_once(module.DiffusionWorker, name, _attaching_snapshot)


def _attaching_snapshot(execute: Any) -> Any:
    @functools.wraps(execute)
    def execute_then_attach(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = execute(self, *args, **kwargs)
        try:
            snapshot = cache_snapshot(getattr(getattr(self, "model_runner", None), "prompt_embed_cache", None))
            if snapshot is not None:
                attach_snapshot(result, snapshot)
        except Exception:  # metrics must never fail a forward
            logger.exception("vllm-omni-prompt-cache: could not attach the cache's counters to an output")
        return result

    return execute_then_attach


# --- stage process: copy it into the request outputs' metrics ---------------------------------


def patch_diffusion_engine(module: ModuleType) -> None:
    """Make ``DiffusionEngine.postprocess_output`` copy the worker's snapshot into each output's metrics."""
    replace_once(module.DiffusionEngine, "postprocess_output", _copying_snapshot)


def _copying_snapshot(postprocess_output: Any) -> Any:
    @functools.wraps(postprocess_output)
    def postprocess_then_copy(self: Any, *args: Any, **kwargs: Any) -> Any:
        request_outputs = postprocess_output(self, *args, **kwargs)
        try:
            output = args[1] if len(args) > 1 else kwargs.get("output")  # (request, output), as in 0.30
            snapshot = getattr(output, OUTPUT_ATTRIBUTE, None)
            for request_output in (request_outputs or ()) if snapshot else ():
                metrics = getattr(request_output, "metrics", None)
                if isinstance(metrics, dict):
                    metrics.update(snapshot)
        except Exception:  # metrics must never fail a request
            logger.exception("vllm-omni-prompt-cache: could not copy the cache's counters into an output")
        return request_outputs

    return postprocess_then_copy


# --- API server: count it ---------------------------------------------------------------------


class PromptEmbedCacheMetrics:
    """Our Prometheus families, and each cache's last snapshot to take differences from."""

    def __init__(self, registry: Any = None) -> None:
        """Register the families on ``registry`` (prometheus_client's default, which ``/metrics`` serves):
        a counter family for each of :func:`counter_families`, a gauge for each of :data:`GAUGES`."""
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry
        self.counters = {
            name: Counter(METRIC_PREFIX + name, documentation, labelnames=[*LABELS, *labels], registry=registry)
            for name, (documentation, labels) in counter_families().items()
        }
        self.gauges = {
            level: Gauge(
                METRIC_PREFIX + name,
                documentation,
                labelnames=list(LABELS),
                multiprocess_mode="mostrecent",
                registry=registry,
            )
            for level, (name, documentation) in GAUGES.items()
        }
        self._last: dict[tuple[tuple[str, str, str], int], Snapshot] = {}  # by (labels, epoch)
        self._labelled: set[tuple[str, str, str]] = set()
        self._methods_labelled: set[tuple[tuple[str, str, str], str]] = set()
        self._lock = threading.Lock()

    def record(self, labels: tuple[str, str, str], now: Snapshot) -> None:
        """Advance the counters of ``labels`` by what ``now``'s cache did since its last snapshot; set the levels.

        Each cache (epoch) is counted against its own last snapshot, so several caches behind one
        label set (data-parallel ranks of one replica) add up, and a snapshot older than one
        already counted changes nothing.
        """
        with self._lock:
            before = self._last.get((labels, now.epoch))
            if before is not None and now.sequence <= before.sequence:
                return  # already counted: a copy, or overtaken on the way by a later snapshot
            self._last[(labels, now.epoch)] = now
            if labels not in self._labelled:
                self._labelled.add(labels)
                self._create_series(labels)
            delta = now.stats if before is None else now.stats.since(before.stats)
            self._advance(QUERIES, labels, delta.calls)
            for count in COUNTS:
                if count.help is not None:
                    self._advance(count.family, (*labels, *count.label_values), getattr(delta, count.name))
            collisions = delta.bypass_reasons.get(COLLISION_REASON, 0) + delta.row_bypass_reasons.get(
                COLLISION_REASON, 0
            )
            self._advance(VERIFICATION_FAILURES, (*labels, "key"), collisions)
            for method, counts in delta.methods.items():
                self._record_method(labels, method, counts)
            for level, gauge in self.gauges.items():
                if level in now.levels:  # the most recent snapshot's cache
                    gauge.labels(*labels).set(now.levels[level])

    def _record_method(self, labels: tuple[str, str, str], method: str, counts: Mapping[str, Any]) -> None:
        """Advance the families by method by one method's counts since its cache's last snapshot."""
        series = (*labels, method)
        if (labels, method) not in self._methods_labelled:
            self._methods_labelled.add((labels, method))
            self.counters[METHOD_QUERIES].labels(*series)
            for count in COUNTS:
                if count.by_method is not None and not count.by_reason:
                    self.counters[count.by_method[0]].labels(*series, *count.label_values)
        calls = (
            counts.get(HITS.name, 0) + counts.get(MISSES.name, 0) + sum(counts.get(BYPASS_REASONS.name, {}).values())
        )
        self._advance(METHOD_QUERIES, series, calls)
        for count in COUNTS:
            if count.by_method is not None:
                amount = counts.get(count.name, {} if count.by_reason else 0)
                self._advance(count.by_method[0], (*series, *count.label_values), amount)

    def _advance(self, family: str, series: tuple[str, ...], amount: int | Mapping[str, int]) -> None:
        """Add ``amount`` to the family's series (counts by reason: each to its reason's series); skip what is
        not positive."""
        if isinstance(amount, Mapping):
            for reason, each in amount.items():
                self._advance(family, (*series, reason), each)
        elif amount > 0:
            self.counters[family].labels(*series).inc(amount)

    def _create_series(self, labels: tuple[str, str, str]) -> None:
        """Create the label set's series at zero, so ``/metrics`` shows them from the first output on: each
        one that no reason or method labels."""
        self.counters[QUERIES].labels(*labels)
        self.counters[VERIFICATION_FAILURES].labels(*labels, "key")
        for count in COUNTS:
            if count.help is not None and not count.by_reason:
                self.counters[count.family].labels(*labels, *count.label_values)


@functools.cache
def prompt_embed_cache_metrics() -> PromptEmbedCacheMetrics:
    """Return this process's families, registered on first use (processes without a cache register none)."""
    return PromptEmbedCacheMetrics()


def patch_orchestrator(module: ModuleType) -> None:
    """Make the orchestrator count the cache's snapshots that diffusion outputs carry."""
    replace_once(module.OrchestratorBase, "_absorb_diffusion_metrics", _counting_snapshots)


def _counting_snapshots(absorb: Any) -> Any:
    @functools.wraps(absorb)
    def absorb_and_count(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            stage_id, replica_id, diffusion_output = args[:3]  # as in 0.30; anything else is left alone
            metrics = getattr(diffusion_output, "metrics", None)
            snapshot = pop_snapshot(metrics) if isinstance(metrics, dict) else None
            if snapshot is not None and getattr(self, "log_stats", False):
                labels = (_model_name(self), str(stage_id), str(replica_id))
                prompt_embed_cache_metrics().record(labels, snapshot)
        except Exception:  # metrics must never break output routing
            logger.exception("vllm-omni-prompt-cache: could not record the cache's counters")
        return absorb(self, *args, **kwargs)

    return absorb_and_count


def _model_name(orchestrator: Any) -> str:
    """The ``model_name`` label vLLM-Omni's own families carry (the model the engine was started with)."""
    name = getattr(getattr(orchestrator, "_prom_metrics", None), "_model_name", None)
    if name is None:
        _warn_no_model_name()
        return ""
    return str(name)


@functools.cache
def _warn_no_model_name() -> None:
    logger.warning(
        "vllm-omni-prompt-cache: the orchestrator has no Prometheus model name (_prom_metrics._model_name); "
        'the cache\'s series carry model_name="".'
    )
