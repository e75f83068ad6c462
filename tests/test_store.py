"""Where entries live: LRU order, entry and byte budgets, statistics, single-flight, failures."""

from __future__ import annotations

import dataclasses
import inspect
import threading
import time

import numpy as np
import pytest
import torch
from store_calls import record_bypass

from vllm_omni_prompt_cache.keys.call_key import CallKey, CallKeyBuilder
from vllm_omni_prompt_cache.store.prompt_embed_cache import (
    COLLISION_REASON,
    MISS,
    REENTRANT_REASON,
    UNSPECIFIED_REASON,
    CacheStats,
    PromptEmbedCache,
)
from vllm_omni_prompt_cache.store.values import detach_value, unaliased, value_nbytes


def _signature(prompt_ids):
    pass


BUILDER = CallKeyBuilder(inspect.signature(_signature), "tiny")


def key(token: int, length: int = 4) -> CallKey:
    return BUILDER.build((torch.full((1, length), token),), {})


def embedding(token: int, width: int = 8) -> torch.Tensor:
    return torch.full((1, width), float(token))


def test_hit_returns_the_stored_value_and_counts() -> None:
    cache = PromptEmbedCache(max_size=4)
    first = cache.get_or_compute(key(1), lambda: embedding(1))
    again = cache.get_or_compute(key(1), lambda: pytest.fail("must not recompute"))
    assert torch.equal(first, again)
    assert cache.snapshot().calls == 2 and (cache.hits, cache.misses) == (1, 1)


def test_lru_evicts_least_recently_used() -> None:
    cache = PromptEmbedCache(max_size=2)
    cache.get_or_compute(key(1), lambda: embedding(1))
    cache.get_or_compute(key(2), lambda: embedding(2))
    cache.get_or_compute(key(1), lambda: pytest.fail("1 is cached"))  # 1 becomes most recent
    cache.get_or_compute(key(3), lambda: embedding(3))  # evicts 2
    computed = []
    cache.get_or_compute(key(2), lambda: computed.append(2) or embedding(2))
    assert computed == [2]
    stats = cache.stats()
    assert stats["evictions"] == 2
    assert stats["size"] == 2


def test_byte_budget_counts_values_and_witness_and_is_never_exceeded() -> None:
    # Each entry: a 1x64 float32 value (256 B) + a 1x4 int64 witness (32 B) = 288 B.
    cache = PromptEmbedCache(max_size=100, max_bytes=3 * 288)
    for token in range(10):
        cache.get_or_compute(key(token), lambda token=token: embedding(token, width=64))
        assert cache.stats()["bytes"] <= 3 * 288
    stats = cache.stats()
    assert stats["size"] == 3
    assert stats["bytes"] == 3 * 288
    assert stats["evictions"] == 7


def test_a_value_larger_than_the_budget_is_returned_but_not_stored() -> None:
    cache = PromptEmbedCache(max_size=4, max_bytes=100)
    value = cache.get_or_compute(key(1), lambda: embedding(1, width=64))
    assert value.shape == (1, 64)
    stats = cache.stats()
    assert (stats["size"], stats["bytes"], stats["oversize_rejections"]) == (0, 0, 1)


def test_shared_storage_is_counted_once() -> None:
    base = torch.zeros(10, 10)
    assert value_nbytes((base, base[1:], [base[:2]])) == base.untyped_storage().nbytes()


def test_values_are_detached_and_named_tuples_survive() -> None:
    from collections import namedtuple

    Output = namedtuple("Output", "embeds mask")
    leaf = torch.ones(2, requires_grad=True)
    detached = detach_value(Output(leaf * 2, [leaf]))
    assert isinstance(detached, Output)
    assert not detached.embeds.requires_grad
    assert not detached.mask[0].requires_grad


def test_clear_drops_entries_and_keeps_counters() -> None:
    cache = PromptEmbedCache(max_size=4)
    cache.get_or_compute(key(1), lambda: embedding(1))
    cache.clear()
    stats = cache.stats()
    assert (stats["size"], stats["bytes"], stats["misses"]) == (0, 0, 1)


