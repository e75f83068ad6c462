"""The package's import graph: every arrow points down the layers, and no two modules import each other.

Read from the source (AST), every ``import`` counted wherever it stands, inside functions too: an
import deferred into a function still makes the importing module depend on the imported one, so a
cycle hidden that way is still a cycle here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = "vllm_omni_prompt_cache"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

#: Top to bottom: a module may import its own layer and the layers below it, never one above. Each core
#: subpackage is a layer; its ``__init__.py`` says what it holds and what it may import.
LAYERS = (
    ("commands", ("cli", "__main__")),  # the console script's subcommands
    ("demo", ("demo",)),  # the main job
    ("tiny", ("tiny",)),  # the demo's tiny models and adapter stand-ins
    ("cpu_platform", ("cpu_platform",)),  # the opt-in platform that runs vLLM-Omni without a GPU
    ("vllm_omni", ("vllm_omni",)),  # how stock vLLM-Omni is hooked
    ("calls", ("calls",)),  # how encode methods and text-encoder calls are intercepted and served: install, rows
    ("settings", ("settings",)),  # the one settings schema
    ("store", ("store",)),  # where entries live: the cache, lookups, flights, tiers/
    ("encoders", ("encoders",)),  # which modules are text encoders, their outputs and state, fingerprint, residency
    ("rows", ("rows",)),  # how a batched encoder call splits into rows, and how rows are compared
    ("counts", ("counts",)),  # the counters and the stats snapshot
    ("keys", ("keys",)),  # what a call's key is
    ("base", ("errors", "logs")),  # the error every bad setting raises, the say-once logger
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    if module == PACKAGE:  # the package's __init__ re-exports the public API from the top of the core
        return 0
    first = module.split(".")[1]
    for rank, (_, names) in enumerate(LAYERS):
        if first in names:
            return rank
    raise AssertionError(f"{module} is in no layer: add its folder to LAYERS")


def imported(path: Path, module: str) -> Iterator[tuple[str, int]]:
    """Yield each module of the package that ``path`` imports, with the line of the import."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                yield name, node.lineno


def graph() -> dict[str, dict[str, int]]:
    """Return module -> {package module it imports: line}, names resolved to modules (not their attributes)."""
    paths = {module_name(path): path for path in ROOT.rglob("*.py")}
    edges: dict[str, dict[str, int]] = {module: {} for module in paths}
    for module, path in paths.items():
        for name, line in imported(path, module):
            while name not in paths:  # an attribute of a module: the module
                name = name.rpartition(".")[0]
            if name != module and name != PACKAGE:  # the package's __init__ runs first for every module anyway
                edges[module].setdefault(name, line)
    return edges


EDGES = graph()


def test_the_graph_is_read_from_the_whole_package() -> None:
    assert f"{PACKAGE}.calls.wrapper" in EDGES and f"{PACKAGE}.vllm_omni.plugin" in EDGES
    assert f"{PACKAGE}.store.prompt_embed_cache" in EDGES[f"{PACKAGE}.calls.wrapper"]  # a real arrow is seen


def test_every_module_is_in_a_layer_and_every_core_folder_says_what_it_holds() -> None:
    for module in EDGES:
        layer_of(module)  # raises for a module in no layer
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of(f"{PACKAGE}.newfolder.module")
    for _, names in LAYERS:
        for name in names:
            folder = ROOT / name
            if folder.is_dir():
                assert (folder / "__init__.py").read_text().startswith('"""'), folder


def test_a_planted_upward_import_is_found(tmp_path: Path) -> None:
    """The check itself: a key module that imported the store would point up two layers."""
    planted = tmp_path / "planted.py"
    planted.write_text("from vllm_omni_prompt_cache.store.prompt_embed_cache import PromptEmbedCache\n")
    module = f"{PACKAGE}.keys.planted"
    edges = {**EDGES, module: {name: line for name, line in imported(planted, module) if name in EDGES}}
    assert upward_imports(edges) == [f"{module}:1 imports {PACKAGE}.store.prompt_embed_cache (keys -> store)"]


def upward_imports(edges: dict[str, dict[str, int]]) -> list[str]:
    return [
        f"{module}:{line} imports {target} ({LAYERS[layer_of(module)][0]} -> {LAYERS[layer_of(target)][0]})"
        for module, targets in edges.items()
        for target, line in targets.items()
        if layer_of(target) < layer_of(module)
    ]


def test_every_import_points_down_the_layers() -> None:
    assert upward_imports(EDGES) == []


def test_no_module_imports_the_test_rigs_outside_the_package() -> None:
    """The coverage matrix (prompt_cache_coverage) and the tests stay outside the wheel: nothing in it imports them."""
    offending = [
        f"{path.relative_to(ROOT.parent)}:{node.lineno}"
        for path in ROOT.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(
            (name or "").split(".")[0] in {"prompt_cache_coverage", "tests", "conftest"}
            for name in ([alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module])
        )
    ]
    assert offending == []


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Return the strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in edges[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in edges:
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle_even_through_imports_inside_functions() -> None:
    assert cycles(EDGES) == []


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b": 1}, "b": {"a": 1}}, [["a", "b"]]),
        ({"a": {"b": 1}, "b": {"c": 1}, "c": {}}, []),
    ],
)
def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle(edges, expected) -> None:
    assert cycles(edges) == expected


def test_the_design_module_table_names_every_core_module() -> None:
    """docs/design.md's module table is the map of the folders: every core module has its row, or is named (its
    file in backticks) in the row of its folder (``| `store/tiers/*` | ...``)."""
    table = (ROOT.parent / "docs" / "design.md").read_text()
    core = {name for _, names in LAYERS[5:-1] for name in names}  # calls/ ... keys/
    modules = [
        path.relative_to(ROOT).as_posix()
        for name in core
        for path in (ROOT / name).rglob("*.py")
        if path.name != "__init__.py"
    ]

    def has_row(module: str) -> bool:
        if f"| `{module}` |" in table:
            return True
        folder, _, file = module.rpartition("/")
        rows = [line for line in table.splitlines() if line.startswith(f"| `{folder}/*` |")]
        return any(f"`{file}`" in row for row in rows)

    assert modules and [module for module in modules if not has_row(module)] == []


def test_no_module_is_over_500_lines_and_no_function_over_80() -> None:
    """A room past 500 lines is two rooms (STYLE.md); a function past 80 lines is several steps."""
    long_modules, long_functions = [], []
    for path in ROOT.rglob("*.py"):
        source = path.read_text()
        if source.count("\n") > 500:
            long_modules.append(f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert (long_modules, long_functions) == ([], [])
