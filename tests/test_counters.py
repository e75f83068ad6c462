"""The counts are objects of ``counters.py``, each declared once; everything else names the object.

``Counters`` (each method's counts), the ``CacheStats`` snapshot (and so ``stats()``) and the
Prometheus families of ``/metrics`` are made from the table ``COUNTS``: one line added to
``counters.py`` is a new count in all three. Code that counts names the ``Count`` object, never its
name as a string; the tiers and the encoder moves report theirs through ``counts()``.
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
from vllm_omni_prompt_cache.counts import counters, stats
from vllm_omni_prompt_cache.counts.counters import (
    CALL_COUNTS,
    COUNTS,
    KEPT_COUNTS,
    WHOLE_HIT,
    Count,
    Counters,
    Keeper,
    Outcome,
    register,
    tally,
)
from vllm_omni_prompt_cache.counts.stats import CacheStats

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
#: The one line the first test adds to counters.py: a count calls make, with a family of its own and one by method.
ADDED_LINE = (
    'WIDGETS = register(Count("widgets", "Widgets a test added.", '
    'by_method=("method_widgets", "Widgets of one method.")))\n'
)

#: Run with the copy of the package that has the added line: the new count, counted by a real cache, is in its
#: stats() (in total and by method) and on the /metrics page those stats make.
CHECK_ADDED_COUNT = textwrap.dedent(
    """
    import sys

    import vllm_omni_prompt_cache
    assert vllm_omni_prompt_cache.__file__.startswith(sys.argv[1]), vllm_omni_prompt_cache.__file__
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_omni_prompt_cache.counts.counters import COUNTS, ENCODE_PROMPT, WIDGETS
    from vllm_omni_prompt_cache.store.prompt_embed_cache import PromptEmbedCache
    from vllm_omni_prompt_cache.vllm_omni.metrics import PromptEmbedCacheMetrics, cache_snapshot, pop_snapshot

    assert COUNTS[-1] is WIDGETS
    cache = PromptEmbedCache()
    cache.record(ENCODE_PROMPT, {WIDGETS: 2})  # as a call's counts are added
    cache.record("encode_video_prompt", {WIDGETS: 1})
    stats = cache.stats()
    assert stats["widgets"] == 3, stats
    assert {method: counts["widgets"] for method, counts in stats["methods"].items()} == {
        ENCODE_PROMPT: 2,
        "encode_video_prompt": 1,
    }, stats["methods"]
    registry = CollectorRegistry()  # /metrics as the API server renders it, from the snapshot a worker sends
    PromptEmbedCacheMetrics(registry).record(("tiny", "0", "0"), pop_snapshot(cache_snapshot(cache)))
    page = generate_latest(registry).decode()
    labels = 'model_name="tiny",replica="0",stage="0"'  # the page sorts them
    for line in (
        "# HELP vllm_omni:prompt_embed_cache_widgets_total Widgets a test added.",
        "# TYPE vllm_omni:prompt_embed_cache_widgets_total counter",
        "vllm_omni:prompt_embed_cache_widgets_total{" + labels + "} 3.0",
        "# HELP vllm_omni:prompt_embed_cache_method_widgets_total Widgets of one method.",
        'vllm_omni:prompt_embed_cache_method_widgets_total{method="encode_prompt",' + labels + "} 2.0",
        'vllm_omni:prompt_embed_cache_method_widgets_total{method="encode_video_prompt",' + labels + "} 1.0",
    ):
        assert line in page.splitlines(), (line, page)
    print("widgets counted")
    """
)


def test_one_line_added_to_counters_is_a_count_of_stats_by_method_and_of_metrics(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client", reason="the metrics need prometheus_client (vLLM's)")
    copy = tmp_path / "vllm_omni_prompt_cache"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    source = (copy / "counts" / "counters.py").read_text()
    # After the last count registered: what is made from the table comes later in the module.
    registrations = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", None) == register.__name__
    ]
    lines = source.splitlines(keepends=True)
    after = registrations[-1].end_lineno
    (copy / "counts" / "counters.py").write_text("".join([*lines[:after], ADDED_LINE, *lines[after:]]))
    assert len((copy / "counts" / "counters.py").read_text().splitlines()) == len(lines) + 1
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


def test_a_count_registered_after_the_table_was_read_is_refused() -> None:
    """Counters, CacheStats and the families are made from the table once: a count added later would be in
    none of them, so it is refused rather than counted nowhere."""
    before = counters.COUNTS
    with pytest.raises(RuntimeError, match=r"declare it in counters\.py"):
        register(Count("late_widgets", "Widgets declared too late."))
    assert counters.COUNTS is before


def test_calls_count_by_count_objects_and_the_hit_paths_tallies_are_made_once() -> None:
    counted = tally(Outcome.BYPASS, reason="why", rows_hit=2, whole_call="whole")
    assert all(type(count) is Count and count.kept_by is Keeper.CALLS for count in counted)
    assert {count.name: value for count, value in counted.items()} == {
        "bypass_reasons": {"why": 1},
        "row_hits": 2,
        "whole_call_reasons": {"whole": 1},
    }
    assert [(count.name, value) for count, value in WHOLE_HIT.items()] == [("hits", 1)]
    with pytest.raises(TypeError):  # shared by every hit: read-only
        WHOLE_HIT[next(iter(WHOLE_HIT))] = 2  # type: ignore[index]


def test_each_tier_and_the_moves_report_exactly_the_counts_the_table_gives_their_keeper(tmp_path: Path) -> None:
    from vllm_omni_prompt_cache.encoders.residency import EncoderMoves
    from vllm_omni_prompt_cache.store.tiers.directory import DirectoryTier
    from vllm_omni_prompt_cache.store.tiers.host import HostTier
    from vllm_omni_prompt_cache.store.tiers.tier import Tiers

    host, directory = HostTier(2**20), DirectoryTier(tmp_path, None, lambda: {"model": "tiny"})
    keepers = {Keeper.HOST: host, Keeper.DIRECTORY: directory, Keeper.MOVES: EncoderMoves()}
    assert set(keepers) == set(Keeper) - {Keeper.CALLS}
    for keeper, kept_by in keepers.items():
        assert list(kept_by.counts()) == list(KEPT_COUNTS[keeper])
        assert all(value == ({} if count.by_reason else 0) for count, value in kept_by.counts().items())
    assert list(Tiers([host, directory]).counts()) == [*KEPT_COUNTS[Keeper.HOST], *KEPT_COUNTS[Keeper.DIRECTORY]]


def _non_docstring_strings(tree: ast.AST) -> list[ast.Constant]:
    """Return the string constants of a module that are not docstrings (of the module, a class or a function)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_no_code_outside_counters_names_a_count_by_a_string() -> None:
    """Every string constant of the package outside counters.py, f-strings' literal parts included, is checked;
    docstrings are prose, not code (they may name a count), and comments are not in the syntax tree."""
    names = {count.name for count in COUNTS}
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "counts" / "counters.py"
        for node in _non_docstring_strings(ast.parse(path.read_text(), str(path)))
        if node.value in names
    ]
    assert found == []