def test_upstream_stat_keys_are_kept() -> None:
    stats = PromptEmbedCache().stats()
    assert {"size", "max_size", "hits", "misses", "bypassed"} <= stats.keys()


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "8"])
def test_bad_sizes_are_rejected(bad) -> None:
    with pytest.raises(ValueError, match="max_size"):
        PromptEmbedCache(max_size=bad)
    with pytest.raises(ValueError, match="max_bytes"):
        PromptEmbedCache(max_bytes=bad)


def test_a_failed_compute_reaches_its_caller_and_caches_nothing() -> None:
    cache = PromptEmbedCache()

    def boom():
        raise RuntimeError("encoder failed")

    with pytest.raises(RuntimeError, match="encoder failed"):
        cache.get_or_compute(key(1), boom)
    assert cache.stats()["size"] == 0
    assert torch.equal(cache.get_or_compute(key(1), lambda: embedding(1)), embedding(1))


def test_identity_match_with_different_bytes_is_a_counted_bypass() -> None:
    weak = CallKeyBuilder(inspect.signature(_signature), "tiny", digest=lambda buffer: b"x")
    cache = PromptEmbedCache()
    first = weak.build((torch.tensor([1]),), {})
    other = weak.build((torch.tensor([2]),), {})
    assert first.identity == other.identity
    cache.get_or_compute(first, lambda: embedding(1))
    assert torch.equal(cache.get_or_compute(other, lambda: embedding(2)), embedding(2))
    assert cache.stats()["bypass_reasons"] == {COLLISION_REASON: 1}


def wait_for_waiters(cache: PromptEmbedCache, call_key: CallKey, count: int) -> None:
    """Block until ``count`` callers wait on the flight computing ``call_key`` (fails after 10 s)."""
    for _ in range(10_000):
        if cache.flights.waiters(call_key.identity) >= count:
            return
        time.sleep(0.001)
    pytest.fail(f"{count} waiters never arrived")


def test_single_flight_runs_one_encode_for_concurrent_identical_misses() -> None:
    cache = PromptEmbedCache()
    started = threading.Event()
    release = threading.Event()
    runs = []

    def slow_encode():
        runs.append(1)
        started.set()
        release.wait(5)
        return embedding(7)

    results = []
    owner = threading.Thread(target=lambda: results.append(cache.get_or_compute(key(7), slow_encode)))
    owner.start()
    started.wait(5)
    waiters = [
        threading.Thread(target=lambda: results.append(cache.get_or_compute(key(7), slow_encode))) for _ in range(5)
    ]
    for thread in waiters:
        thread.start()
    wait_for_waiters(cache, key(7), 5)  # every waiter is blocked on the owner's encode
    release.set()
    for thread in [owner, *waiters]:
        thread.join(10)
    assert len(runs) == 1
    assert len(results) == 6 and all(torch.equal(r, embedding(7)) for r in results)
    assert (cache.hits, cache.misses) == (5, 1)


def test_waiters_retry_when_the_single_flight_owner_fails() -> None:
    cache = PromptEmbedCache()
    started = threading.Event()
    release = threading.Event()
    attempts = []

    def flaky_encode():
        attempts.append(threading.get_ident())
        if len(attempts) == 1:
            started.set()
            release.wait(5)
            raise RuntimeError("first run fails")
        return embedding(3)

    errors, results = [], []

    def call():
        try:
            results.append(cache.get_or_compute(key(3), flaky_encode))
        except RuntimeError as error:
            errors.append(error)

    owner = threading.Thread(target=call)
    owner.start()
    started.wait(5)
    waiter = threading.Thread(target=call)
    waiter.start()
    wait_for_waiters(cache, key(3), 1)  # the waiter is blocked on the encode that will fail
    release.set()
    owner.join(10)
    waiter.join(10)
    assert len(errors) == 1 and len(results) == 1
    assert len(attempts) == 2 and attempts[0] != attempts[1]  # the waiter retried, as the new owner
    assert torch.equal(results[0], embedding(3))
    assert (cache.hits, cache.misses, cache.stats()["size"]) == (0, 2, 1)


