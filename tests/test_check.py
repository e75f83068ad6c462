"""``vllm-omni-prompt-cache check`` against the real installed environment, and with parts of it taken away."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_omni_prompt_cache.vllm_omni import hook_points
from vllm_omni_prompt_cache.vllm_omni.check import check

pytest.importorskip("vllm_omni", reason="the check reads the installed vLLM-Omni")


def run_check() -> tuple[int, list[str]]:
    lines: list[str] = []
    return check(say=lines.append), lines


def test_the_installed_environment_is_active_and_the_command_says_so_without_importing_vllm() -> None:
    code = "import sys; from vllm_omni_prompt_cache.cli import main; rc = main(['check']); "
    code += "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'vllm_omni'))); sys.exit(rc)"
    environment = {key: value for key, value in os.environ.items() if not key.startswith("OMNI_DIFFUSION_")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environment)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("installed: vllm-omni-prompt-cache 0.1.0, vllm-omni 0.30.0")
    assert "entry points: all registered" in lines
    assert "  the prompt-embed cache: 19 of 19 hook points found: on" in lines
    assert lines[-2].startswith("active: diffusion engines in this environment use the content-keyed cache")
    assert lines[-1] == "[]"  # neither vLLM nor vLLM-Omni was imported


def test_a_bad_environment_variable_is_named(monkeypatch) -> None:
    monkeypatch.setenv("OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE", "abc")
    code, lines = run_check()
    assert code == 1
    assert any(
        line.startswith(
            "not active: invalid prompt_embed_cache_size='abc' from environment variable "
            "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE: expected an integer >= 1"
        )
        for line in lines
    )


def test_switched_off_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_OMNI_PROMPT_CACHE_PLUGIN", "0")
    monkeypatch.setenv("OMNI_DIFFUSION_PROMPT_EMBED_CACHE", "off")
    code, lines = run_check()
    assert code == 1
    assert "not active: VLLM_OMNI_PROMPT_CACHE_PLUGIN=0 switches the plugin off" in lines
    assert (
        "not active: OMNI_DIFFUSION_PROMPT_EMBED_CACHE switches the cache off, whatever the kwargs and flags say"
        in lines
    )


def test_a_vllm_omni_without_a_cache_hook_point_is_not_active(monkeypatch, tmp_path) -> None:
    root = tmp_path / "vllm_omni"
    root.mkdir()
    (root / "__init__.py").write_text("")
    monkeypatch.setattr(hook_points, "vllm_omni_source_root", lambda: root)  # sources with none of the hooks
    code, lines = run_check()
    assert code == 1
    assert any(
        line.startswith("  the prompt-embed cache: 0 of 19 hook points found: off, for want of ") for line in lines
    )
    assert "not active: vLLM-Omni 0.30.0 lacks hook points the cache needs" in lines
