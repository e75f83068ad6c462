"""The plugin against the real installed vLLM-Omni 0.30: entry points, bindings, hook-point gate, switch."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm_omni", reason="the plugin tests need the vllm-omni extra")

from vllm_omni_prompt_cache import MISS, PromptEmbedCache, PromptEmbedCacheSettings
from vllm_omni_prompt_cache.store.prompt_embed_cache import UNSPECIFIED_REASON
from vllm_omni_prompt_cache.vllm_omni import bindings, runner

RUNNER = "vllm_omni.diffusion.worker.diffusion_model_runner"


def test_entry_points_are_discovered() -> None:
    def group(name: str) -> dict[str, str]:
        return {ep.name: ep.value for ep in entry_points(group=name)}

    plugin = "vllm_omni_prompt_cache.vllm_omni.plugin"
    assert group("vllm_omni.general_plugins")["prompt_embed_cache"] == f"{plugin}:register"
    assert group("vllm.general_plugins")["prompt_embed_cache"] == f"{plugin}:register_vllm"
    for platform_group in ("vllm_omni.platform_plugins", "vllm.platform_plugins"):
        assert group(platform_group)["prompt_embed_cache_early"] == f"{plugin}:register_at_platform_detection"


EARLY_REGISTRATION = """
    import json, sys
    from vllm_omni_prompt_cache.vllm_omni import imports, plugin
    offered = plugin.register_at_platform_detection()
    assert "vllm_omni" not in sys.modules  # it only arranged hooks, importing nothing of vLLM-Omni
    print(json.dumps({"offered": offered, "awaited": sorted(imports._callbacks)}))
"""


def test_the_early_registration_hooks_every_module_and_offers_no_platform() -> None:
    """In a fresh process, as platform detection runs it: every hook is awaited and None is returned."""
    result = run_python(EARLY_REGISTRATION)
    assert result.returncode == 0, result.stderr[-3000:]
    registered = json.loads(result.stdout.strip().splitlines()[-1])
    assert registered["offered"] is None  # what both frameworks read as "no platform here"
    assert registered["awaited"] == sorted(
        [
            "vllm_omni.config.config_factory",
            "vllm_omni.diffusion.cache.prompt_embed_cache",
            "vllm_omni.diffusion.diffusion_engine",
            "vllm_omni.diffusion.lora.manager",
            "vllm_omni.diffusion.worker.diffusion_model_runner",
            "vllm_omni.diffusion.worker.diffusion_worker",
            "vllm_omni.engine.omni_engine_base",
            "vllm_omni.engine.orchestrator",
            "vllm_omni.engine.stage_pool",
            "vllm_omni.engine.stage_runtime",
            "vllm_omni.entrypoints.cli.serve",
        ]
    )


def test_a_failing_early_registration_is_logged_once_and_detection_goes_on(monkeypatch, caplog) -> None:
    from vllm_omni_prompt_cache.vllm_omni import plugin

    def broken() -> None:
        raise RuntimeError("hook table unreadable")

    monkeypatch.setattr(plugin, "register_vllm", broken)
    with caplog.at_level(logging.ERROR, logger="vllm_omni_prompt_cache"):
        assert plugin.register_at_platform_detection() is None
    (record,) = [r for r in caplog.records if r.name == "vllm_omni_prompt_cache"]
    assert record.getMessage() == "vllm-omni-prompt-cache: could not register the prompt-embed cache integration"
    assert record.exc_info[1].args == ("hook table unreadable",)


def test_every_stock_binding_is_ours_after_the_plugins_load() -> None:
    from vllm_omni.plugins import load_omni_general_plugins

    load_omni_general_plugins()
    import vllm_omni.diffusion.cache as cache_package
    import vllm_omni.diffusion.cache.prompt_embed_cache as cache_module
    import vllm_omni.diffusion.worker.diffusion_model_runner as runner_module

    for module in (cache_module, cache_package):
        for name, ours in bindings.PUBLIC_API.items():
            assert getattr(module, name) is ours, name
    assert cache_module._CACHE_MISS is MISS
    assert runner_module.install_prompt_embed_cache is runner._installed_after_load_model
    assert runner_module.DiffusionModelRunner.load_model.__wrapped__.__qualname__ == "DiffusionModelRunner.load_model"


def test_upstreams_own_wrapper_runs_on_our_store() -> None:
    """Code written against upstream's get/put contract (here: upstream's wrapper itself) keeps working."""
    spec = importlib.util.spec_from_file_location("upstream_copy", bindings.upstream_cache_module().__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # a fresh copy of upstream's module
    upstream_install = module.install_prompt_embed_cache  # upstream's wrapper, reading the module's globals
    bindings.patch_cache_module(module)  # the swap the plugin makes on the real module
    assert module.PromptEmbedCache is PromptEmbedCache and module._CACHE_MISS is MISS

    class Pipeline:
        runs = 0

        def encode_prompt(self, prompt, num_images_per_prompt=1):
            Pipeline.runs += 1
            return torch.full((num_images_per_prompt, 2), float(len(prompt)))

    pipeline = Pipeline()
    cache = upstream_install(pipeline, max_size=2, enabled=True, model_tag="t")
    assert isinstance(cache, PromptEmbedCache)
    for _ in range(3):
        pipeline.encode_prompt("a red fox")
    pipeline.encode_prompt(torch.tensor([1, 2]))  # upstream's key builder refuses tensors
    assert (cache.hits, cache.misses, Pipeline.runs) == (2, 1, 2)
    assert cache.stats()["bypass_reasons"] == {UNSPECIFIED_REASON: 1}


def test_the_vllm_omni_backend_installs_upstreams_untouched_cache() -> None:
    import vllm_omni.diffusion.cache.prompt_embed_cache  # noqa: F401  (swapped by the plugin by now)

    class Pipeline:
        def encode_prompt(self, prompt_ids):
            return prompt_ids * 2

    stock = runner.install_for_stage(Pipeline(), PromptEmbedCacheSettings(enabled=True, backend="vllm-omni"), "t")
    ours = runner.install_for_stage(Pipeline(), PromptEmbedCacheSettings(enabled=True), "t")
    off = runner.install_for_stage(Pipeline(), PromptEmbedCacheSettings(enabled=False), "t")
    assert type(stock).__module__ == bindings.upstream_cache_module().__name__
    assert type(stock).__name__ == "PromptEmbedCache" and not isinstance(stock, PromptEmbedCache)
    assert isinstance(ours, PromptEmbedCache)
    assert off is None


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = dict(os.environ, VLLM_OMNI_PROMPT_CACHE_CPU_PLATFORM="1", **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=environment
    )


RUNNER_FIRST = f"""
    import vllm_omni_prompt_cache.vllm_omni.plugin as plugin
    plugin._registered = True  # hold back the early registration so the runner is imported first
    import {RUNNER} as runner_module
    import vllm_omni.diffusion.cache.prompt_embed_cache as stock
    assert runner_module.install_prompt_embed_cache is stock.install_prompt_embed_cache  # upstream's, for now
    plugin._registered = False
    from vllm_omni.plugins import load_omni_general_plugins
    load_omni_general_plugins()
    from vllm_omni_prompt_cache.vllm_omni import runner
    assert runner_module.install_prompt_embed_cache is runner._installed_after_load_model
    assert hasattr(runner_module.DiffusionModelRunner.load_model, "__wrapped__")
    print("rebound")