def test_reentrant_identical_call_computes_instead_of_deadlocking() -> None:
    cache = PromptEmbedCache()

    def outer():
        return cache.get_or_compute(key(1), lambda: embedding(1))

    assert torch.equal(cache.get_or_compute(key(1), outer), embedding(1))
    assert cache.stats()["bypass_reasons"] == {REENTRANT_REASON: 1}


def test_a_caller_arriving_after_a_clear_does_not_take_an_older_encode() -> None:
    """An encode running when the weights change must not serve callers that come after the change."""
    cache = PromptEmbedCache()
    started, release = threading.Event(), threading.Event()

    def old_weights_encode():
        started.set()
        release.wait(5)
        return embedding(1)

    owner = threading.Thread(target=lambda: cache.get_or_compute(key(1), old_weights_encode))
    owner.start()
    started.wait(5)
    cache.clear()  # weights changed while the old encode runs
    fresh = cache.get_or_compute(key(1), lambda: embedding(2))  # must not wait for, or take, the old result
    release.set()
    owner.join(10)
    assert torch.equal(fresh, embedding(2))
    assert torch.equal(cache.get_or_compute(key(1), lambda: pytest.fail("cached")), embedding(2))
    assert (cache.hits, cache.misses) == (1, 2)


def test_a_result_computed_across_a_clear_is_returned_but_not_stored() -> None:
    """clear() marks a weight change: an encode that started before it must not fill the cache."""
    cache = PromptEmbedCache()

    def encode_while_weights_change():
        cache.clear()
        return embedding(5)

    assert torch.equal(cache.get_or_compute(key(5), encode_while_weights_change), embedding(5))
    assert len(cache) == 0
    computed = []
    cache.get_or_compute(key(5), lambda: computed.append(1) or embedding(5))
    assert computed == [1]
    assert len(cache) == 1


# Upstream vLLM-Omni's contract: get() / put() with a miss sentinel, assignable counters.


def test_get_returns_the_miss_sentinel_and_counts_like_upstream() -> None:
    cache = PromptEmbedCache(max_size=2)
    assert cache.get(("tag", "a red fox")) is MISS
    cache.put(("tag", "a red fox"), None)  # a cached None is a hit, not a miss
    assert cache.get(("tag", "a red fox")) is None
    assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)


def test_put_overwrites_and_evicts_least_recently_used() -> None:
    cache = PromptEmbedCache(max_size=2)
    cache.put("a", embedding(1))
    cache.put("b", embedding(2))
    cache.get("a")  # a becomes most recent
    cache.put("c", embedding(3))  # evicts b
    assert cache.get("b") is MISS
    cache.put("a", embedding(9))
    assert torch.equal(cache.get("a"), embedding(9))
    assert (len(cache), cache.stats()["evictions"], cache.stats()["bytes"]) == (2, 1, 2 * 32)


def test_put_keeps_the_byte_budget_and_an_oversize_value_is_not_kept() -> None:
    cache = PromptEmbedCache(max_size=8, max_bytes=64)
    cache.put("a", embedding(1))
    cache.put("a", embedding(2, width=32))  # 128 B: over budget, not kept; the old value is gone too
    assert cache.get("a") is MISS
    assert cache.stats()["oversize_rejections"] == 1 and cache.stats()["bytes"] == 0


def test_get_with_a_call_key_verifies_the_witness() -> None:
    weak = CallKeyBuilder(inspect.signature(_signature), "tiny", digest=lambda _: b"\0" * 16)
    first, other = weak.build((torch.tensor([1]),), {}), weak.build((torch.tensor([2]),), {})
    cache = PromptEmbedCache()
    cache.put(first, embedding(1))
    assert torch.equal(cache.get(weak.build((torch.tensor([1]),), {})), embedding(1))
    assert cache.get(other) is MISS  # same identity, other bytes: never the wrong embedding


def test_counters_are_assignable_as_upstreams_wrapper_does() -> None:
    cache = PromptEmbedCache()
    with cache._lock:  # upstream's wrapper counts a bypass this way, under the cache's lock
        cache.bypassed += 1
    cache.hits += 2
    assert (cache.hits, cache.bypassed) == (2, 1)
    assert cache.stats()["bypass_reasons"] == {UNSPECIFIED_REASON: 1}
    cache.bypassed = 0  # a reset leaves no zero-count reason behind
    assert cache.stats()["bypass_reasons"] == {}


