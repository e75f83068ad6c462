"""Every name in vLLM-Omni that the plugin hooks, and whether the installed vLLM-Omni has it.

The plugin decides from these, not from the version string, whether it can work on the vLLM-Omni
it finds: each hook point is looked up in the installed sources by parsing them (``ast``), without
importing vLLM-Omni, so the check is cheap enough for every process the plugin loads in and never
runs vLLM-Omni code. A missing hook point of the cache itself (where it is installed, where it
must be emptied) keeps the whole plugin inert, since a cache that outlived a weight change would
serve wrong embeddings; a missing hook point of a feature (serve flags, prompt-affinity routing,
metrics) turns that feature off.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CACHE = "the prompt-embed cache"
SERVE_FLAGS = "the serve flags"
ROUTING = "prompt-affinity routing"
METRICS = "the /metrics families"
FEATURES = (CACHE, SERVE_FLAGS, ROUTING, METRICS)


@dataclass(frozen=True)
class HookPoint:
    """A module-level name, or a name in a class's own body, that a hook replaces or calls."""

    feature: str
    module: str
    owner: str | None  # the class defined in ``module``; None for a module-level name
    name: str

    def __str__(self) -> str:
        return ".".join(part for part in (self.module, self.owner, self.name) if part)


def _points(feature: str, module: str, owner: str | None, *names: str) -> tuple[HookPoint, ...]:
    return tuple(HookPoint(feature, module, owner, name) for name in names)


WORKER = "vllm_omni.diffusion.worker.diffusion_worker"
#: What each hook in :mod:`.plugin` touches, by feature.
HOOK_POINTS: tuple[HookPoint, ...] = (
    *_points(
        CACHE,
        "vllm_omni.diffusion.cache.prompt_embed_cache",
        None,
        "install_prompt_embed_cache",
        "uninstall_prompt_embed_cache",
        "PromptEmbedCache",
        "resolve_prompt_embed_cache_config",
        "_CACHE_MISS",
    ),
    *_points(CACHE, "vllm_omni.diffusion.worker.diffusion_model_runner", None, "install_prompt_embed_cache"),
    *_points(CACHE, "vllm_omni.diffusion.worker.diffusion_model_runner", "DiffusionModelRunner", "load_model"),
    *_points(CACHE, WORKER, "DiffusionWorker", "sleep"),
    *_points(
        CACHE,
        "vllm_omni.diffusion.lora.manager",
        "DiffusionLoRAManager",
        "add_adapter",
        "remove_adapter",
        "_activate_adapter",
        "_deactivate_all_adapters",
        "_reset_lora_layers",
    ),
    *_points(CACHE, "vllm_omni.config.config_factory", "StageConfigFactory", "_normalize_default_diffusion"),
    *_points(CACHE, "vllm_omni.config.config_factory", None, "VllmOmniConfig"),
    *_points(CACHE, "vllm_omni.config.omni_config", "VllmOmniConfig", "from_pipeline_config"),
    *_points(SERVE_FLAGS, "vllm_omni.entrypoints.cli.serve", "OmniServeCommand", "subparser_init", "validate"),
    *_points(ROUTING, "vllm_omni.engine.stage_runtime", None, "_build_load_balancer_factory"),
    *_points(ROUTING, "vllm_omni.engine.stage_pool", "StagePool", "submit_initial"),
    *_points(ROUTING, "vllm_omni.engine.omni_engine_base", "OmniEngineBase", "_initialize_stages"),
    *_points(METRICS, WORKER, "DiffusionWorker", "execute_model", "execute_model_batch", "execute_stepwise"),
    *_points(METRICS, "vllm_omni.diffusion.diffusion_engine", "DiffusionEngine", "postprocess_output"),
    *_points(METRICS, "vllm_omni.engine.orchestrator", "OrchestratorBase", "_absorb_diffusion_metrics"),
)


def vllm_omni_source_root() -> Path | None:
    """Return the installed ``vllm_omni`` package directory, found without importing it."""
    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def missing_hook_points(root: Path, points: Iterable[HookPoint] = HOOK_POINTS) -> list[HookPoint]:
    """Return the hook points the vLLM-Omni sources under ``root`` lack, in the order given."""
    return [point for point in points if point.name not in _defined_names(root, point.module, point.owner)]


def _module_file(root: Path, module: str) -> Path:
    parts = module.split(".")[1:]  # the first part is the package ``root`` itself
    as_file = root.joinpath(*parts).with_suffix(".py")
    return as_file if as_file.is_file() else root.joinpath(*parts, "__init__.py")


@functools.cache
def _parsed(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None


def _defined_names(root: Path, module: str, owner: str | None) -> frozenset[str]:
    """Names bound at the top of ``module`` (defs, classes, assignments, imports), or in class ``owner``'s body."""
    tree = _parsed(_module_file(root, module))
    if tree is None:
        return frozenset()
    if owner is None:
        return frozenset(_bound_names(tree.body))
    for node in _top_level(tree.body):
        if isinstance(node, ast.ClassDef) and node.name == owner:
            return frozenset(_bound_names(node.body))
    return frozenset()


def _top_level(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """Statements at the top of a body, looking into ``if`` and ``try`` blocks (conditional imports)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(handler.body for handler in node.handlers)):
                yield from _top_level(block)


def _bound_names(body: list[ast.stmt]) -> Iterable[str]:
    for node in _top_level(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    yield target.id
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.target.id
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                yield alias.asname or alias.name.split(".")[0]
