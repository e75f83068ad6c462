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
#: What the hooks in :mod:`.plugin` replace, call or import, by feature. Instance attributes a hook
#: reads (``StagePool._lb``, ``OrchestratorBase._prom_metrics``) cannot be found in the sources;
#: the hooks check those where they read them.
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
    *_points(
        CACHE, "vllm_omni.diffusion.worker.diffusion_model_runner", "DiffusionModelRunner", "load_model", "profile_run"
    ),
    # Module offload's moves, counted on each hook instance (see offload.py).
    *_points(CACHE, "vllm_omni.diffusion.offloader.sequential_backend", "SequentialOffloadHook", "_to_gpu", "_to_cpu"),
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
    *_points(ROUTING, "vllm_omni.engine.stage_pool", None, "StageUnavailableError"),
    *_points(
        ROUTING,
        "vllm_omni.engine.stage_pool",
        "StagePool",
        "submit_initial",
        "attach_load_balancer",
        "get_bound_replica_id",
        "bind",
        "live_replica_ids",
        "live_num_replicas",
        "is_replica_available",
        "is_distributed",
        "_collect_serviceable_replicas",
        "DISPATCH_WAIT_TIMEOUT_S",
        "DISPATCH_RETRY_INTERVAL_S",
    ),
    *_points(ROUTING, "vllm_omni.distributed.omni_coordinator.load_balancer", None, "LoadBalancer", "Task"),
    *_points(ROUTING, "vllm_omni.distributed.omni_coordinator.messages", None, "ReplicaInfo", "ReplicaStatus"),
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


def missing_by_feature() -> dict[str, list[HookPoint]]:
    """Return the installed vLLM-Omni's missing hook points for each feature (all of them without one)."""
    root = vllm_omni_source_root()
    missing = missing_hook_points(root) if root is not None else list(HOOK_POINTS)
    return {feature: [point for point in missing if point.feature == feature] for feature in FEATURES}


def missing_hook_points(root: Path, points: Iterable[HookPoint] = HOOK_POINTS) -> list[HookPoint]:
    """Return the hook points the vLLM-Omni sources under ``root`` lack, in the order given."""
    missing = []
    for point in points:
        names = _module_names(_module_file(root, point.module)).get(point.owner, frozenset())
        if point.name not in names and _ANY not in names:
            missing.append(point)
    return missing


#: Stands for every name, where a ``from x import *`` binds names the survey cannot list.
_ANY = "*"


def _module_file(root: Path, module: str) -> Path:
    parts = module.split(".")[1:]  # the first part is the package ``root`` itself
    as_file = root.joinpath(*parts).with_suffix(".py")
    return as_file if as_file.is_file() else root.joinpath(*parts, "__init__.py")


@functools.cache
def _module_names(path: Path) -> dict[str | None, frozenset[str]]:
    """Names bound at the top of a module (key None) and in each top-level class's body (key: its name).

    Only these sets are kept, not the syntax tree (the hooked modules' trees take tens of MiB).
    """
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return {}
    names: dict[str | None, frozenset[str]] = {None: frozenset(_bound_names(tree.body))}
    for node in _top_level(tree.body):
        if isinstance(node, ast.ClassDef):
            names.setdefault(node.name, frozenset(_bound_names(node.body)))
    return names


def _top_level(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """Statements that run with the body: into ``if`` (not ``if TYPE_CHECKING``), ``try`` and ``with`` blocks."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(handler.body for handler in node.handlers)):
                yield from _top_level(block)
        elif isinstance(node, ast.With):
            yield from _top_level(node.body)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _bound_names(body: list[ast.stmt]) -> Iterable[str]:
    for node in _top_level(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                yield from _target_names(target)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            yield from _target_names(node.target)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                yield _ANY if alias.name == "*" else alias.asname or alias.name.split(".")[0]


def _target_names(target: ast.expr) -> Iterable[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _target_names(element)
    elif isinstance(target, ast.Starred):
        yield from _target_names(target.value)
