"""The cache's Prometheus families: the snapshot's trip through a metrics dict, and the counting at the far end.

The whole path through real processes (worker, stage process, API server) is in
``test_serve_e2e.py``, which scrapes ``/metrics``; here each piece runs on its own, on a real cache
and real prometheus_client registries.
"""

from __future__ import annotations

import inspect
import pickle

import pytest
import torch

prometheus_client = pytest.importorskip("prometheus_client", reason="the metrics need prometheus_client (vLLM's)")
CollectorRegistry = prometheus_client.CollectorRegistry

from store_calls import get_or_compute_rows, record_bypass, record_whole_call  # noqa: E402

from vllm_omni_prompt_cache.calls.encoder_calls import ROWS_DEPEND  # noqa: E402
from vllm_omni_prompt_cache.keys.call_key import CallKeyBuilder  # noqa: E402
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings  # noqa: E402
from vllm_omni_prompt_cache.store.prompt_embed_cache import COLLISION_REASON, UNSPECIFIED_REASON, PromptEmbedCache  # noqa: E402
from vllm_omni_prompt_cache.vllm_omni.metrics import (  # noqa: E402  (after the skip)
    KEY_PREFIX,
    OUTPUT_ATTRIBUTE,
    PromptEmbedCacheMetrics,
    _attaching_snapshot,
    _copying_snapshot,
    attach_snapshot,
    cache_snapshot,
    pop_snapshot,
)

LABELS = {"model_name": "tiny-model", "stage": "0", "replica": "0"}


def _signature(prompt_ids):
    pass


BUILDER = CallKeyBuilder(inspect.signature(_signature), "tiny")


def key(token: int, length: int = 4):
    return BUILDER.build((torch.full((1, length), token),), {})


def embedding(token: int) -> torch.Tensor:
    return torch.full((1, 8), float(token))


def busy_cache() -> PromptEmbedCache:
    """A cache that has seen a miss, two hits, a bypass, rows, a whole call and an eviction."""
    cache = PromptEmbedCache(max_size=2, max_bytes=2**20)
    cache.get_or_compute(key(1), lambda: embedding(1))
    cache.get_or_compute(key(1), lambda: pytest.fail("cached"))
    cache.get_or_compute(key(1), lambda: pytest.fail("cached"))
    record_bypass(cache, "argument 'prompt_embeds': precomputed")
    get_or_compute_rows(cache, [key(2), key(3), key(2)], lambda row: embedding(row))  # evicts key(1)
    record_whole_call(cache, ROWS_DEPEND)
    return cache


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(f"vllm_omni:prompt_embed_cache_{name}", {**LABELS, **labels})


#: A bypass reason with a colon in it, as the reasons that name what an encode was handed do.
REASON_WITH_COLON = "reads self._h3_prompt_ids (a Holder), which cannot be keyed: none is cached"


def test_the_snapshot_rides_a_metrics_dict_as_floats_and_comes_back_whole() -> None:
    cache = busy_cache()
    stats = cache.snapshot()
    metrics = {"preprocess_time_ms": 1.5, **cache_snapshot(cache)}
    assert all(type(value) is float for value in metrics.values())  # what vLLM-Omni's accumulators sum
    snapshot = pop_snapshot(metrics)
    assert metrics == {"preprocess_time_ms": 1.5}  # ours gone, theirs kept
    assert snapshot.stats == stats  # every counter, reason and level
    assert snapshot.levels == {"size": 2.0, "bytes": float(stats.bytes), "max_size": 2.0, "max_bytes": 2.0**20}
    later = pop_snapshot(cache_snapshot(cache))
    assert later.epoch == snapshot.epoch and later.sequence == snapshot.sequence + 1
    assert pop_snapshot(cache_snapshot(PromptEmbedCache())).epoch != snapshot.epoch
    assert pop_snapshot({"preprocess_time_ms": 1.5}) is None
    assert cache_snapshot(None) is None


