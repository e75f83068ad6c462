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
   output's ``(stage, replica)`` and advances the counters by the difference from that replica's
   last snapshot. Snapshots are cumulative, so the same one seen twice (every output of a batch
   carries it) counts once, and an output lost on an error path loses nothing. A new cache (the
   pipeline was rebuilt, the replica restarted) has a new epoch and counts from zero.

Families follow vLLM's style: counters for events (``vllm:prefix_cache_queries`` / ``_hits``
there), rates left to PromQL, gauges only for levels; labels as vLLM-Omni's own diffusion
families (``model_name``, ``stage``, ``replica``), recorded only when the engine runs with
``log_stats`` (``vllm serve`` does unless ``--disable-log-stats``). In prometheus_client's
multiprocess mode counters are summed across processes (one orchestrator increments each series)
and gauges keep the most recent value, as vLLM's own gauges do. With tensor or sequence
parallelism only the first rank returns outputs, so the series describe its cache (every rank
takes the same decisions: see ``docs/design.md``).
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_omni_prompt_cache.store import COLLISION_REASON, UNSPECIFIED_REASON, CacheStats, PromptEmbedCache
from vllm_omni_prompt_cache.vllm_omni.imports import replace_once

logger = logging.getLogger("vllm_omni_prompt_cache")

#: Attribute of a ``DiffusionOutput`` that carries the worker's snapshot to the stage process.
OUTPUT_ATTRIBUTE = "prompt_embed_cache_metrics"
#: Prefix of the keys in a request output's ``metrics`` dict; a mapping's keys follow a second colon.
KEY_PREFIX = "prompt_embed_cache:"
EPOCH_KEY = f"{KEY_PREFIX}epoch"
METRIC_PREFIX = "vllm_omni:prompt_embed_cache_"
LABELS = ("model_name", "stage", "replica")

#: Counted events of a :class:`~vllm_omni_prompt_cache.store.CacheStats`, by field.
_SCALAR_COUNTS = ("hits", "misses", "evictions", "oversize_rejections", "row_hits", "row_misses", "rows_encoded")
_REASON_COUNTS = ("bypass_reasons", "row_bypass_reasons", "whole_call_reasons")
_LAYOUT_MISMATCHES = "layout_mismatches"
#: Levels: what the cache holds and may hold now.
_LEVELS = ("size", "bytes", "max_size", "max_bytes")


def encode_snapshot(stats: CacheStats, epoch: int) -> dict[str, float]:
    """Return ``stats`` as the flat ``{key: float}`` a request output's ``metrics`` dict carries."""
    flat = {EPOCH_KEY: float(epoch)}
    for name in (*_SCALAR_COUNTS, _LAYOUT_MISMATCHES):
        flat[f"{KEY_PREFIX}{name}"] = float(getattr(stats, name))
    reasons = dict(stats.bypass_reasons)
    unexplained = stats.bypassed - sum(reasons.values())  # upstream's cache counts bypasses without reasons
    if unexplained > 0:
        reasons[UNSPECIFIED_REASON] = reasons.get(UNSPECIFIED_REASON, 0) + unexplained
    for name, mapping in (
        ("bypass_reasons", reasons),
        ("row_bypass_reasons", stats.row_bypass_reasons),
        ("whole_call_reasons", stats.whole_call_reasons),
    ):
        for reason, count in mapping.items():
            flat[f"{KEY_PREFIX}{name}:{reason}"] = float(count)
    for name in _LEVELS:
        value = getattr(stats, name)
        if value is not None:
            flat[f"{KEY_PREFIX}{name}"] = float(value)
    return flat


@dataclass(frozen=True)
class Snapshot:
    """A worker's cumulative counts as the orchestrator reads them back from a ``metrics`` dict."""

    epoch: int
    counts: Mapping[str, int]  # scalar counts by field name
    reasons: Mapping[str, Mapping[str, int]]  # per-reason counts by field name
    levels: Mapping[str, float]


def pop_snapshot(metrics: dict[str, Any]) -> Snapshot | None:
    """Remove our keys from a request output's ``metrics`` dict; return what they said (None if absent)."""
    if EPOCH_KEY not in metrics:
        return None
    ours = {key: metrics.pop(key) for key in [key for key in metrics if key.startswith(KEY_PREFIX)]}
    epoch = int(ours.pop(EPOCH_KEY))
    counts: dict[str, int] = {}
    reasons: dict[str, dict[str, int]] = {name: {} for name in _REASON_COUNTS}
    levels: dict[str, float] = {}
    for key, value in ours.items():
        name, _, reason = key[len(KEY_PREFIX) :].partition(":")
        if name in reasons and reason:
            reasons[name][reason] = int(value)
        elif name in _LEVELS:
            levels[name] = float(value)
        else:
            counts[name] = int(value)
    return Snapshot(epoch, counts, reasons, levels)


# --- worker: attach the snapshot -------------------------------------------------------------

_epochs: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_epochs_lock = threading.Lock()


def cache_epoch(cache: Any) -> int:
    """Return a number naming this cache object for its lifetime (exact as a float: 52 bits)."""
    with _epochs_lock:
        epoch = _epochs.get(cache)
        if epoch is None:
            epoch = _epochs[cache] = random.getrandbits(52)
        return epoch


