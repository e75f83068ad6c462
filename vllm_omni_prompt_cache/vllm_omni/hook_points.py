"""Every name in vLLM-Omni that the plugin hooks, and whether the installed vLLM-Omni has it.

The plugin decides from these, not from the version string, whether it can work on the vLLM-Omni
it finds: each hook point is looked up in the installed sources by parsing them (``ast``), without
importing vLLM-Omni, so the check is cheap enough for every process the plugin loads in and never
runs vLLM-Omni code. A missing hook point of the cache itself (where it is installed, where it
must be emptied) keeps the whole plugin inert, since a cache that outlived a weight change would
serve wrong embeddings; a missing hook point of a feature (how settings travel, serve flags,
prompt-affinity routing, metrics, offload counts) turns that feature off and leaves the cache on.

Releases move code: a hook point may name an ``alternative`` (where an older release does the same
thing), and one of them found is enough. An ``optional`` one is hooked where it exists; a release
without it has nothing there to hook (a helper that only exists beside a newer feature).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CACHE = "the prompt-embed cache"
KWARGS = "cache settings as AsyncOmni/Omni kwargs"
DEPLOY_CONFIG = "cache settings for deploy-config pipelines"
OFFLOAD_COUNTS = "the text encoder's offload move counts"
SERVE_FLAGS = "the serve flags"
ROUTING = "prompt-affinity routing"
METRICS = "the /metrics families"
FEATURES = (CACHE, KWARGS, DEPLOY_CONFIG, OFFLOAD_COUNTS, SERVE_FLAGS, ROUTING, METRICS)


@dataclass(frozen=True)
class HookPoint:
    """A module-level name, or a name in a class's own body, that a hook replaces or calls."""

    feature: str
    module: str
    owner: str | None  # the class defined in ``module``; None for a module-level name
    name: str
    #: Where an older release does the same thing: either one found is enough.
    alternative: HookPoint | None = None
    #: Hooked where it exists; a release without it has nothing there that needs the hook.
    optional: bool = False

    @property
    def dotted(self) -> str:
        """This hook point's own name, without its alternatives."""
        return ".".join(part for part in (self.module, self.owner, self.name) if part)

    def __str__(self) -> str:
        return f"{self.dotted} (or {self.alternative})" if self.alternative is not None else self.dotted

    def choices(self) -> tuple[HookPoint, ...]:
        """This hook point and its alternatives, newest release's first."""
        return (self, *(self.alternative.choices() if self.alternative is not None else ()))


def _points(feature: str, module: str, owner: str | None, *names: str) -> tuple[HookPoint, ...]:
    return tuple(HookPoint(feature, module, owner, name) for name in names)


WORKER = "vllm_omni.diffusion.worker.diffusion_worker"
RUNNER = "vllm_omni.diffusion.worker.diffusion_model_runner"
LORA_MANAGER = "vllm_omni.diffusion.lora.manager"
ASYNC_ENGINE = "vllm_omni.engine.async_omni_engine"
OFFLOADER = "vllm_omni.diffusion.offloader.sequential_backend"
#: Where 0.32 and later open and close a weight-transfer session (trainer to worker, RL weight sync).
WEIGHT_UPDATE_SESSION = ("start_weight_update", "finish_weight_update")
#: The LoRA manager's methods that change which adapter weights are bound (every release has them).
LORA_STATE_CHANGERS = ("add_adapter", "remove_adapter", "_activate_adapter", "_deactivate_all_adapters")
#: Where the generic diffusion stage is built from the kwargs: 0.30 and later, then 0.27 and 0.28.
KWARGS_BUILDER = HookPoint(
    KWARGS,
    "vllm_omni.config.config_factory",
    "StageConfigFactory",
    "_normalize_default_diffusion",
    alternative=HookPoint(KWARGS, ASYNC_ENGINE, "AsyncOmniEngine", "_create_default_diffusion_stage_cfg"),
)
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
    *_points(CACHE, RUNNER, None, "install_prompt_embed_cache"),
    *_points(CACHE, RUNNER, "DiffusionModelRunner", "load_model"),
    # 0.30 and later warm up through it (its encodes are counted as misses); 0.27 has none.
    HookPoint(CACHE, RUNNER, "DiffusionModelRunner", "profile_run", optional=True),
    *_points(CACHE, WORKER, "DiffusionWorker", "sleep"),
    # 0.32's weight-transfer sessions, which may write weights without ``load_weights``.
    *(HookPoint(CACHE, WORKER, "DiffusionWorker", name, optional=True) for name in WEIGHT_UPDATE_SESSION),
    *_points(CACHE, LORA_MANAGER, "DiffusionLoRAManager", *LORA_STATE_CHANGERS),
    # Resets suspended adapters (0.28 and later; 0.27 suspends none).
    HookPoint(CACHE, LORA_MANAGER, "DiffusionLoRAManager", "_reset_lora_layers", optional=True),
    KWARGS_BUILDER,
    *_points(DEPLOY_CONFIG, "vllm_omni.config.config_factory", None, "VllmOmniConfig"),
    *_points(DEPLOY_CONFIG, "vllm_omni.config.omni_config", "VllmOmniConfig", "from_pipeline_config"),
    # The engine's own route on 0.27 and 0.28 (``create_legacy_stage_configs_from_model``), which never
    # reaches ``from_pipeline_config``. 0.30 and later keep the function but build stages through
    # ``from_pipeline_config``; a release without it has no such route to hook.
    HookPoint(
        DEPLOY_CONFIG,
        "vllm_omni.config.config_factory",
        "StageConfigFactory",
        "_create_legacy_from_registry",
        optional=True,
    ),
    # Module offload's moves, counted on each hook instance (see offload.py).
    *_points(OFFLOAD_COUNTS, OFFLOADER, "SequentialOffloadHook", "_to_gpu", "_to_cpu"),
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
    missing = missing_hook_points(root) if root is not None else [point for point in HOOK_POINTS if not point.optional]
    return {feature: [point for point in missing if point.feature == feature] for feature in FEATURES}


def required(feature: str) -> list[HookPoint]:
    """The hook points ``feature`` cannot be on without (its optional ones left out)."""
    return [point for point in HOOK_POINTS if point.feature == feature and not point.optional]


def missing_hook_points(root: Path, points: Iterable[HookPoint] = HOOK_POINTS) -> list[HookPoint]:
    """Return the hook points the vLLM-Omni sources under ``root`` lack (none of their choices
    found), in the order given; optional ones are never missing."""
    return [
        point
        for point in points
        if not point.optional and not any(is_present(root, choice) for choice in point.choices())
    ]


def found_choice(point: HookPoint, root: Path | None = None) -> HookPoint | None:
    """Return the first of ``point``'s choices the installed (or ``root``'s) vLLM-Omni has, or None."""
    root = root if root is not None else vllm_omni_source_root()
    if root is None:
        return None
    return next((choice for choice in point.choices() if is_present(root, choice)), None)


def is_present(root: Path, point: HookPoint) -> bool:
    """Whether the sources under ``root`` bind ``point`` itself (not its alternatives)."""
    names = _module_names(_module_file(root, point.module)).get(point.owner, frozenset())
    return point.name in names or _ANY in names


def every_choice(points: Iterable[HookPoint] = HOOK_POINTS) -> list[HookPoint]:
    """Every name a hook may replace or call: each hook point and each of its alternatives."""
    return [choice for point in points for choice in point.choices()]


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
