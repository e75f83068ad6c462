"""The table of counters (``counters.COUNTS``) is the one place a count is declared.

``Counters`` (each method's counts), the ``CacheStats`` snapshot (and so ``stats()``) and the
Prometheus families of ``/metrics`` are generated from it: one line added to the table is a new
count in all three, and nothing else declares one.
"""

from __future__ import annotations

import ast
import dataclasses
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import pytest

import vllm_omni_prompt_cache
from vllm_omni_prompt_cache import counters, stats
from vllm_omni_prompt_cache.counters import CALL_COUNTS, COUNTS, Counters
from vllm_omni_prompt_cache.stats import CacheStats

PACKAGE = Path(vllm_omni_prompt_cache.__file__).parent
#: The snapshot's levels: every CacheStats field that is not a count of the table.
LEVELS = {
    "size",
    "max_size",
    "bypassed",
    "bytes",
    "max_bytes",
    "enabled",
    "verify",
    "layout_check_max_gap",
    "host_entries",
    "host_bytes",
    "host_max_bytes",
    "host_max_entries",
    "host_keeps",
    "dir_files",
    "dir_bytes",
    "dir_max_bytes",
    "directory",
    "dir_off_reason",
    "encoder_device_bytes",
    "encoder_placer",
    "methods",
}
#: The one line the first test adds to the table: a count calls make, with a family of its own and one by method.
ADDED_LINE = '    Count("widgets", "Widgets a test added.", by_method=("method_widgets", "Widgets of one method.")),\n'

#: Run in the copy of the package with the added line: the new count is in each generated place.
CHECK_ADDED_COUNT = textwrap.dedent(
    """
    import dataclasses, sys

    import vllm_omni_prompt_cache
    assert vllm_omni_prompt_cache.__file__.startswith(sys.argv[1]), vllm_omni_prompt_cache.__file__
    from prometheus_client import CollectorRegistry

    from vllm_omni_prompt_cache.counters import ENCODE_PROMPT, Counters, MethodCounters
    from vllm_omni_prompt_cache.stats import CacheStats
    from vllm_omni_prompt_cache.store import PromptEmbedCache
    from vllm_omni_prompt_cache.vllm_omni.metrics import PromptEmbedCacheMetrics, encode_snapshot, pop_snapshot

    assert "widgets" in {field.name for field in dataclasses.fields(Counters)}
    kept = MethodCounters()
    kept.add(ENCODE_PROMPT, {"widgets": 2})  # as a call's tally adds it
    totals, methods = kept.read()
    assert totals["widgets"] == 2 and methods[ENCODE_PROMPT]["widgets"] == 2
    assert PromptEmbedCache().stats()["widgets"] == 0  # stats() of a real cache
    stats = CacheStats(widgets=3, methods={ENCODE_PROMPT: {"widgets": 3}})
    assert stats.as_dict()["widgets"] == 3 and CacheStats.from_dict(stats.as_dict()) == stats
    registry = CollectorRegistry()
    snapshot = pop_snapshot(encode_snapshot(stats, epoch=1, sequence=1))  # the trip through a metrics dict
    assert snapshot.stats.widgets == 3
    PromptEmbedCacheMetrics(registry).record(("tiny", "0", "0"), snapshot)
    labels = {"model_name": "tiny", "stage": "0", "replica": "0"}
    assert registry.get_sample_value("vllm_omni:prompt_embed_cache_widgets_total", labels) == 3.0
    labels["method"] = ENCODE_PROMPT
    assert registry.get_sample_value("vllm_omni:prompt_embed_cache_method_widgets_total", labels) == 3.0
    print("widgets counted")
    """
)


