"""The hook-point survey: against the installed vLLM-Omni 0.30 sources, and against small written sources."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from vllm_omni_prompt_cache.vllm_omni.hook_points import (
    CACHE,
    FEATURES,
    HOOK_POINTS,
    HookPoint,
    every_choice,
    found_choice,
    missing_hook_points,
    vllm_omni_source_root,
)


def test_the_installed_vllm_omni_has_every_hook_point_and_was_not_imported_to_find_out() -> None:
    pytest.importorskip("vllm_omni", reason="needs the vllm-omni extra")
    root = vllm_omni_source_root()
    assert root is not None and (root / "__init__.py").is_file()
    assert missing_hook_points(root) == []
    assert {point.feature for point in HOOK_POINTS} == set(FEATURES)


def test_the_survey_imports_nothing_of_vllm_omni(tmp_path) -> None:
    import subprocess

    code = (
        "import sys; from vllm_omni_prompt_cache.vllm_omni.hook_points import missing_hook_points, "
        "vllm_omni_source_root; root = vllm_omni_source_root(); "
        "print(root is None or missing_hook_points(root) == [], "
        "sorted(name for name in sys.modules if name.split('.')[0] in ('vllm', 'vllm_omni')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "[]"]


def write_module(root, dotted: str, source: str) -> None:
    path = root.joinpath(*dotted.split(".")[1:]).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))


def test_names_are_found_where_python_binds_them(tmp_path) -> None:
    root = tmp_path / "vllm_omni"
    write_module(
        root,
        "vllm_omni.worker",
        """
        import os.path
        from elsewhere import imported as renamed
        try:
            from fast import maybe
        except ImportError:
            maybe = None
        if os.path:
            LIMIT: int = 3
        class Worker:
            value = 1
            async def run(self): ...
            @classmethod
            def build(cls): ...
            def helper(self):
                def nested(): ...
        def nested_elsewhere(): ...
        """,
    )
    found = [HookPoint(CACHE, "vllm_omni.worker", None, name) for name in ("os", "renamed", "maybe", "LIMIT")]
    found += [HookPoint(CACHE, "vllm_omni.worker", "Worker", name) for name in ("value", "run", "build", "helper")]
    lacking = [
        HookPoint(CACHE, "vllm_omni.worker", None, "imported"),  # bound under its alias only
        HookPoint(CACHE, "vllm_omni.worker", None, "run"),  # a method, not a module-level name
        HookPoint(CACHE, "vllm_omni.worker", "Worker", "nested"),  # inside a method, not the class body
        HookPoint(CACHE, "vllm_omni.worker", "Missing", "run"),
        HookPoint(CACHE, "vllm_omni.absent", None, "anything"),  # no such file
    ]
    assert missing_hook_points(root, [*found, *lacking]) == lacking


def test_a_package_module_and_an_unparsable_one(tmp_path) -> None:
    root = tmp_path / "vllm_omni"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("def hook(): ...\n")
    (root / "broken.py").write_text("def hook(:\n")
    in_package = HookPoint(CACHE, "vllm_omni.pkg", None, "hook")
    in_broken = HookPoint(CACHE, "vllm_omni.broken", None, "hook")
    assert missing_hook_points(root, [in_package, in_broken]) == [in_broken]
    assert str(in_package) == "vllm_omni.pkg.hook"


def test_conditional_and_unpacked_names_are_read_as_python_binds_them(tmp_path) -> None:
    root = tmp_path / "vllm_omni"
    write_module(
        root,
        "vllm_omni.typed",
        """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from heavy import OnlyForTypes
        first, (second, *rest) = 1, (2, 3)
        with open(__file__):
            OPENED = True
        """,
    )
    write_module(root, "vllm_omni.star", "from elsewhere import *\n")
    point = lambda module, name: HookPoint(CACHE, module, None, name)  # noqa: E731
    bound = [point("vllm_omni.typed", name) for name in ("first", "second", "rest", "OPENED", "TYPE_CHECKING")]
    only_for_types = point("vllm_omni.typed", "OnlyForTypes")  # never bound at run time
    from_star = point("vllm_omni.star", "anything")  # a star import may bind it: not reported missing
    assert missing_hook_points(root, [*bound, only_for_types, from_star]) == [only_for_types]


def test_an_older_releases_alternative_is_enough_and_an_optional_point_is_never_missing(tmp_path) -> None:
    """As 0.28 against 0.30: the stage builder lives elsewhere, and a helper only 0.30 has is absent."""
    root = tmp_path / "vllm_omni"
    write_module(root, "vllm_omni.engine", "class Engine:\n    def build(self): ...\n")
    newer = HookPoint(CACHE, "vllm_omni.factory", "Factory", "normalize")
    either = HookPoint(
        CACHE, "vllm_omni.factory", "Factory", "normalize", HookPoint(CACHE, "vllm_omni.engine", "Engine", "build")
    )
    neither = HookPoint(
        CACHE, "vllm_omni.factory", "Factory", "normalize", HookPoint(CACHE, "vllm_omni.engine", "Engine", "gone")
    )
    helper = HookPoint(CACHE, "vllm_omni.factory", "Factory", "reset", optional=True)
    assert missing_hook_points(root, [newer, either, neither, helper]) == [newer, neither]
    assert found_choice(either, root) == either.alternative and found_choice(neither, root) is None
    assert str(neither) == "vllm_omni.factory.Factory.normalize (or vllm_omni.engine.Engine.gone)"


RECORD_HOOKS = """
import importlib, json, sys, types
from vllm_omni_prompt_cache.vllm_omni import imports
from vllm_omni_prompt_cache.vllm_omni.hook_points import HOOK_POINTS, found_choice

replaced, real = [], imports.replace_once

def recording(owner, name, wrap):
    if isinstance(owner, types.ModuleType):
        replaced.append([owner.__name__, None, name])
    elif isinstance(owner, type):
        replaced.append([owner.__module__, owner.__qualname__, name])
    return real(owner, name, wrap)

imports.replace_once = recording  # before the hook modules bind it
for module in sorted({found_choice(point).module for point in HOOK_POINTS if found_choice(point) is not None}):
    importlib.import_module(module)  # the first import of vLLM registers the plugin; each import runs its hooks
from vllm_omni_prompt_cache.vllm_omni import balancer, cli_args, lifecycle, metrics, runner, settings  # noqa
print(json.dumps(replaced))
"""


def record_hooks():
    import subprocess

    environment = dict(os.environ, VLLM_OMNI_PROMPT_CACHE_CPU_PLATFORM="1")
    return subprocess.run(
        [sys.executable, "-c", RECORD_HOOKS], capture_output=True, text=True, timeout=300, env=environment
    )


def test_every_name_the_hooks_replace_is_a_listed_hook_point() -> None:
    """Run the real hooks on the installed vLLM-Omni, recording what they replace."""
    import json

    pytest.importorskip("vllm_omni", reason="needs the vllm-omni extra")
    result = record_hooks()
    assert result.returncode == 0, result.stderr[-3000:]
    replaced = {tuple(each) for each in json.loads(result.stdout.strip().splitlines()[-1])}
    listed = {(point.module, point.owner, point.name) for point in every_choice()}
    assert len(replaced) >= 15  # the worker, runner, LoRA, settings, serve, routing and metrics hooks all ran
    assert replaced - listed == set()
