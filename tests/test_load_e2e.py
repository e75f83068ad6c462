"""Load through the real client: ``vllm bench serve --omni`` against ``vllm serve TINY --omni`` with the cache.

The short version of ``benchmarks/load.py`` (whose functions it uses): one server, one replica,
vLLM-Omni's own benchmark client at concurrency 8 sending a repeated set (RL siblings) and then an
all-new set several times larger than the cache's budgets, in one client run (each start of the
client costs ~20 s here). What must hold under load: no request fails, the budgets hold, and the
counts on ``/metrics`` add up to what the prompts imply.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("vllm_omni", reason="the engine tests need the vllm-omni extra")

from vllm_omni_prompt_cache.demo.serving import served, warm_up
from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image

pytestmark = pytest.mark.engine


def _import_benchmark() -> ModuleType:
    """Import ``benchmarks/load.py`` by path: ``benchmarks/`` is not a package (dataclasses need sys.modules)."""
    spec = importlib.util.spec_from_file_location("load_benchmark", Path(__file__).parents[1] / "benchmarks/load.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


load = _import_benchmark()
#: An entry of these prompts is about 11 KiB, so each budget holds about 4 entries.
BUDGET = load.Budget(max_entries=4, max_bytes=48 * 1024)


def test_bench_serve_under_load_fails_nothing_keeps_the_budgets_and_counts_every_call(tmp_path) -> None:
    repeated = load.repeated("test", prompts=3, siblings=4)
    new = load.all_new("test", prompts=16)  # 4 times the entry budget
    sent = load.Pattern("repeated, then all new", repeated.prompts + new.prompts)
    with served(tmp_path / "server.log", ensure_tiny_qwen_image(), *BUDGET.flags()) as server:
        warm_up(server, replicas=1)
        run = load.measure(server, 1, sent, concurrency=8, work_dir=tmp_path)
    print(load.table([run]))  # for the record (pytest -s)
    assert (run.bench.completed, run.bench.failed) == (len(sent.prompts), 0), run.bench.errors

    counts = run.counts
    # queries_total advances by hits + misses + bypasses of the same snapshot (metrics.py: COUNTED
    # "queries" is CacheStats.calls), so the identity is exact. A first-use layout check would count
    # as a miss, not a query of its own; single-row calls (max_num_seqs 1) need none, so each miss
    # encoded exactly its one row.
    assert counts["queries"] == counts["hits"] + counts["misses"] + counts["bypassed"]
    # One encode_prompt call per request: max_num_seqs is 1 and no request has a negative prompt.
    assert counts["queries"] == len(sent.prompts) and counts["bypassed"] == 0
    # Each prompt encoded once: a group's siblings hit while its entry is among the last 4 used.
    assert counts["misses"] == counts["rows_encoded"] == sent.distinct
    assert counts["hits"] == len(repeated.prompts) - repeated.distinct

    # The budgets held, and were needed: every entry the run added beyond them was evicted.
    entries, stored = run.entries["0"], run.bytes["0"]
    assert (run.max_entries["0"], run.max_bytes["0"]) == (BUDGET.max_entries, BUDGET.max_bytes)
    assert 0 < entries <= BUDGET.max_entries and stored <= BUDGET.max_bytes
    assert counts["evictions"] == run.entries_start["0"] + counts["misses"] - entries
    assert new.distinct * stored / entries >= 3 * BUDGET.max_bytes  # the new set is 3x what the bytes hold