def test_counters_advance_by_what_happened_since_the_replicas_last_snapshot() -> None:
    registry = CollectorRegistry()
    families = PromptEmbedCacheMetrics(registry)
    cache = PromptEmbedCache(max_size=8)
    cache.get_or_compute(key(1), lambda: embedding(1))
    labels = tuple(LABELS.values())
    first = cache_snapshot(cache)
    families.record(labels, pop_snapshot(dict(first)))
    families.record(labels, pop_snapshot(dict(first)))  # every output of a batch carries the same snapshot
    assert (sample(registry, "misses_total"), sample(registry, "queries_total")) == (1.0, 1.0)
    assert sample(registry, "hits_total") == 0.0  # every series exists from the replica's first output on
    cache.get_or_compute(key(1), lambda: pytest.fail("cached"))
    cache.get_or_compute(key(1), lambda: pytest.fail("cached"))
    families.record(labels, pop_snapshot(cache_snapshot(cache)))
    assert (sample(registry, "hits_total"), sample(registry, "queries_total")) == (2.0, 3.0)
    assert (sample(registry, "entries"), sample(registry, "max_entries")) == (1.0, 8.0)
    assert sample(registry, "max_bytes") is None  # unbounded: no series
    # Another replica counts on its own series; a rebuilt cache (new epoch) counts from zero.
    families.record(("tiny-model", "0", "1"), pop_snapshot(cache_snapshot(cache)))
    assert sample(registry, "hits_total", replica="1") == 2.0 and sample(registry, "hits_total") == 2.0
    rebuilt = PromptEmbedCache(max_size=8)
    rebuilt.get_or_compute(key(1), lambda: embedding(1))
    families.record(labels, pop_snapshot(cache_snapshot(rebuilt)))
    assert (sample(registry, "misses_total"), sample(registry, "hits_total")) == (2.0, 2.0)
    assert sample(registry, "entries") == 1.0


def test_a_snapshot_overtaken_by_a_later_one_counts_nothing() -> None:
    """Outputs of one replica may reach the orchestrator out of order (each request is its own task)."""
    registry = CollectorRegistry()
    families = PromptEmbedCacheMetrics(registry)
    cache = PromptEmbedCache(max_size=8)
    snapshots = []
    for token in (1, 2, 3):
        cache.get_or_compute(key(token), lambda token=token: embedding(token))
        snapshots.append(cache_snapshot(cache))
    labels = tuple(LABELS.values())
    for index in (1, 0, 2):  # the second forward's output arrives first
        families.record(labels, pop_snapshot(dict(snapshots[index])))
    assert sample(registry, "misses_total") == 3.0
    assert sample(registry, "entries") == 3.0  # the stale one did not set the levels back


def test_several_caches_behind_one_replica_label_add_up() -> None:
    """Data-parallel ranks of one replica each return outputs, each rank with its own cache."""
    registry = CollectorRegistry()
    families = PromptEmbedCacheMetrics(registry)
    ranks = [PromptEmbedCache(max_size=8), PromptEmbedCache(max_size=8)]
    labels = tuple(LABELS.values())
    for token in range(5):
        for cache in ranks:
            cache.get_or_compute(key(token), lambda token=token: embedding(token))
            families.record(labels, pop_snapshot(cache_snapshot(cache)))
    assert sample(registry, "misses_total") == 10.0


def test_rows_bypasses_and_whole_calls_are_counted_by_reason() -> None:
    registry = CollectorRegistry()
    PromptEmbedCacheMetrics(registry).record(tuple(LABELS.values()), pop_snapshot(cache_snapshot(busy_cache())))
    assert sample(registry, "bypassed_total", reason="argument 'prompt_embeds': precomputed") == 1.0
    assert sample(registry, "whole_calls_total", reason=ROWS_DEPEND) == 1.0
    assert (sample(registry, "row_hits_total"), sample(registry, "row_misses_total")) == (1.0, 2.0)
    assert sample(registry, "rows_encoded_total") == 2.0
    assert sample(registry, "queries_total") == 5.0  # 3 get_or_compute + 1 bypass + 1 row call
    assert sample(registry, "evictions_total") == 1.0


def test_failed_exactness_checks_are_verification_failures() -> None:
    weak = CallKeyBuilder(inspect.signature(_signature), "tiny", digest=lambda buffer: b"x")  # every key collides
    cache = PromptEmbedCache()
    cache.get_or_compute(weak.build((torch.tensor([1]),), {}), lambda: embedding(1))
    cache.get_or_compute(weak.build((torch.tensor([2]),), {}), lambda: embedding(2))
    cache.record_layout_check(rows=2, gap=None)  # a batched call whose rows encoded alone differed from it
    cache.record_audit(mismatch=False)
    cache.record_audit(mismatch=True)  # a hit whose fresh encode differed
    registry = CollectorRegistry()
    PromptEmbedCacheMetrics(registry).record(tuple(LABELS.values()), pop_snapshot(cache_snapshot(cache)))
    assert sample(registry, "verification_failures_total", check="key") == 1.0
    assert sample(registry, "verification_failures_total", check="row_layout") == 1.0
    assert sample(registry, "verification_failures_total", check="audit") == 1.0
    assert sample(registry, "audits_total") == 2.0
    assert sample(registry, "bypassed_total", reason=COLLISION_REASON) == 1.0