def test_one_line_added_to_the_table_is_a_count_of_counters_stats_and_metrics(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client", reason="the metrics need prometheus_client (vLLM's)")
    copy = tmp_path / "vllm_omni_prompt_cache"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    source = (copy / "counters.py").read_text()
    table = source.index("\nCOUNTS: tuple[Count, ...] = (\n")
    end = source.index("\n)\n", table) + 1  # the table's closing parenthesis
    (copy / "counters.py").write_text(source[:end] + ADDED_LINE + source[end:])
    assert len((copy / "counters.py").read_text().splitlines()) == len(source.splitlines()) + 1
    done = subprocess.run(
        [sys.executable, "-c", CHECK_ADDED_COUNT, str(copy)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "widgets counted" in done.stdout


def test_counters_and_the_snapshot_have_a_field_for_each_count_of_the_table_and_no_other() -> None:
    assert [(field.name, field.type) for field in dataclasses.fields(Counters)] == [
        (count.name, Counter[str] if count.by_reason else int) for count in CALL_COUNTS
    ]
    assert [count.name for count in CALL_COUNTS] == [count.name for count in COUNTS if count.kept_by == "calls"]
    fields = {field.name: field.type for field in dataclasses.fields(CacheStats)}
    assert set(fields) == {count.name for count in COUNTS} | LEVELS
    assert {name: fields[name] for name in (count.name for count in COUNTS)} == {
        count.name: Mapping[str, int] if count.by_reason else int for count in COUNTS
    }
    # Upstream's stats() keys first, in its order; each keeper's counts together, in the table's order.
    assert list(fields)[:5] == ["size", "max_size", "hits", "misses", "bypassed"]
    assert [name for name in fields if name not in LEVELS] == [count.name for count in COUNTS]
    # Neither class body declares a count by hand: Counters' declares no field, CacheStats' only the levels.
    bodies = {
        node.name: [field.target.id for field in node.body if isinstance(field, ast.AnnAssign)]
        for module in (counters, stats)
        for node in ast.parse(Path(module.__file__).read_text()).body
        if isinstance(node, ast.ClassDef)
    }
    assert bodies["Counters"] == [] and set(bodies["CacheStats"]) == LEVELS
    # The tiers' counts are read off the attribute the table names.
    for count in COUNTS:
        if count.kept_by != "calls":
            tier, attribute = count.kept_by.split(".")
            assert tier in ("host", "directory", "moves") and attribute.isidentifier()


def test_the_metrics_families_are_the_tables_and_built_by_one_loop() -> None:
    prometheus_client = pytest.importorskip("prometheus_client", reason="the metrics need prometheus_client")
    from vllm_omni_prompt_cache.vllm_omni import metrics

    registry = prometheus_client.CollectorRegistry()
    built = metrics.PromptEmbedCacheMetrics(registry)
    expected = dict(metrics.DERIVED_FAMILIES)
    for count in COUNTS:
        if count.help is not None:
            expected[count.family] = (count.help, count.label_names)
        if count.by_method is not None:
            expected[count.by_method[0]] = (count.by_method[1], ("method", *count.label_names))
    assert metrics.counter_families() == expected
    families = {family.name: family for family in registry.collect()}
    counted = {name for name, family in families.items() if family.type == "counter"}
    assert counted == {metrics.METRIC_PREFIX + name for name in expected}
    for name, (documentation, labels) in expected.items():
        assert families[metrics.METRIC_PREFIX + name].documentation == documentation
        assert built.counters[name]._labelnames == (*metrics.LABELS, *labels)
    assert set(families) - counted == {metrics.METRIC_PREFIX + name for name, _ in metrics.GAUGES.values()}
    levels = (*metrics.LEVELS, *metrics.HOST_LEVELS, *metrics.DIRECTORY_LEVELS, *metrics.MOVE_LEVELS)
    assert sorted(metrics.GAUGES) == sorted(levels) and set(levels) <= LEVELS  # a gauge for each level sent
    # No family is written out by hand: metrics.py makes every family in one of two calls, a Counter and a Gauge.
    made = [
        node.func.id
        for node in ast.walk(ast.parse(Path(metrics.__file__).read_text()))
        if isinstance(node, ast.Call) and any(keyword.arg == "labelnames" for keyword in node.keywords)
    ]
    assert made == ["Counter", "Gauge"]


#: The families users' dashboards read, by the labels after model_name, stage and replica (name without the prefix).
DASHBOARD_FAMILIES = {
    (): (
        "queries hits misses row_hits row_misses rows_encoded evictions oversize_rejections audits host_hits "
        "host_misses host_demotions host_evictions dir_hits dir_misses dir_writes dir_write_errors dir_evictions "
        "dir_waits dir_stale_claims dir_wait_timeouts dir_leftovers_removed encoder_placements encoder_evictions "
        "dit_placements dit_evictions bytes_moved placements_avoided bytes_not_moved proven_hits changed_entries"
    ),
    ("reason",): "bypassed row_bypassed whole_calls dir_rejections unproven",
    ("check",): "verification_failures",
    ("method",): "method_queries method_hits method_misses method_rows_encoded",
    ("method", "reason"): "method_bypassed",
    "gauge": (
        "encoder_device_bytes host_entries host_bytes host_max_bytes host_max_entries dir_files dir_bytes "
        "dir_max_bytes entries bytes max_entries max_bytes"
    ),
}


def test_the_families_keep_the_names_and_labels_dashboards_read() -> None:
    prometheus_client = pytest.importorskip("prometheus_client", reason="the metrics need prometheus_client")
    from vllm_omni_prompt_cache.vllm_omni import metrics

    built = metrics.PromptEmbedCacheMetrics(prometheus_client.CollectorRegistry())
    by_labels: dict[object, set[str]] = {}
    for name, family in built.counters.items():
        by_labels.setdefault(family._labelnames[len(metrics.LABELS) :], set()).add(name)
    by_labels["gauge"] = {name for name, _ in metrics.GAUGES.values()}
    assert all(gauge._labelnames == metrics.LABELS for gauge in built.gauges.values())
    assert by_labels == {labels: set(names.split()) for labels, names in DASHBOARD_FAMILIES.items()}
