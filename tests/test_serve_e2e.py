"""`vllm serve MODEL --omni` with the cache flags, as an operator sees it: HTTP in, ``/metrics`` out.

Real servers on loopback, on the CPU platform, serving the stock Qwen-Image pipeline through
vLLM-Omni's image API. The cache's counts are read where an operator reads them: the Prometheus
text on ``GET /metrics`` (no dev-mode route). One server with one replica and small budgets, for the
metrics and then for load through vLLM-Omni's own benchmark client; one with two replicas behind
``--omni-lb-policy prompt-affinity`` (vLLM-Omni's distributed runtime, started by the same command).
A bad flag, refused before anything starts, is in ``test_settings.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from engine_support import tiny_spec

from vllm_omni_prompt_cache.demo import serving
from vllm_omni_prompt_cache.demo.serving import IMAGE_PARAMETERS, METRIC_PREFIX, post, scrape, series, total
from vllm_omni_prompt_cache.vllm_omni import hook_points

pytestmark = pytest.mark.engine
CACHE = METRIC_PREFIX


def generate(base: str, prompt: str, seed: int) -> None:
    image = post(f"{base}/v1/images/generations", {"prompt": prompt, **IMAGE_PARAMETERS, "seed": seed})
    assert image["data"][0]["b64_json"]


@contextlib.contextmanager
def served(log_path, *flags: str, kill: bool = False) -> Iterator[serving.Server]:
    """Run ``vllm serve TINY --omni FLAGS`` until the block ends; yield it once healthy.

    ``kill``: end it with SIGKILL (its whole session) instead of SIGTERM. vLLM-Omni 0.30's distributed
    shutdown waits 30 s for its membership watcher (see ``demo/replicas.py``), and a test that reads
    nothing from the server after the block has no use for that wait.
    """
    with serving.served(log_path, tiny_spec().model_dir, *flags) as server:
        try:
            yield server
        finally:
            if kill:
                server.kill()


def _import_benchmark() -> ModuleType:
    """Import ``benchmarks/load.py`` by path: ``benchmarks/`` is not a package (dataclasses need sys.modules)."""
    spec = importlib.util.spec_from_file_location("load_benchmark", Path(__file__).parents[1] / "benchmarks/load.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


load = _import_benchmark()
#: An entry of the load test's prompts is about 11 KiB, so each budget holds about 4 entries.
BUDGET = load.Budget(max_entries=4, max_bytes=48 * 1024)


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory) -> Iterator[serving.Server]:
    """One server with one replica and the budgets above, started once for the tests that use it, in
    this file's order: the metrics test first, while the cache has room (it asserts one entry more),
    then the load test, which fills it past the budgets and measures from where it starts."""
    with served(tmp_path_factory.mktemp("budgeted") / "server.log", *BUDGET.flags()) as server:
        yield server


#: Whether the installed vLLM-Omni has what the /metrics families need (0.30 and later; see docs/support.md).
METRICS_ON = not hook_points.missing_by_feature()[hook_points.METRICS]


@pytest.mark.release
def test_metrics_show_the_hits_and_budgets_of_repeated_prompts(budgeted) -> None:
    server = budgeted
    base = server.base
    # The first output brings counts from before serving too: vLLM-Omni's start-up warm-up
    # encodes a dummy prompt. Measure from the group's first request on.
    generate(base, "a red fox in the snow", seed=7)
    before = scrape(base)
    for seed in (8, 9):  # the group's siblings
        generate(base, "a red fox in the snow", seed)
    siblings = scrape(base)
    generate(base, "a lighthouse at dusk", seed=7)  # the next group
    after = scrape(base)
    print(
        "\n".join(
            f"{name}{{{','.join(f'{k}={v!r}' for k, v in labels)}}} {value:g}"
            for (name, labels), value in sorted(after.items())
            if name.startswith(CACHE) and not name.endswith("_created")
        )
    )  # the scrape, for the record (pytest -s)

    if not METRICS_ON:
        # The served cache is on; its families are absent, not half there, and the log says why.
        assert not [name for name, _ in after if name.startswith(CACHE)]
        log = server.log.read_text()
        assert "Prompt-embed cache (content-keyed) installed" in log
        assert f"{hook_points.METRICS} stay off, for want of" in log
        return

    def grew(name: str, since: dict, until: dict) -> float:
        return total(until, CACHE + name) - total(since, CACHE + name)

    assert [grew(name, before, siblings) for name in ("hits_total", "misses_total", "queries_total")] == [2, 0, 2]
    assert [grew(name, siblings, after) for name in ("hits_total", "misses_total", "rows_encoded_total")] == [0, 1, 1]
    assert grew("entries", before, after) == 1 and total(after, CACHE + "bytes") > total(before, CACHE + "bytes")
    assert total(after, CACHE + "bypassed_total") == 0 and total(after, CACHE + "verification_failures_total") == 0
    budgets = (total(after, CACHE + "max_entries"), total(after, CACHE + "max_bytes"))
    assert budgets == (BUDGET.max_entries, BUDGET.max_bytes)
    model_dir = str(tiny_spec().model_dir)
    assert series(after, CACHE + "hits_total") == [{"model_name": model_dir, "stage": "0", "replica": "0"}]
    # Labelled as vLLM-Omni's own diffusion families are.
    assert {"model_name": model_dir, "stage": "0", "replica": "0"} in series(after, "vllm_omni:diffusion_exec_s_count")


#: Twelve prompts: the ring hashes replica addresses that change every start, so fewer could all
#: land on one replica (with 12, and even odds for each prompt, 2 / 2**12: once in 2,048 starts).
ANIMALS, PLACES = ("fox", "heron", "otter"), ("snow", "fog", "dusk", "sun")
PROMPTS = tuple(f"a {animal} in the {place}" for animal in ANIMALS for place in PLACES)


def test_two_replicas_behind_prompt_affinity_encode_each_prompt_once(tmp_path) -> None:
    distributed = serving.distributed_flags(2)
    # Room for every prompt on either replica: consistent hashing may send most of them to one.
    cache_flags = ("--enable-prompt-embed-cache", "--prompt-embed-cache-size", "128")
    with served(tmp_path / "server.log", *cache_flags, *distributed, kill=True) as server:
        base = server.base
        serving.warm_up(server, 2)
        before = scrape(base)
        for seed in range(2):  # sibling-major, as an RL rollout sends a batch
            for prompt in PROMPTS:
                generate(base, prompt, seed)
        after = scrape(base)

    def grew(name: str, replica: str) -> float:
        return total(after, CACHE + name, replica=replica) - total(before, CACHE + name, replica=replica)

    counted = ("misses_total", "hits_total", "entries")
    per_replica = {replica: [grew(name, replica) for name in counted] for replica in ("0", "1")}
    print(per_replica)  # for the record (pytest -s)
    # Both replicas served; each encoded each of its prompts once and hit on every sibling: so every
    # prompt was encoded once in all, on one replica.
    for misses, hits, entries in per_replica.values():
        assert hits >= 1 and misses == hits and entries == misses
    assert sum(hits for _, hits, _ in per_replica.values()) == len(PROMPTS)


def test_bench_serve_under_load_fails_nothing_keeps_the_budgets_and_counts_every_call(budgeted, tmp_path) -> None:
    """The short version of ``benchmarks/load.py``: vLLM-Omni's own client (``vllm bench serve --omni``) at
    concurrency 8 sends a repeated set (RL siblings), then, in a second client run, an all-new set several
    times larger than the budgets.

    Two runs, as the benchmark makes them, because only then are the counts independent of the order in
    which the server takes concurrent requests: HTTP does not keep the order the client sent them in. With
    both sets in one run, a sibling that reached the engine after four new prompts found its entry evicted
    and was encoded again (CI, 2026-12-06: 20 misses for 19 prompts). Alone, the repeated set's three
    entries fit both budgets in any order, and every prompt of the new set is new in any order.
    """
    repeated = load.repeated("test", prompts=3, siblings=4)
    new = load.all_new("test", prompts=16)  # 4 times the entry budget
    serving.warm_up(budgeted, replicas=1)
    runs = [load.measure(budgeted, 1, pattern, concurrency=8, work_dir=tmp_path) for pattern in (repeated, new)]
    print(load.table(runs))  # for the record (pytest -s)

    for run, pattern in zip(runs, (repeated, new), strict=True):
        assert (run.bench.completed, run.bench.failed) == (len(pattern.prompts), 0), run.bench.errors
        counts = run.counts
        # queries_total advances by hits + misses + bypasses of the same snapshot (metrics.py: COUNTED
        # "queries" is CacheStats.calls), so the identity is exact. A first-use layout check would count
        # as a miss, not a query of its own; single-row calls (max_num_seqs 1) need none, so each miss
        # encoded exactly its one row.
        assert counts["queries"] == counts["hits"] + counts["misses"] + counts["bypassed"]
        # One encode_prompt call per request: max_num_seqs is 1 and no request has a negative prompt.
        assert counts["queries"] == len(pattern.prompts) and counts["bypassed"] == 0
        # Each prompt encoded once, every sibling a hit.
        assert counts["misses"] == counts["rows_encoded"] == pattern.distinct
        assert counts["hits"] == len(pattern.prompts) - pattern.distinct
        # The budgets held, and each run evicted exactly what it added beyond them.
        entries, stored = run.entries["0"], run.bytes["0"]
        assert (run.max_entries["0"], run.max_bytes["0"]) == (BUDGET.max_entries, BUDGET.max_bytes)
        assert 0 < entries <= BUDGET.max_entries and stored <= BUDGET.max_bytes
        assert counts["evictions"] == run.entries_start["0"] + counts["misses"] - entries

    # The budgets were needed: the new set is 3x what the bytes hold.
    entries, stored = runs[1].entries["0"], runs[1].bytes["0"]
    assert new.distinct * stored / entries >= 3 * BUDGET.max_bytes
