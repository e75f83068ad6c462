"""The plugin against the real installed vLLM-Omni 0.30: entry points, bindings, version gate, switch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm_omni", reason="the plugin tests need the vllm-omni extra")

from vllm_omni_prompt_cache import PromptEmbedCache, install_prompt_embed_cache
from vllm_omni_prompt_cache.vllm_omni import bindings

RUNNER = "vllm_omni.diffusion.worker.diffusion_model_runner"


def test_general_plugin_entry_points_are_discovered() -> None:
    omni = {ep.name: ep.value for ep in entry_points(group="vllm_omni.general_plugins")}
    vllm = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert omni["prompt_embed_cache"] == "vllm_omni_prompt_cache.vllm_omni.plugin:register"
    assert vllm["prompt_embed_cache"] == "vllm_omni_prompt_cache.vllm_omni.plugin:register_vllm"


def test_every_stock_binding_is_ours_after_the_plugins_load() -> None:
    from vllm_omni.plugins import load_omni_general_plugins

    load_omni_general_plugins()
    import vllm_omni.diffusion.cache as cache_package
    import vllm_omni.diffusion.cache.prompt_embed_cache as cache_module
    import vllm_omni.diffusion.worker.diffusion_model_runner as runner

    for module in (cache_module, cache_package):
        assert module.install_prompt_embed_cache is install_prompt_embed_cache
        assert module.PromptEmbedCache is PromptEmbedCache
    assert runner.install_prompt_embed_cache is bindings.install_for_runner
    assert runner.resolve_prompt_embed_cache_config is bindings.resolve_for_runner


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    import os

    environment = {**os.environ, "VLLM_OMNI_PROMPT_CACHE_CPU_PLATFORM": "1", **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=environment
    )


RUNNER_FIRST = f"""
    import vllm_omni_prompt_cache.vllm_omni.plugin as plugin
    plugin._registered = True  # hold back the early registration so the runner is imported first
    import {RUNNER} as runner
    import vllm_omni.diffusion.cache.prompt_embed_cache as stock
    assert runner.install_prompt_embed_cache is stock.install_prompt_embed_cache  # upstream's, for now
    plugin._registered = False
    from vllm_omni.plugins import load_omni_general_plugins
    load_omni_general_plugins()
    from vllm_omni_prompt_cache.vllm_omni import bindings
    assert runner.install_prompt_embed_cache is bindings.install_for_runner, runner.install_prompt_embed_cache
    print("rebound")
"""

UNSUPPORTED = f"""
    import importlib.metadata, logging
    real_version = importlib.metadata.version
    importlib.metadata.version = lambda name: "0.31.0" if name == "vllm-omni" else real_version(name)
    import {RUNNER} as runner
    import vllm_omni.diffusion.cache.prompt_embed_cache as stock
    assert runner.install_prompt_embed_cache is stock.install_prompt_embed_cache
    assert stock.PromptEmbedCache.__module__ == "vllm_omni.diffusion.cache.prompt_embed_cache"
    print("stock kept")
"""


def test_rebinds_a_runner_module_imported_before_the_plugin_loaded() -> None:
    result = run_python(RUNNER_FIRST)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rebound" in result.stdout


def test_unsupported_version_warns_once_and_keeps_stock_behaviour() -> None:
    result = run_python(UNSUPPORTED)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stock kept" in result.stdout
    assert result.stderr.count("supports vLLM-Omni 0.30.x, found 0.31.0") == 1


def test_switched_off_by_environment_keeps_stock_behaviour() -> None:
    code = UNSUPPORTED.replace("importlib.metadata.version = lambda", "_unused = lambda")
    result = run_python(code, VLLM_OMNI_PROMPT_CACHE_PLUGIN="0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stock kept" in result.stdout


def test_register_vllm_is_inert_without_vllm_omni(monkeypatch) -> None:
    from vllm_omni_prompt_cache.vllm_omni import plugin

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin.importlib.util, "find_spec", lambda name: None)
    plugin.register_vllm()
    assert plugin._registered is False


def test_stock_mode_installs_upstreams_cache_for_comparisons() -> None:
    import vllm_omni.diffusion.cache.prompt_embed_cache  # noqa: F401  (binds the stock objects)

    class Pipeline:
        def encode_prompt(self, prompt_ids):
            return prompt_ids * 2

    with bindings.stock_prompt_embed_cache():
        stock_cache = bindings.install_for_runner(Pipeline(), max_size=4, model_tag="t")
    ours = bindings.install_for_runner(Pipeline(), max_size=4, model_tag="t")
    assert type(stock_cache).__module__ == "vllm_omni.diffusion.cache.prompt_embed_cache"
    assert isinstance(ours, PromptEmbedCache)
    assert not isinstance(stock_cache, PromptEmbedCache)
