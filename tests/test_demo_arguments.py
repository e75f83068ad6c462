"""The demo's command line: bad arguments and missing extras get one clear line, before any engine starts.

None of this needs vLLM-Omni installed.
"""

from __future__ import annotations

import pytest

from vllm_omni_prompt_cache.cli import main
from vllm_omni_prompt_cache.demo import command


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
        (["--model", "/nonexistent/model"], "argument --model: model directory '/nonexistent/model' does not exist"),
        (["--unknown-flag"], "unrecognized arguments: --unknown-flag"),
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