def test_vllm_omnis_own_cache_is_counted_too_its_bypasses_without_reasons() -> None:
    pytest.importorskip("vllm_omni", reason="needs the vllm-omni extra")
    from vllm_omni_prompt_cache.vllm_omni.bindings import upstream_cache_module

    upstream = upstream_cache_module().PromptEmbedCache(max_size=4)
    upstream.hits, upstream.misses, upstream.bypassed = 3, 1, 2
    registry = CollectorRegistry()
    PromptEmbedCacheMetrics(registry).record(tuple(LABELS.values()), pop_snapshot(cache_snapshot(upstream)))
    assert (sample(registry, "hits_total"), sample(registry, "queries_total")) == (3.0, 6.0)
    assert sample(registry, "bypassed_total", reason=UNSPECIFIED_REASON) == 2.0


def test_every_diffusion_output_of_a_worker_result_carries_the_snapshot_through_pickle() -> None:
    pytest.importorskip("vllm_omni", reason="needs the vllm-omni extra")
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.worker.utils import BatchRunnerOutput, RunnerOutput

    snapshot = cache_snapshot(busy_cache())
    single, in_dict = DiffusionOutput(), DiffusionOutput()
    batch = BatchRunnerOutput.from_list(
        [
            RunnerOutput(request_id="a", finished=True, result=DiffusionOutput()),
            RunnerOutput(request_id="b", finished=False, result=None),  # a step of a request still denoising
        ]
    )
    for result in (single, {"dp_rank": 0, "output": in_dict}, batch):
        attach_snapshot(result, snapshot)
    for output in (single, in_dict, batch["a"].result):
        shipped = pickle.loads(pickle.dumps(output))  # as the worker's result queue sends it
        assert getattr(shipped, OUTPUT_ATTRIBUTE) == snapshot
    assert batch["b"].result is None
    assert all(key.startswith(KEY_PREFIX) for key in snapshot)


def test_the_orchestrator_pops_the_snapshot_and_counts_it_only_with_log_stats() -> None:
    pytest.importorskip("vllm_omni", reason="needs the vllm-omni extra")
    from types import SimpleNamespace

    from prometheus_client import REGISTRY
    from vllm_omni.engine.orchestrator import OrchestratorBase

    assert hasattr(OrchestratorBase._absorb_diffusion_metrics, "__wrapped__")  # the plugin's hook, in this process
    orchestrator = object.__new__(OrchestratorBase)  # only the attributes the absorb path reads
    orchestrator._prom_metrics = SimpleNamespace(_model_name="orchestrator-test")
    labels = {"model_name": "orchestrator-test", "stage": "3", "replica": "1"}
    snapshot = cache_snapshot(busy_cache())
    for log_stats in (False, True):
        orchestrator.log_stats = log_stats
        output = SimpleNamespace(request_id="req-1", metrics={"preprocess_time_ms": 2.0, **snapshot})
        assert orchestrator._absorb_diffusion_metrics(3, 1, output) is False  # a real output, routed on
        assert output.metrics == {"preprocess_time_ms": 2.0}
        hits = REGISTRY.get_sample_value("vllm_omni:prompt_embed_cache_hits_total", labels)
        assert hits == (2.0 if log_stats else None)


def test_the_worker_and_engine_wrappers_pass_the_snapshot_on_and_never_fail_the_call() -> None:
    pytest.importorskip("vllm_omni", reason="needs the vllm-omni extra")
    from types import SimpleNamespace

    from vllm_omni.diffusion.data import DiffusionOutput

    cache = busy_cache()
    worker = SimpleNamespace(model_runner=SimpleNamespace(prompt_embed_cache=cache))
    execute = _attaching_snapshot(lambda self, request: DiffusionOutput())
    output = execute(worker, "request")
    assert pop_snapshot(dict(getattr(output, OUTPUT_ATTRIBUTE))).stats == cache.snapshot()
    broken = SimpleNamespace(model_runner=SimpleNamespace(prompt_embed_cache=object()))  # no stats(): logged
    assert not hasattr(execute(broken, "request"), OUTPUT_ATTRIBUTE)
    request_outputs = [SimpleNamespace(metrics={"postprocess_time_ms": 1.0}), SimpleNamespace(metrics=None)]
    postprocess = _copying_snapshot(lambda self, request, output: request_outputs)
    assert postprocess(None, "request", output) is request_outputs
    assert pop_snapshot(request_outputs[0].metrics).stats == cache.snapshot()
    assert request_outputs[0].metrics == {"postprocess_time_ms": 1.0}


