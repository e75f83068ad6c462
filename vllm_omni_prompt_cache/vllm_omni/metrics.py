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

from vllm_omni_prompt_cache.counters import METHOD_COUNTER_FIELDS, REASON_FIELDS, ranked_reasons
from vllm_omni_prompt_cache.stats import COUNTER_FIELDS, TIER_COUNTERS, CacheStats
from vllm_omni_prompt_cache.store import COLLISION_REASON, UNSPECIFIED_REASON, PromptEmbedCache
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
HOST_LEVELS = ("host_entries", "host_bytes", "host_max_bytes")
DIRECTORY_LEVELS = ("dir_files", "dir_bytes", "dir_max_bytes")
#: The text encoders' bytes on the device now, when something moves them (offload, or placement on a miss).
MOVE_LEVELS = ("encoder_device_bytes",)
#: Counter families with no label of their own, by the :class:`CacheStats` count they advance by.
COUNTED = {
    "queries": "calls",
    "hits": "hits",
    "misses": "misses",
    "row_hits": "row_hits",
    "row_misses": "row_misses",
    "rows_encoded": "rows_encoded",
    "evictions": "evictions",
    "oversize_rejections": "oversize_rejections",
    "audits": "audits",
    # The tiers' counts, each its family's name; rejections are counted by reason (below).
    **{name: name for name in TIER_COUNTERS if name != "dir_rejections"},
}
#: Counter families labelled by the pipeline method whose calls they count, by the count they advance by
#: (calls are a method's hits, misses and bypasses; bypasses are counted by reason too).
COUNTED_BY_METHOD = {"method_hits": "hits", "method_misses": "misses", "method_rows_encoded": "rows_encoded"}


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
    for name in COUNTER_FIELDS:
        value = reasons if name == "bypass_reasons" else getattr(stats, name)
        if isinstance(value, Mapping):
            flat.update({f"{KEY_PREFIX}{name}:{reason}": float(count) for reason, count in value.items()})
        else:
            flat[f"{KEY_PREFIX}{name}"] = float(value)
    if stats.host_max_bytes is not None:  # the tiers that are on
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
        elif name in (*LEVELS, *HOST_LEVELS, *DIRECTORY_LEVELS, *MOVE_LEVELS):
            levels[name] = float(value)
        else:
            counts[name] = int(value)
    known = {name: value for name, value in counts.items() if name in COUNTER_FIELDS}
    bypassed = sum(known.get("bypass_reasons", {}).values())
    for mine in methods.values():  # a count by reason with no reason left is sent as nothing
        for name in METHOD_COUNTER_FIELDS:
            mine.setdefault(name, {} if name in REASON_FIELDS else 0)
        mine.update({name: ranked_reasons(Counter(mine[name])) for name in REASON_FIELDS})
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
        """Register the families on ``registry`` (prometheus_client's default, which ``/metrics`` serves)."""
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry

        def counter(name: str, documentation: str, *extra: str) -> Any:
            return Counter(METRIC_PREFIX + name, documentation, labelnames=[*LABELS, *extra], registry=registry)

        def gauge(name: str, documentation: str) -> Any:
            return Gauge(
                METRIC_PREFIX + name,
                documentation,
                labelnames=list(LABELS),
                multiprocess_mode="mostrecent",
                registry=registry,
            )

        self.queries = counter("queries", "encode_prompt calls the prompt-embed cache saw: hits, misses and bypasses.")
        self.hits = counter("hits", "encode_prompt calls served from the cache, without encoding.")
        self.misses = counter("misses", "encode_prompt calls that ran the text encoder and offered the result.")
        self.bypassed = counter(
            "bypassed", "encode_prompt calls that did not use the cache, by reason (bounded set).", "reason"
        )
        self.row_hits = counter("row_hits", "Rows of batched calls served without encoding them.")
        self.row_misses = counter(
            "row_misses", "Rows of batched calls encoded and offered to the cache (kept unless over a budget)."
        )
        self.row_bypassed = counter(
            "row_bypassed", "Rows of batched calls encoded without caching, by reason.", "reason"
        )
        self.rows_encoded = counter("rows_encoded", "Prompt rows that reached the text encoder (misses and bypasses).")
        self.whole_calls = counter(
            "whole_calls", "Batched calls cached as one entry instead of row by row, by reason.", "reason"
        )
        self.evictions = counter("evictions", "Entries evicted to stay within the entry or byte budget.")
        self.oversize_rejections = counter("oversize_rejections", "Results larger than the byte budget, not stored.")
        self.audits = counter("audits", "Hits encoded again and compared with what was served (check=audit fails).")
        self.verification_failures = counter(
            "verification_failures",
            "Exactness checks that failed: a key whose stored bytes differed (check=key, the call is encoded), "
            "a row layout whose rows differed from the uncached call (check=row_layout, rows turned off), "
            "or a hit whose fresh encode differed (check=audit, the cache turned off for the class).",
            "check",
        )
        self.method_queries = counter(
            "method_queries", "Calls of one cached pipeline method (label method): hits, misses and bypasses.", "method"
        )
        self.method_hits = counter("method_hits", "Calls of one cached method served without encoding.", "method")
        self.method_misses = counter("method_misses", "Calls of one cached method that ran the encoder.", "method")
        self.method_bypassed = counter(
            "method_bypassed", "Calls of one cached method that did not use the cache, by reason.", "method", "reason"
        )
        self.method_rows_encoded = counter(
            "method_rows_encoded", "Prompt rows one cached method sent to the text encoder.", "method"
        )
        self.host_hits = counter("host_hits", "Device-memory misses served from the host-memory tier.")
        self.host_misses = counter("host_misses", "Device-memory misses the host-memory tier did not hold.")
        self.host_demotions = counter(
            "host_demotions", "Entries moved from device memory to the host-memory tier (evicted, or at sleep)."
        )
        self.host_evictions = counter("host_evictions", "Entries dropped from the host-memory tier by its budget.")
        self.dir_hits = counter("dir_hits", "Misses in memory served from a file of the directory tier.")
        self.dir_misses = counter("dir_misses", "Misses in memory the directory tier had no usable file for.")
        self.dir_writes = counter("dir_writes", "Encoded entries written to the directory tier.")
        self.dir_write_errors = counter(
            "dir_write_errors", "Writes to the directory tier that failed (a full disk...); the entry stays in memory."
        )
        self.dir_evictions = counter(
            "dir_evictions", "Files removed from the directory tier to stay within its budget."
        )
        self.dir_waits = counter(
            "dir_waits", "Misses served by waiting for another process's encode of the same entry (then a hit)."
        )
        self.dir_stale_claims = counter(
            "dir_stale_claims",
            "Claims on directory entries taken over: their process was gone, or silent for the claim wait.",
        )
        self.dir_wait_timeouts = counter(
            "dir_wait_timeouts", "Waits for another process's encode that ended without its file (then encoded here)."
        )
        self.dir_leftovers_removed = counter(
            "dir_leftovers_removed", "Temporary and claim files of crashed processes removed from the directory tier."
        )
        self.dir_rejections = counter(
            "dir_rejections",
            "Files of the directory tier removed on read, by reason: truncated, corrupt, another namespace, "
            "other key bytes. Each is a miss, never an error or a wrong embedding.",
            "reason",
        )
        self.encoder_placements = counter(
            "encoder_placements",
            "Text-encoder moves onto the device (vLLM-Omni's module offload, or this cache's placement on a miss).",
        )
        self.encoder_evictions = counter("encoder_evictions", "Text-encoder moves off the device.")
        self.dit_placements = counter(
            "dit_placements", "DiT moves back onto the device that vLLM-Omni's module offload made after an encode."
        )
        self.dit_evictions = counter(
            "dit_evictions", "DiT moves to the host that vLLM-Omni's module offload made for an encode."
        )
        self.bytes_moved = counter("bytes_moved", "Bytes those moves copied between host and device.")
        self.placements_avoided = counter(
            "placements_avoided", "Text-encoder placements that calls served from the cache did not make."
        )
        self.bytes_not_moved = counter(
            "bytes_not_moved", "Bytes those avoided placements, and the DiT swaps they bring, would have copied."
        )
        self.encoder_device_bytes = gauge(
            "encoder_device_bytes", "Text-encoder bytes on the device now (a series only when something moves it)."
        )
        self.host_entries = gauge("host_entries", "Entries held in the host-memory tier now.")
        self.host_bytes = gauge("host_bytes", "Bytes held in the host-memory tier now.")
        self.host_max_bytes = gauge("host_max_bytes", "The host-memory tier's byte budget.")
        self.dir_files = gauge("dir_files", "Files under the directory tier's root at this process's last scan.")
        self.dir_bytes = gauge("dir_bytes", "Bytes of files under the directory tier's root, as this process counts.")
        self.dir_max_bytes = gauge("dir_max_bytes", "The directory tier's byte budget (no series when unbounded).")
        self.entries = gauge("entries", "Entries held now.")
        self.bytes = gauge("bytes", "Bytes held now: embedding tensors and the key bytes kept to verify hits.")
        self.max_entries = gauge("max_entries", "Entry budget.")
        self.max_bytes = gauge("max_bytes", "Byte budget (no series when unbounded).")
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

            def advance(family: Any, amount: int, *extra: str) -> None:
                if amount > 0:
                    family.labels(*labels, *extra).inc(amount)

            for family, count in COUNTED.items():
                advance(getattr(self, family), getattr(delta, count))
            for family, reasons in (
                (self.bypassed, delta.bypass_reasons),
                (self.row_bypassed, delta.row_bypass_reasons),
                (self.whole_calls, delta.whole_call_reasons),
                (self.dir_rejections, delta.dir_rejections),
            ):
                for reason, amount in reasons.items():
                    advance(family, amount, reason)
            for method, counts in delta.methods.items():
                reasons = counts.get("bypass_reasons", {})
                calls = counts.get("hits", 0) + counts.get("misses", 0) + sum(reasons.values())
                if (labels, method) not in self._methods_labelled:
                    self._methods_labelled.add((labels, method))
                    for family in (self.method_queries, *(getattr(self, name) for name in COUNTED_BY_METHOD)):
                        family.labels(*labels, method)
                advance(self.method_queries, calls, method)
                for family, count in COUNTED_BY_METHOD.items():
                    advance(getattr(self, family), counts.get(count, 0), method)
                for reason, amount in reasons.items():
                    advance(self.method_bypassed, amount, method, reason)
            collisions = delta.bypass_reasons.get(COLLISION_REASON, 0) + delta.row_bypass_reasons.get(
                COLLISION_REASON, 0
            )
            advance(self.verification_failures, collisions, "key")
            advance(self.verification_failures, delta.layout_mismatches, "row_layout")
            advance(self.verification_failures, delta.audit_mismatches, "audit")
            for name, family in (
                ("size", self.entries),
                ("bytes", self.bytes),
                ("max_size", self.max_entries),
                ("max_bytes", self.max_bytes),
            ):
                if name in now.levels:  # the most recent snapshot's cache
                    family.labels(*labels).set(now.levels[name])
            for name in (*HOST_LEVELS, *DIRECTORY_LEVELS, *MOVE_LEVELS):
                if name in now.levels:
                    getattr(self, name).labels(*labels).set(now.levels[name])

    def _create_series(self, labels: tuple[str, str, str]) -> None:
        """Create the label set's series at zero, so ``/metrics`` shows them from the first output on."""
        for family in COUNTED:
            getattr(self, family).labels(*labels)
        for check in ("key", "row_layout", "audit"):
            self.verification_failures.labels(*labels, check)


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