def test_upstreams_counting_under_the_lock_loses_no_count_made_meanwhile() -> None:
    """Upstream's wrapper reads and assigns ``bypassed`` under ``cache._lock``; calls counting through the
    store on other threads meanwhile must not be overwritten."""
    cache = PromptEmbedCache()
    rounds = 5_000

    def upstream_style() -> None:
        for _ in range(rounds):
            with cache._lock:
                cache.bypassed += 1

    def ours() -> None:
        for _ in range(rounds):
            record_bypass(cache, "cache disabled")

    threads = [threading.Thread(target=upstream_style), threading.Thread(target=ours)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert cache.bypassed == 2 * rounds
    assert cache.stats()["bypass_reasons"] == {UNSPECIFIED_REASON: rounds, "cache disabled": rounds}


def test_stats_snapshot_deltas_and_summary() -> None:
    cache = PromptEmbedCache(max_size=4)
    before = cache.snapshot()
    cache.get_or_compute(key(1), lambda: embedding(1))
    cache.get_or_compute(key(1), lambda: embedding(1))
    record_bypass(cache, "cache disabled")
    after = cache.snapshot()
    delta = after.since(before)
    assert (delta.hits, delta.misses, delta.bypassed, delta.calls) == (1, 1, 1, 3)
    assert delta.hit_rate == pytest.approx(1 / 3)
    assert delta.bypass_reasons == {"cache disabled": 1}
    assert after.since(after).bypass_reasons == {} and after.since(after).hit_rate == 0.0
    assert CacheStats.from_dict(cache.stats()) == after
    upstream_style = CacheStats.from_dict({"size": 1, "max_size": 4, "hits": 3, "misses": 1, "bypassed": 0})
    assert upstream_style.hit_rate == 0.75 and upstream_style.bypass_reasons == {}
    assert after.summary().startswith("Prompt-embed cache: hit rate 33.3% (1 hits, 1 misses, 1 bypassed), 1/4 entries")


def test_snapshots_of_several_replicas_merge_into_one() -> None:
    first = CacheStats(size=2, max_size=8, hits=5, misses=2, bypass_reasons={"a": 1}, max_bytes=100, rows_encoded=2)
    second = CacheStats(size=3, max_size=8, hits=1, misses=3, bypass_reasons={"a": 2, "b": 5}, max_bytes=50)
    merged = CacheStats.merged([first, second])
    assert (merged.size, merged.max_size, merged.hits, merged.misses, merged.rows_encoded) == (5, 16, 6, 5, 2)
    assert merged.bypass_reasons == {"b": 5, "a": 3} and list(merged.bypass_reasons) == ["b", "a"]
    assert merged.max_bytes == 150
    assert CacheStats.merged([first, dataclasses.replace(second, max_bytes=None)]).max_bytes is None
    with pytest.raises(ValueError, match="no snapshots"):
        CacheStats.merged([])


def test_unaliased_copies_only_outputs_that_share_an_inputs_storage() -> None:
    ids, mask = torch.arange(6).view(2, 3), torch.ones(2, 3, dtype=torch.bool)
    embeds = torch.zeros(2, 3, 4)
    kept = unaliased((embeds, {"mask": mask[:, :2]}, [mask]), ((ids,), {"attention_mask": mask}))
    assert kept[0] is embeds  # not an input: kept as it is
    assert torch.equal(kept[1]["mask"], mask[:, :2]) and kept[2][0] is not mask
    for copy in (kept[1]["mask"], kept[2][0]):
        assert copy.untyped_storage().data_ptr() != mask.untyped_storage().data_ptr()
    assert unaliased(embeds, ((), {})) is embeds  # no tensor inputs: nothing to walk


def test_unaliased_copies_outputs_built_on_a_numpy_input() -> None:
    token_ids = np.arange(4)
    shared, own = torch.from_numpy(token_ids), torch.arange(4)
    kept = unaliased((shared, own), ((token_ids,), {}))
    assert torch.equal(kept[0], shared) and not np.shares_memory(kept[0].numpy(), token_ids)
    assert kept[1] is own
