"""Every verl-omni adapter has a row in docs/verl-omni-adapters.md, and the cache knows its encode method."""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest

from prompt_cache_coverage.verl_omni import ADAPTERS, VERL_OMNI_COMMIT

DOC = Path(__file__).resolve().parents[1] / "docs" / "verl-omni-adapters.md"
#: A git clone of verl-omni to enumerate its adapters from (the search tool's mirror where there is one).
VERL_OMNI_REPO = Path(os.environ.get("VERL_OMNI_REPO", "/work/.mirror/verl-project+verl-omni/repo"))


@pytest.mark.skipif(not VERL_OMNI_REPO.exists(), reason=f"no verl-omni clone at {VERL_OMNI_REPO} (set VERL_OMNI_REPO)")
def test_the_list_is_verl_omnis_own_set_of_rollout_adapters() -> None:
    """Enumerated from verl-omni itself: every ``pipelines/*/vllm_omni_rollout_adapter.py`` at the commit read."""
    listing = subprocess.run(
        ["git", "-C", str(VERL_OMNI_REPO), "ls-tree", "-r", "--name-only", VERL_OMNI_COMMIT, "verl_omni/pipelines"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    shipped = {Path(path).parent.name for path in listing if path.endswith("/vllm_omni_rollout_adapter.py")}
    assert shipped == {adapter.directory for adapter in ADAPTERS}


def test_the_eleven_adapters_of_the_commit_read_are_listed_once() -> None:
    directories = [adapter.directory for adapter in ADAPTERS]
    assert len(directories) == len(set(directories)) == 11


def test_every_adapter_has_a_row_in_the_doc() -> None:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ")]
    for adapter in ADAPTERS:
        matching = [row for row in rows if f"`{adapter.directory}`" in row]
        assert len(matching) == 1, f"{adapter.directory}: {len(matching)} rows in {DOC.name}"
        if adapter.method is not None:
            assert re.search(rf"`{re.escape(adapter.method)}[`(]", matching[0]), adapter


def _names_in_code(path: Path) -> set[str]:
    """Return the identifiers and string constants a module's code uses (comments and docstrings aside)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names.update(re.findall(r"\w+", node.value))
    return names


def test_no_adapter_is_recognised_by_name() -> None:
    """The cache finds encode methods by watching the encoders: no code of the product names an adapter's class
    (its comments and docstrings may say what a rule was written against)."""
    package = Path(__file__).resolve().parents[1] / "vllm_omni_prompt_cache"
    owners = {adapter.owner for adapter in ADAPTERS if adapter.owner}
    assert len(owners) >= 8  # the listing holds verl-omni's adapter classes
    for path in package.rglob("*.py"):
        if path.relative_to(package).parts[0] in ("tiny", "demo"):
            continue  # the stand-ins name them on purpose (the listing is in prompt_cache_coverage, outside)
        assert not owners & _names_in_code(path), path