def test_the_tiers_below_device_memory_have_their_own_series(tmp_path) -> None:
    """Host and directory tiers of real caches: hits, writes, a corrupt file, and their levels."""
    from vllm_omni_prompt_cache import install_prompt_embed_cache
    from vllm_omni_prompt_cache.store.tiers.directory_files import CHECKSUM
    from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder

    encoder = build_qwen2_encoder()
    ids = [torch.tensor([[1, 2, token]]) for token in range(3)]
    writer = TokenIdTextPipeline(encoder)
    install_prompt_embed_cache(writer, max_size=8, settings=PromptEmbedCacheSettings(directory=tmp_path))
    for each in ids:
        writer.encode_prompt(each, torch.ones_like(each))
    damaged = sorted(tmp_path.glob("*/*.safetensors"))[0]
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 0x40  # one bit of the last tensor
    damaged.write_bytes(bytes(data))
    pipeline = TokenIdTextPipeline(encoder)
    cache = install_prompt_embed_cache(
        pipeline, max_size=1, settings=PromptEmbedCacheSettings(host_bytes=2**20, directory=tmp_path)
    )
    for each in (*ids, ids[0]):  # three from files or encoded again (the damaged one), then one from host memory
        pipeline.encode_prompt(each, torch.ones_like(each))
    registry = CollectorRegistry()
    families = PromptEmbedCacheMetrics(registry)
    families.record(tuple(LABELS.values()), pop_snapshot(cache_snapshot(cache)))
    stats = cache.snapshot()
    assert (stats.dir_hits, stats.host_hits, stats.dir_rejections) == (2, 1, {CHECKSUM: 1})
    assert sample(registry, "dir_hits_total") == 2.0
    assert sample(registry, "dir_rejections_total", reason=CHECKSUM) == 1.0
    assert sample(registry, "dir_writes_total") == 1.0  # the damaged one, encoded and written again
    assert sample(registry, "host_hits_total") == 1.0
    assert sample(registry, "host_demotions_total") == stats.host_demotions
    assert sample(registry, "host_entries") == stats.host_entries
    assert sample(registry, "host_max_bytes") == 2.0**20
    assert sample(registry, "dir_bytes") == stats.dir_bytes > 0
    assert sample(registry, "dir_max_bytes") == 16.0 * 2**30


def test_each_cached_method_has_its_own_series() -> None:
    """Calls of another encode method count on its own ``method`` series, and in the totals."""
    registry = CollectorRegistry()
    families = PromptEmbedCacheMetrics(registry)
    cache = PromptEmbedCache(max_size=8)
    labels = tuple(LABELS.values())
    cache.get_or_compute(key(1), lambda: embedding(1))
    cache.get_or_compute(key(2), lambda: embedding(2), method="encode_prompt_from_token_ids")
    cache.get_or_compute(key(2), lambda: pytest.fail("cached"), method="encode_prompt_from_token_ids")
    record_bypass(cache, REASON_WITH_COLON, method="encode_prompt_from_token_ids")  # a reason with ':'
    assert ":" in REASON_WITH_COLON
    families.record(labels, pop_snapshot(cache_snapshot(cache)))
    token_path = {"method": "encode_prompt_from_token_ids"}
    assert sample(registry, "method_queries_total", **token_path) == 3.0
    assert (
        sample(registry, "method_hits_total", **token_path),
        sample(registry, "method_misses_total", **token_path),
    ) == (1.0, 1.0)
    assert sample(registry, "method_bypassed_total", reason=REASON_WITH_COLON, **token_path) == 1.0
    assert sample(registry, "method_queries_total", method="encode_prompt") == 1.0
    assert (sample(registry, "queries_total"), sample(registry, "hits_total")) == (4.0, 1.0)  # the sums
    cache.get_or_compute(key(2), lambda: pytest.fail("cached"), method="encode_prompt_from_token_ids")
    families.record(labels, pop_snapshot(cache_snapshot(cache)))
    assert sample(registry, "method_hits_total", **token_path) == 2.0  # advanced by the difference