#: Code the check above must flag four times ("hits" as a key and as an f-string's literal part, a bare "misses",
#: an attribute's "row_hits"), and whose docstrings it must not.
NAMES_COUNTS = '''
"""The hits of a module."""


def f():
    """hits"""
    return {"hits": 1}, f"{1}hits", "misses"


class C:
    """misses"""

    x = "row_hits"
'''


def test_the_check_for_count_names_sees_strings_and_skips_docstrings_only() -> None:
    names = {count.name for count in COUNTS}
    flagged = sorted(node.value for node in _non_docstring_strings(ast.parse(NAMES_COUNTS)) if node.value in names)
    assert flagged == ["hits", "hits", "misses", "row_hits"]


def test_counters_and_the_snapshot_have_a_value_or_field_for_each_count_of_the_table_and_no_other() -> None:
    kept = Counters().values
    assert list(kept) == list(CALL_COUNTS)
    assert [type(value) for value in kept.values()] == [Counter if count.by_reason else int for count in CALL_COUNTS]
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
    # Every count is a module-level object of counters.py, registered once, and names its keeper by the enum.
    declared = {name: value for name, value in vars(counters).items() if isinstance(value, Count)}
    assert list(declared.values()) == list(COUNTS) and all(name == name.upper() for name in declared)
    assert all(isinstance(count.kept_by, Keeper) for count in COUNTS)


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
        "dit_placements dit_evictions bytes_moved placements_avoided bytes_not_moved key_only_hits "
        "changed_entries"
    ),
    ("reason",): "bypassed row_bypassed whole_calls dir_rejections",
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
