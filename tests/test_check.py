"""``vllm-omni-prompt-cache check`` against the real installed environment, and with parts of it taken away."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

from vllm_omni_prompt_cache.vllm_omni import hook_points, releases
from vllm_omni_prompt_cache.vllm_omni.check import check

pytest.importorskip("vllm_omni", reason="the check reads the installed vLLM-Omni")
pytestmark = pytest.mark.release


INSTALLED = importlib.metadata.version("vllm-omni")
FEATURES_ON_EVERY_RELEASE = (
    hook_points.CACHE,
    hook_points.KWARGS,
    hook_points.DEPLOY_CONFIG,
    hook_points.OFFLOAD_COUNTS,
    hook_points.SERVE_FLAGS,
)


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
    assert lines[0].startswith(f"installed: vllm-omni-prompt-cache 0.3.0, vllm-omni {INSTALLED}")
    assert "entry points: all registered" in lines
    cache_points = len(hook_points.required(hook_points.CACHE))
    assert f"  the prompt-embed cache: {cache_points} of {cache_points} hook points found: on" in lines
    # Every feature is on where the installed release has its hook points, and said to be off where not.
    for feature, lacking in hook_points.missing_by_feature().items():
        state = "off, for want of " + ", ".join(map(str, lacking)) if lacking else "on"
        assert any(line.startswith(f"  {feature}: ") and line.endswith(state) for line in lines), feature
    if INSTALLED in releases.TESTED:
        assert not any(line.startswith("note:") for line in lines)
    assert lines[-2].startswith("active: diffusion engines in this environment use the content-keyed cache")
    assert lines[-1] == "[]"  # neither vLLM nor vLLM-Omni was imported


def test_the_releases_we_test_have_every_hook_point_of_the_cache_and_of_what_they_do() -> None:
    """What the support table says of each release (docs/support.md): the cache itself is on
    everywhere; routing and /metrics need 0.30's engine and orchestrator methods."""
    missing = hook_points.missing_by_feature()
    assert INSTALLED in releases.TESTED
    assert all(not missing[feature] for feature in FEATURES_ON_EVERY_RELEASE)
    newer = tuple(int(part) for part in INSTALLED.split(".")[:2]) >= (0, 30)
    assert bool(missing[hook_points.ROUTING]) is bool(missing[hook_points.METRICS]) is not newer


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
    cache_points = len(hook_points.required(hook_points.CACHE))
    assert any(
        line.startswith(f"  the prompt-embed cache: 0 of {cache_points} hook points found: off, for want of ")
        for line in lines
    )
    assert f"not active: vLLM-Omni {INSTALLED} lacks hook points the cache needs" in lines
