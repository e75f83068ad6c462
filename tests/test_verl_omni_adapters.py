"""Every verl-omni adapter has a row in docs/verl-omni-adapters.md, and the cache knows its encode method."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from vllm_omni_prompt_cache.coverage.verl_omni import ADAPTERS, VERL_OMNI_COMMIT
from vllm_omni_prompt_cache.vllm_omni.methods import ENCODE_PROMPT, HIDDEN_INPUTS, KNOWN_METHODS

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


def test_the_cache_wraps_refuses_or_has_nothing_to_do_for_each_adapters_encode_method() -> None:
    known = {(entry.owner, entry.method) for entry in KNOWN_METHODS}
    hidden = {(entry.owner, entry.method) for entry in HIDDEN_INPUTS}
    for adapter in ADAPTERS:
        if adapter.method is None:
            continue  # no separate text encoder (Bagel)
        assert re.fullmatch(r"[A-Za-z_]\w*", adapter.owner or "")
        assert adapter.method == ENCODE_PROMPT or (adapter.owner, adapter.method) in known, adapter
    minimax = next(adapter for adapter in ADAPTERS if adapter.directory == "minimax_h3_diffusion_nft")
    assert (minimax.owner, minimax.method) in hidden  # the adapter that reads its ids from instance state
