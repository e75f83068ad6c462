"""The demo's command line: bad arguments and missing extras get one clear line, before any engine starts.

None of this needs vLLM-Omni installed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_omni_prompt_cache.cli import main
from vllm_omni_prompt_cache.demo import command, report
from vllm_omni_prompt_cache.demo.rollout import RolloutResult, RolloutSpec
from vllm_omni_prompt_cache.store.prompt_embed_cache import CacheStats


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--group-size", "0"], "argument --group-size: expected an integer >= 1, got 0"),
        (["--prompts", "-1"], "argument --prompts: expected an integer >= 1, got -1"),
        (["--prompts", "abc"], "argument --prompts: expected an integer >= 1, got 'abc'"),
        (["--prompts", "99"], "at most 12 distinct prompts"),
        (["--size", "50"], "multiple of 16 pixels"),
        (["--modes", "ours,fast"], "unknown mode(s) ['fast']"),
        (["--max-bytes", "0"], "invalid prompt_embed_cache_max_bytes='0' from command-line flag --max-bytes"),
        (["--cache-size", "0"], "invalid prompt_embed_cache_size='0' from command-line flag --cache-size"),
        (["--model", "/nonexistent/model"], "argument --model: model directory '/nonexistent/model' does not exist"),
        (["--unknown-flag"], "unrecognized arguments: --unknown-flag"),
        (["--max-num-seqs", "0"], "argument --max-num-seqs: expected comma-separated integers >= 1"),
        (["--max-num-seqs", "1,abc"], "got 'abc' in '1,abc'"),
        (["--max-num-seqs", "4,4"], "value listed twice in '4,4'"),
        (["--replicas", "0"], "argument --replicas: expected an integer >= 1, got 0"),
        (["--replicas", "two"], "argument --replicas: expected an integer >= 1, got 'two'"),
        (["--lb-policy", "random"], "argument --lb-policy: needs --replicas 2 or more"),
        (["--replicas", "2", "--lb-policy", "fastest"], "unknown policy(ies) ['fastest']"),
        (["--replicas", "2", "--lb-policy", "random,random"], "policy listed twice in 'random,random'"),
        (["--arrival", "bursty"], "argument --arrival: invalid choice: 'bursty'"),
        (["--model", "flux"], "argument --model: expected one of qwen-image, wan2.2, sd3 or a model directory path"),
        (["--model", "wan2.2", "--size", "48"], "argument --size: Wan2.2 needs a multiple of 32 pixels, got 48"),
        (["--model", "wan2.2", "--max-num-seqs", "1,8"], "serves one request per forward; got 1,8"),
        (["--model", "wan2.2", "--step-execution"], "Wan2.2 adapter has no step-execution path"),
        (["--model", "sd3", "--size", "40"], "argument --size: SD3.5 needs a multiple of 16 pixels, got 40"),
        (["--model", "sd3", "--step-execution"], "SD3.5 adapter has no step-execution path"),
    ],
)
def test_bad_arguments_get_a_clear_error_not_a_traceback(arguments, message, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", *arguments])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert message in error
    assert "Traceback" not in error


def test_model_that_is_not_a_pipeline_is_rejected(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--model", str(tmp_path)])
    assert "no model_index.json" in capsys.readouterr().err


def test_missing_extras_are_named_before_any_engine_starts(monkeypatch, tmp_path, capsys) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    absent = {"matplotlib", "tqdm"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in absent else real_find_spec(name, *a)
    )
    monkeypatch.setattr(command, "run", lambda args: pytest.fail("no engine may start"))
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--out", str(tmp_path / "out")])
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(
        "the demo needs tqdm, matplotlib (the 'demo' extra): pip install 'vllm-omni-prompt-cache[demo]'"
    )


def test_matplotlib_is_only_needed_for_a_chart(monkeypatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    assert command.missing_extras(chart=False) == {}
    assert command.missing_extras(chart=True) == {"demo": ["matplotlib"]}


def demo_where_vllm_omni_is_not_installed(*argv: str) -> subprocess.CompletedProcess:
    """Run the demo in a process where vllm, vllm_omni and diffusers cannot be imported."""
    blocked = "import sys\nfor name in ('vllm', 'vllm_omni', 'diffusers'):\n    sys.modules[name] = None\n"
    run = "from vllm_omni_prompt_cache.cli import main\nmain({argv!r})\n"
    code = blocked + run.format(argv=["demo", *argv])
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )


def bad_and_missing() -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    return demo_where_vllm_omni_is_not_installed("--group-size", "0"), demo_where_vllm_omni_is_not_installed()


def test_arguments_and_extras_are_checked_where_vllm_omni_is_not_installed() -> None:
    """In a process where vllm, vllm_omni and diffusers cannot be imported, as after a core-only install."""
    bad, missing = bad_and_missing()
    assert bad.returncode == 2 and "argument --group-size: expected an integer >= 1, got 0" in bad.stderr
    assert missing.returncode == 2, missing.stderr[-2000:]
    assert "the demo needs vllm, vllm_omni, diffusers (the 'vllm-omni' extra)" in missing.stderr
    assert "pip install 'vllm-omni-prompt-cache[vllm-omni]'" in missing.stderr
    assert "Traceback" not in bad.stderr + missing.stderr


def test_a_failing_chart_costs_only_the_chart(monkeypatch, tmp_path) -> None:
    spec = RolloutSpec(model_dir=tmp_path, prompts=("a red fox",), group_size=2)
    results = [
        RolloutResult("off", 2.0, 1.0, 2, None, 4, 0.5, encoder_rows=4),
        RolloutResult("ours", 1.0, 1.0, 2, CacheStats(hits=3, misses=1, size=1, max_size=8), 1, 0.1, encoder_rows=1),
    ]

    def broken_chart(results, path):
        raise RuntimeError("no display backend")

    monkeypatch.setattr(report, "write_chart", broken_chart)
    printed = io.StringIO()
    out = tmp_path / "out"
    paths = command.save_results(out, spec, results, [], "vllm-omni-prompt-cache demo", {"cpu": "x"}, printed)
    assert paths == [out / "report.md", out / "results.json"]
    assert json.loads((out / "results.json").read_text())["runs"][1]["cache_stats"]["hits"] == 3
    assert "| 1 | vllm-omni-prompt-cache | 1 | 1 | 3 | 1 | 0 | 0 |" in (out / "report.md").read_text()
    assert "Could not draw" in printed.getvalue() and "no display backend" in printed.getvalue()
    assert not (out / "time.png").exists()


def test_latents_are_judged_bit_for_bit_only_where_requests_run_alone(tmp_path) -> None:
    exact = {0: torch.zeros(2), 1: torch.ones(2)}
    nudged = {0: torch.zeros(2), 1: torch.ones(2) + 2**-20}
    results = [
        RolloutResult(mode, 1.0, 1.0, 2, None, 2, 0.1, latents=latents, max_num_seqs=max_num_seqs)
        for max_num_seqs in (1, 8)
        for mode, latents in (("off", exact), ("ours", nudged))
    ]
    checks = report.check_exactness(results)
    assert [check.max_num_seqs for check in checks] == [1, 8]
    assert checks[0].compared["ours"] == report.Comparison(1, 2, 2**-20)
    assert not checks[0].passed and checks[1].passed
    first, second = report.exactness_lines(checks)
    assert "final latents NOT identical to no cache" in first
    assert "within 0.0001, not judged bit for bit" in second


def test_a_misplaced_row_fails_the_batched_check() -> None:
    """Above max_num_seqs 1 rounding is tolerated; a row or copy in the wrong place is not."""
    results = [
        RolloutResult("off", 1.0, 1.0, 2, None, 2, 0.1, latents={0: torch.zeros(2), 1: torch.ones(2)}, max_num_seqs=8),
        RolloutResult("ours", 1.0, 1.0, 2, None, 2, 0.1, latents={0: torch.ones(2), 1: torch.zeros(2)}, max_num_seqs=8),
    ]
    (check,) = report.check_exactness(results)
    assert not check.within_tolerance and not check.passed
    assert "NOT within 0.0001" in report.exactness_lines([check])[0]


def _parsed(*arguments: str):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(list(arguments))
    command.validate(parser, args)
    return args


def test_replicas_default_to_our_cache_under_every_policy_at_max_num_seqs_1() -> None:
    single = _parsed()
    assert (single.modes, single.max_num_seqs, single.lb_policy) == (("off", "stock", "ours"), (1, 8), None)
    replicated = _parsed("--replicas", "2")
    assert (replicated.modes, replicated.max_num_seqs) == (("ours",), (1,))
    assert replicated.lb_policy == ("random", "round-robin", "least-queue-length", "prompt-affinity")
    chosen = _parsed("--replicas", "4", "--lb-policy", "prompt-affinity", "--modes", "off,ours", "--max-num-seqs", "8")
    assert (chosen.modes, chosen.max_num_seqs, chosen.lb_policy) == (("off", "ours"), (8,), ("prompt-affinity",))


def test_each_model_gets_its_own_size_and_batching_defaults() -> None:
    qwen, wan, sd3 = _parsed(), _parsed("--model", "wan2.2"), _parsed("--model", "sd3")
    assert (qwen.model, qwen.size, qwen.max_num_seqs) == ("qwen-image", 64, (1, 8))
    assert (wan.model, wan.size, wan.max_num_seqs) == ("wan2.2", 32, (1,))
    assert (sd3.model, sd3.size, sd3.max_num_seqs) == ("sd3", 64, (1, 8))  # verl-omni's SD3 adapter batches
    assert command._model("./saved-qwen-image") == Path("./saved-qwen-image")  # a path, whatever its name


@pytest.mark.parametrize("arrival", ["interleaved", "grouped", "shuffled"])
def test_every_arrival_order_sends_each_prompts_siblings_once(arrival) -> None:
    spec = RolloutSpec(model_dir=None, prompts=("a", "b", "c"), group_size=4, arrival=arrival)
    requests = spec.requests()
    assert sorted(prompt for _, prompt, _ in requests) == [0] * 4 + [1] * 4 + [2] * 4
    assert [index for index, _, _ in requests] == list(range(12))
    if arrival == "grouped":
        assert [prompt for _, prompt, _ in requests][:4] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="unknown arrival 'bursty'"):
        RolloutSpec(model_dir=None, prompts=("a",), group_size=1, arrival="bursty")


def test_runs_with_replicas_are_told_apart_by_policy() -> None:
    def result(policy, latents, routing=None):
        return RolloutResult(
            "ours", 1.0, 1.0, 2, CacheStats(hits=1, misses=3), 3, 0.1, latents=latents, lb_policy=policy,
            replica_by_request={0: 0, 1: 1}, encoder_runs_per_replica=(2, 1), routing=routing,
        )  # fmt: skip

    latents = {0: torch.zeros(2), 1: torch.ones(2)}
    routing = {"placements": {"home": 1, "with siblings": 1}, "fallback_reasons": {}, "peak_load_over_bound": 1.0}
    results = [result("random", latents), result("prompt-affinity", latents, {**routing, "epsilon": 0.25})]
    (check,) = report.check_exactness(results)
    assert check.reference == "ours/random" and check.passed
    assert "vllm-omni-prompt-cache (prompt-affinity) 2/2 identical" in report.exactness_lines([check])[0]
    header, *rows = report.table_rows(results)
    assert header[2:5] == ["lb policy", "requests per replica", "encoder runs per replica"]
    assert rows[1][2:5] == ["prompt-affinity", "1 + 1", "2 + 1"] and rows[1][-2] == "1.00" and rows[0][-2] == "-"
    spec = RolloutSpec(model_dir=None, prompts=("a", "b"), group_size=1, replicas=2)
    fewest, placed = report.replica_lines(spec, results)
    assert "= 4." in fewest  # 2 prompts + the negative on each of 2 replicas
    assert "placed 1 home, 1 with siblings; fallbacks: none; fullest replica at 100% of its bound" in placed
