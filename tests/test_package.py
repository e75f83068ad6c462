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