"""

STOCK_KEPT = f"""
    import importlib.metadata, logging, pathlib
    logging.basicConfig(level=logging.INFO)
    {{prelude}}
    import {RUNNER} as runner_module
    import vllm_omni.diffusion.cache.prompt_embed_cache as stock
    assert runner_module.install_prompt_embed_cache is stock.install_prompt_embed_cache
    assert stock.PromptEmbedCache.__module__ == "vllm_omni.diffusion.cache.prompt_embed_cache"
    assert not hasattr(runner_module.DiffusionModelRunner.load_model, "__wrapped__")
    print("stock kept")
"""
HOOKED = f"""
    import importlib.metadata, logging, pathlib
    logging.basicConfig(level=logging.INFO)
    {{prelude}}
    import {RUNNER} as runner_module
    from vllm_omni.engine.orchestrator import OrchestratorBase
    from vllm_omni_prompt_cache.vllm_omni import runner
    assert runner_module.install_prompt_embed_cache is runner._installed_after_load_model
    print("metrics hooked" if hasattr(OrchestratorBase._absorb_diffusion_metrics, "__wrapped__") else "metrics stock")
    print("hooked")
"""
FAKE_NEWER_VERSION = (
    "real_version = importlib.metadata.version; "
    'importlib.metadata.version = lambda name: "0.31.0" if name == "vllm-omni" else real_version(name)'
)


def sources_lacking(tmp_path, module: str, definition: str):
    """Copy the installed vLLM-Omni modules the plugin hooks to ``tmp_path``, ``definition`` renamed in ``module``."""
    from vllm_omni_prompt_cache.vllm_omni.hook_points import HOOK_POINTS, _module_file, vllm_omni_source_root

    real_root, root = vllm_omni_source_root(), tmp_path / "vllm_omni"
    for name in {point.module for point in HOOK_POINTS}:
        source = _module_file(real_root, name)
        copy = root / source.relative_to(real_root)
        copy.parent.mkdir(parents=True, exist_ok=True)
        text = source.read_text()
        if name == module:
            assert definition in text
            text = text.replace(definition, definition.replace("def ", "def renamed_"))
        copy.write_text(text)
    return root


def with_sources(root) -> str:
    return (
        f"{FAKE_NEWER_VERSION}; import vllm_omni_prompt_cache.vllm_omni.hook_points as hook_points; "
        f"hook_points.vllm_omni_source_root = lambda: pathlib.Path({str(root)!r})"
    )


def runner_imported_first() -> subprocess.CompletedProcess:
    return run_python(RUNNER_FIRST)


def newer_version_hooked() -> subprocess.CompletedProcess:
    return run_python(HOOKED.format(prelude=FAKE_NEWER_VERSION))


def lacking_a_cache_hook_point(scratch: Path) -> subprocess.CompletedProcess:
    root = sources_lacking(scratch, "vllm_omni.diffusion.worker.diffusion_worker", "def sleep(")
    return run_python(STOCK_KEPT.format(prelude=with_sources(root)))


def lacking_a_feature_hook_point(scratch: Path) -> subprocess.CompletedProcess:
    root = sources_lacking(scratch, "vllm_omni.engine.orchestrator", "def _absorb_diffusion_metrics(")
    return run_python(HOOKED.format(prelude=with_sources(root)))


def switched_off_by_environment() -> subprocess.CompletedProcess:
    return run_python(STOCK_KEPT.format(prelude="pass"), VLLM_OMNI_PROMPT_CACHE_PLUGIN="0")


def test_rebinds_a_runner_module_imported_before_the_plugin_loaded() -> None:
    result = runner_imported_first()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rebound" in result.stdout


def test_another_version_with_every_hook_point_is_hooked_and_says_so_once() -> None:
    result = newer_version_hooked()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hooked" in result.stdout and "metrics hooked" in result.stdout
    from vllm_omni_prompt_cache.vllm_omni.releases import tested_list

    assert result.stderr.count(f"(tested on vLLM-Omni {tested_list()}) found 0.31.0, which has all") == 1


def test_a_version_lacking_a_cache_hook_point_stays_inert_and_names_it(tmp_path) -> None:
    result = lacking_a_cache_hook_point(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stock kept" in result.stdout
    said = "found 0.31.0, which lacks hook points the cache needs: vllm_omni.diffusion.worker.diffusion_worker."
    assert result.stderr.count(said + "DiffusionWorker.sleep. Staying inert") == 1


def test_a_version_lacking_a_feature_hook_point_turns_only_that_feature_off(tmp_path) -> None:
    result = lacking_a_feature_hook_point(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hooked" in result.stdout and "metrics stock" in result.stdout
    said = "The cache is active; the /metrics families stay off, for want of: vllm_omni.engine.orchestrator."
    assert result.stderr.count(said + "OrchestratorBase._absorb_diffusion_metrics.") == 1


def test_switched_off_by_environment_keeps_stock_behaviour() -> None:
    result = switched_off_by_environment()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stock kept" in result.stdout
    assert "VLLM_OMNI_PROMPT_CACHE_PLUGIN=0, vLLM-Omni keeps its own prompt-embed cache" in result.stderr
    assert "found 0.31.0" not in result.stderr


def test_register_vllm_is_inert_without_vllm_omni(monkeypatch) -> None:
    from vllm_omni_prompt_cache.vllm_omni import plugin

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin.importlib.util, "find_spec", lambda name: None)
    plugin.register_vllm()
    assert plugin._registered is False


SERVED_PROCESS_LOGGING = """
    import logging
    import vllm  # platform detection registers the plugin; nothing configured the root logger
    ours, vllm_logger = logging.getLogger("vllm_omni_prompt_cache"), logging.getLogger("vllm")
    assert ours.handlers == vllm_logger.handlers and vllm_logger.handlers and not ours.propagate
    ours.info("prompt-cache marker line")
    logging.basicConfig()  # an application configuring logging later must not get the line twice
    ours.info("prompt-cache second marker")
"""


def served_process_logging() -> subprocess.CompletedProcess:
    return run_python(SERVED_PROCESS_LOGGING, VLLM_LOGGING_LEVEL="INFO")  # the demo's in-process run sets ERROR


def test_our_log_lines_show_with_vllms_handler_in_a_served_process() -> None:
    result = served_process_logging()
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    (line,) = [each for each in output.splitlines() if "prompt-cache marker line" in each]
    assert line.startswith("INFO ") and "[<string>:" in line  # vLLM's format: level, time, [file:line]
    assert output.count("prompt-cache second marker") == 1
