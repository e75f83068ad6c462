"""The core imports with torch, numpy and xxhash alone: vLLM and vLLM-Omni stay optional."""

from __future__ import annotations

import subprocess
import sys

BLOCK_OPTIONAL = """
import sys
for name in ("vllm", "vllm_omni", "transformers", "diffusers", "PIL"):
    sys.modules[name] = None  # any import of these now raises ImportError
import vllm_omni_prompt_cache as core
import torch
pipeline = type("P", (), {"encode_prompt": lambda self, prompt_ids: prompt_ids * 2})()
cache = core.install_prompt_embed_cache(pipeline)
pipeline.encode_prompt(torch.tensor([1, 2]))
pipeline.encode_prompt(torch.tensor([1, 2]))
assert cache.stats()["hits"] == 1, cache.stats()
print("ok")
"""


def test_core_works_without_vllm_vllm_omni_or_pil() -> None:
    result = subprocess.run([sys.executable, "-c", BLOCK_OPTIONAL], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_suites_vllm_omni_pin_is_a_tested_release_with_its_vllm() -> None:
    """pyproject's ``vllm-omni`` extra and releases.py name the same pair (the matrix tests the rest)."""
    import tomllib
    from pathlib import Path

    from vllm_omni_prompt_cache.vllm_omni import releases

    extra = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["vllm-omni"]
    assert sorted(extra) == sorted(
        [f"vllm=={releases.TESTED[releases.SUITE_RELEASE]}", f"vllm-omni=={releases.SUITE_RELEASE}"]
    )
