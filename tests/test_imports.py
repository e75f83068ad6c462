"""The hooking helpers the plugin rides on: a hook that fails, or finds its name missing, never breaks an import.

Each test writes a real module to a temporary directory and imports it through Python's import
system, with the plugin's post-import finder in place, as vLLM-Omni's modules are imported.
"""

from __future__ import annotations

import importlib
import logging
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from vllm_omni_prompt_cache.vllm_omni import imports, lifecycle, runner

LOGGER = "vllm_omni_prompt_cache"


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("hook_probe_"):
            del sys.modules[name]


def write_module(directory: Path, name: str, source: str) -> str:
    (directory / f"{name}.py").write_text(textwrap.dedent(source))
    importlib.invalidate_caches()
    return name


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(LOGGER) and r.levelno == level]


def test_a_raising_hook_is_logged_once_and_neither_the_import_nor_later_hooks_break(module_dir, caplog) -> None:
    name = write_module(module_dir, "hook_probe_raising", "VALUE = 41\n")
    seen: list[ModuleType] = []

    def explode(module: ModuleType) -> None:
        raise RuntimeError("layout changed")

    imports.when_imported(name, explode)
    imports.when_imported(name, seen.append)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        module = importlib.import_module(name)
    assert module.VALUE == 41
    assert seen == [module]  # the hook after the failing one still ran
    (error,) = records(caplog, logging.ERROR)
    assert error.getMessage() == f"vllm-omni-prompt-cache: hook {explode.__qualname__} on {name} failed"
    assert error.exc_info[1].args == ("layout changed",)


def test_a_real_hook_on_a_module_without_its_class_is_logged_and_the_import_succeeds(module_dir, caplog) -> None:
    name = write_module(module_dir, "hook_probe_no_worker", "class SomethingElse:\n    pass\n")
    imports.when_imported(name, lifecycle.patch_worker)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        module = importlib.import_module(name)
    assert module.SomethingElse.__name__ == "SomethingElse"
    (error,) = records(caplog, logging.ERROR)
    assert error.getMessage() == f"vllm-omni-prompt-cache: hook patch_worker on {name} failed"
    assert isinstance(error.exc_info[1], AttributeError)


def test_missing_methods_are_each_said_once_and_the_present_ones_are_hooked(module_dir, caplog) -> None:
    """A LoRA manager of another vLLM-Omni version, with two of the four methods every release has (the
    optional fifth, ``_reset_lora_layers``, is hooked where present and not missed where absent)."""
    name = write_module(
        module_dir,
        "hook_probe_lora",
        """
        class DiffusionLoRAManager:
            def add_adapter(self, request):
                return True

            def remove_adapter(self, adapter_id):
                return True
        """,
    )
    imports.when_imported(name, lifecycle.patch_lora_manager)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        manager = importlib.import_module(name).DiffusionLoRAManager
    assert getattr(manager.add_adapter, "_prompt_cache_hooked", False)
    assert getattr(manager.remove_adapter, "_prompt_cache_hooked", False)
    assert [r.getMessage() for r in records(caplog, logging.WARNING)] == [
        f"vllm-omni-prompt-cache: {name}.DiffusionLoRAManager has no {method} to hook; that part stays stock."
        for method in ("_activate_adapter", "_deactivate_all_adapters")
    ]
    assert records(caplog, logging.ERROR) == []


def test_a_runner_module_without_its_install_point_keeps_the_worker_stock(module_dir, caplog) -> None:
    name = write_module(
        module_dir,
        "hook_probe_runner",
        """
        class DiffusionModelRunner:
            def load_model(self):
                return "stock"
        """,
    )
    imports.when_imported(name, runner.patch_runner_module)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        module = importlib.import_module(name)
    assert not hasattr(module.DiffusionModelRunner.load_model, "__wrapped__")
    (warning,) = records(caplog, logging.WARNING)
    assert warning.getMessage() == (
        f"vllm-omni-prompt-cache: {name} has no install_prompt_embed_cache / DiffusionModelRunner.load_model; "
        "the worker keeps vLLM-Omni's cache."
    )