def cache_snapshot(cache: Any) -> dict[str, float] | None:
    """Return the flat snapshot of a runner's cache, ours or vLLM-Omni's own; None without one."""
    if cache is None:
        return None
    # vLLM-Omni's own cache (backend "vllm-omni") has only its five stats() keys.
    stats = cache.snapshot() if isinstance(cache, PromptEmbedCache) else CacheStats.from_dict(cache.stats())
    return encode_snapshot(stats, cache_epoch(cache))


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
    def postprocess_then_copy(self: Any, request: Any, output: Any, *args: Any, **kwargs: Any) -> Any:
        request_outputs = postprocess_output(self, request, output, *args, **kwargs)
        snapshot = getattr(output, OUTPUT_ATTRIBUTE, None)
        if snapshot:
            for request_output in request_outputs or ():
                metrics = getattr(request_output, "metrics", None)
                if isinstance(metrics, dict):
                    metrics.update(snapshot)
        return request_outputs

    return postprocess_then_copy


# --- API server: count it ---------------------------------------------------------------------


class PromptEmbedCacheMetrics:
    """Our Prometheus families, and each replica's last snapshot to take differences from."""

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
        self.row_misses = counter("row_misses", "Rows of batched calls encoded and offered to the cache.")
        self.row_bypassed = counter(
            "row_bypassed", "Rows of batched calls encoded without caching, by reason.", "reason"
        )
        self.rows_encoded = counter("rows_encoded", "Prompt rows that reached the text encoder (misses and bypasses).")
        self.whole_calls = counter(
            "whole_calls", "Batched calls cached as one entry instead of row by row, by reason.", "reason"
        )
        self.evictions = counter("evictions", "Entries evicted to stay within the entry or byte budget.")
        self.oversize_rejections = counter("oversize_rejections", "Results larger than the byte budget, not stored.")
        self.verification_failures = counter(
            "verification_failures",
            "Exactness checks that failed: a key whose stored bytes differed (check=key, the call is encoded), "
            "or a row layout whose rows differed from the uncached call (check=row_layout, rows turned off).",
            "check",
        )
        self.entries = gauge("entries", "Entries held now.")
        self.bytes = gauge("bytes", "Bytes held now: embedding tensors and the key bytes kept to verify hits.")
        self.max_entries = gauge("max_entries", "Entry budget.")
        self.max_bytes = gauge("max_bytes", "Byte budget (no series when unbounded).")
        self._last: dict[tuple[str, str, str], Snapshot] = {}
        self._lock = threading.Lock()

    def record(self, labels: tuple[str, str, str], now: Snapshot) -> None:
        """Advance the counters of ``labels`` by what happened since its last snapshot; set the levels."""
        with self._lock:
            before = self._last.get(labels)
            self._last[labels] = now
            counts, reasons = _difference(now, before if before is not None and before.epoch == now.epoch else None)

            def advance(family: Any, amount: int, *extra: str) -> None:
                if amount > 0:
                    family.labels(*labels, *extra).inc(amount)

            for name in _SCALAR_COUNTS:
                advance(getattr(self, name), counts[name])
            for field, family in zip(_REASON_COUNTS, (self.bypassed, self.row_bypassed, self.whole_calls), strict=True):
                for reason, amount in reasons[field].items():
                    advance(family, amount, reason)
            advance(self.queries, counts["hits"] + counts["misses"] + sum(reasons["bypass_reasons"].values()))
            collisions = reasons["bypass_reasons"].get(COLLISION_REASON, 0)
            collisions += reasons["row_bypass_reasons"].get(COLLISION_REASON, 0)
            advance(self.verification_failures, collisions, "key")
            advance(self.verification_failures, counts[_LAYOUT_MISMATCHES], "row_layout")
            for name, family in (("size", self.entries), ("bytes", self.bytes), ("max_size", self.max_entries)):
                family.labels(*labels).set(now.levels.get(name, 0.0))
            if "max_bytes" in now.levels:
                self.max_bytes.labels(*labels).set(now.levels["max_bytes"])


def _difference(now: Snapshot, before: Snapshot | None) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Return the counts since ``before`` (all of them without one); a count never goes back."""

    def since(current: Mapping[str, int], earlier: Mapping[str, int], key: str) -> int:
        return max(current.get(key, 0) - earlier.get(key, 0), 0)

    earlier_counts = {} if before is None else before.counts
    counts = {name: since(now.counts, earlier_counts, name) for name in (*_SCALAR_COUNTS, _LAYOUT_MISMATCHES)}
    reasons = {}
    for field in _REASON_COUNTS:
        current, earlier = now.reasons.get(field, {}), {} if before is None else before.reasons.get(field, {})
        reasons[field] = {reason: since(current, earlier, reason) for reason in current}
    return counts, reasons


@functools.cache
def prompt_embed_cache_metrics() -> PromptEmbedCacheMetrics:
    """Return this process's families, registered on first use (processes without a cache register none)."""
    return PromptEmbedCacheMetrics()


def patch_orchestrator(module: ModuleType) -> None:
    """Make the orchestrator count the cache's snapshots that diffusion outputs carry."""
    replace_once(module.OrchestratorBase, "_absorb_diffusion_metrics", _counting_snapshots)


def _counting_snapshots(absorb: Any) -> Any:
    @functools.wraps(absorb)
    def absorb_and_count(self: Any, stage_id: int, replica_id: int, diffusion_output: Any) -> Any:
        metrics = getattr(diffusion_output, "metrics", None)
        if isinstance(metrics, dict):
            try:
                snapshot = pop_snapshot(metrics)
                if snapshot is not None and getattr(self, "log_stats", False):
                    labels = (_model_name(self), str(stage_id), str(replica_id))
                    prompt_embed_cache_metrics().record(labels, snapshot)
            except Exception:  # metrics must never break output routing
                logger.exception("vllm-omni-prompt-cache: could not record the cache's counters")
        return absorb(self, stage_id, replica_id, diffusion_output)

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
