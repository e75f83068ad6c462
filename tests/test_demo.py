"""The main job at a tiny size: the demo runs all three modes, checks exactness, writes its report."""

from __future__ import annotations

import json

import pytest
from engine_support import tiny_spec

from vllm_omni_prompt_cache.cli import main


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(tiny_spec().model_dir)


@pytest.mark.engine
def test_demo_runs_three_modes_and_writes_a_report(model_dir, tmp_path, capfd) -> None:
    out = tmp_path / "report"
    code = main(
        ["demo", "--model", model_dir, "--prompts", "2", "--group-size", "3", "--steps", "2", "--out", str(out)]
    )
    printed = capfd.readouterr().out
    assert code == 0
    for label in ("no cache", "vLLM-Omni 0.30 cache", "vllm-omni-prompt-cache"):
        assert label in printed
    assert "Exactness: final latents bit-identical" in printed
    assert "of the uncached rollout" in printed

    numbers = json.loads((out / "results.json").read_text())
    ours, stock, off = (numbers["modes"][mode] for mode in ("ours", "stock", "off"))
    calls = 2 * 2 * 3  # positive and negative encode per request
    assert off["text_encoder_runs"] == stock["text_encoder_runs"] == calls
    assert ours["text_encoder_runs"] == 3  # two prompts and the shared negative prompt
    assert ours["cache_stats"]["hits"] == calls - 3
    assert stock["cache_stats"]["bypassed"] == calls
    assert numbers["exactness"]["all_identical"] is True
    assert numbers["exactness"]["identical_requests"] == {"stock": [6, 6], "ours": [6, 6]}
    report = (out / "report.md").read_text()
    command = f"vllm-omni-prompt-cache demo --model {model_dir} --prompts 2 --group-size 3 --steps 2 --out {out}"
    assert f"Command: `{command}`" in report
    assert numbers["command"] == command
    assert "| vllm-omni-prompt-cache | 3 |" in report
    assert (out / "time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
