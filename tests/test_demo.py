"""The main job at a tiny size: the demo runs every mode at two max_num_seqs, checks exactness, writes its report."""

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
    argv = ["demo", "--model", model_dir, "--prompts", "2", "--group-size", "3", "--steps", "2"]
    argv += ["--max-num-seqs", "1,4", "--out", str(out)]
    code = main(argv)
    printed = capfd.readouterr().out
    assert code == 0
    for label in ("no cache", "vLLM-Omni 0.30 cache", "vllm-omni-prompt-cache"):  # the release make test installs
        assert label in printed
    assert "Exactness at max_num_seqs 1: final latents bit-identical" in printed
    assert "At max_num_seqs 4, final latents against no cache" in printed
    assert "of the uncached rollout at max_num_seqs 1" in printed

    numbers = json.loads((out / "results.json").read_text())
    runs = {(run["max_num_seqs"], run["mode"]): run for run in numbers["runs"]}
    assert len(runs) == 6
    rows = 2 * 2 * 3  # a positive and a negative row per request
    for max_num_seqs in (1, 4):
        ours, stock, off = (runs[max_num_seqs, mode] for mode in ("ours", "stock", "off"))
        assert off["text_encoder_rows"] == stock["text_encoder_rows"] == rows
        assert ours["text_encoder_rows"] == 3  # two prompts and the shared negative prompt
        assert ours["cache_stats"]["rows_encoded"] == 3
    assert runs[1, "off"]["text_encoder_runs"] == rows  # one row per call at max_num_seqs 1
    assert runs[1, "ours"]["cache_stats"]["hits"] == rows - 3
    assert runs[1, "stock"]["cache_stats"]["bypassed"] == rows
    assert runs[4, "off"]["text_encoder_runs"] < rows  # requests were batched into shared calls
    exactness = {check["max_num_seqs"]: check for check in numbers["exactness"]}
    assert exactness[1]["all_identical"] is True and exactness[1]["bit_identity_expected"] is True
    assert exactness[4]["bit_identity_expected"] is False
    assert exactness[4]["within_tolerance"] is True and exactness[4]["passed"] is True
    report = (out / "report.md").read_text()
    command = f"vllm-omni-prompt-cache {' '.join(argv)}"
    assert f"Command: `{command}`" in report
    assert numbers["command"] == command
    assert "| 1 | vllm-omni-prompt-cache | 3 | 3 |" in report
    assert (out / "time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
