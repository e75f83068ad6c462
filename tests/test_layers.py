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

#: Top to bottom: a module may import its own layer and the layers below it, never one above.
LAYERS = (
    ("commands", ("cli", "__main__")),  # the console script's subcommands
    ("demo", ("demo",)),  # the main job
    ("tiny", ("tiny",)),  # the demo's tiny models and adapter stand-ins
    ("cpu_platform", ("cpu_platform",)),  # the opt-in platform that runs vLLM-Omni without a GPU
    ("vllm_omni", ("vllm_omni",)),  # how stock vLLM-Omni is hooked
    ("core", ()),  # everything else: keys, entries, flights, lookups, tiers, rows, proofs, wrapper, config...
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    first = module.split(".")[1] if "." in module else ""
    for rank, (_, names) in enumerate(LAYERS):
        if first in names:
            return rank
    return len(LAYERS) - 1


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
    assert f"{PACKAGE}.wrapper" in EDGES and f"{PACKAGE}.vllm_omni.plugin" in EDGES
    assert f"{PACKAGE}.store" in EDGES[f"{PACKAGE}.wrapper"]  # a real arrow is seen


def test_every_import_points_down_the_layers() -> None:
    upward = [
        f"{module}:{line} imports {target} ({LAYERS[layer_of(module)][0]} -> {LAYERS[layer_of(target)][0]})"
        for module, targets in EDGES.items()
        for target, line in targets.items()
        if layer_of(target) < layer_of(module)
    ]
    assert upward == []


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
