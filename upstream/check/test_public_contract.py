"""vLLM-Omni's public contract for ``prompt_embed_cache``, held by every step of the series.

Not part of the proposed change. ``run_series.py`` runs these against each step's module (the
``implementation`` fixture of ``check_plugin.py``); the plugin's suite runs them against the stock
module, each step and the plugin (``tests/test_upstream_patch.py``). Names, signatures, the LRU
store, the wrapper's hits and bypasses, install/uninstall and the env vars are what callers of the
released module rely on.
"""

from __future__ import annotations

import inspect
import weakref
from types import ModuleType

import pytest
import torch

ENV_VARS = ("OMNI_DIFFUSION_PROMPT_EMBED_CACHE", "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE")

#: Each pipeline's encode count, kept outside it: an instrument, not state the encode reads.
_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Pipeline:
    @property
    def calls(self) -> int:
        return _CALLS.get(self, 0)

    def encode_prompt(self, prompt, device=None, num_images_per_prompt: int = 1, prompt_embeds=None):
        _CALLS[self] = self.calls + 1
        return torch.full((num_images_per_prompt, 2), float(len(prompt)))


@pytest.fixture(autouse=True)
def _no_cache_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def test_public_names_and_signatures(implementation: ModuleType) -> None:
    install = inspect.signature(implementation.install_prompt_embed_cache).parameters
    assert list(install)[:4] == ["pipeline", "max_size", "enabled", "model_tag"]
    assert (install["max_size"].default, install["enabled"].default, install["model_tag"].default) == (32, True, None)
    assert all(p.default is not p.empty for name, p in install.items() if name != "pipeline")
    resolve = inspect.signature(implementation.resolve_prompt_embed_cache_config).parameters
    assert list(resolve) == ["enable", "max_size"]
    assert list(inspect.signature(implementation.uninstall_prompt_embed_cache).parameters) == ["pipeline"]
    assert implementation._CACHE_MISS is not None


def test_store_contract(implementation: ModuleType) -> None:
    cache = implementation.PromptEmbedCache(max_size=2)
    miss = implementation._CACHE_MISS
    assert cache.get("a") is miss
    cache.put("a", None)  # a cached None is a hit
    assert cache.get("a") is None
    cache.put("b", 2)
    cache.get("a")  # "a" becomes most recent
    cache.put("c", 3)  # evicts "b"
    assert cache.get("b") is miss and cache.get("c") == 3
    cache.put("c", 4)
    assert cache.get("c") == 4
    stats = cache.stats()
    assert {"size", "max_size", "hits", "misses", "bypassed"} <= set(stats)
    assert (stats["size"], stats["max_size"], stats["hits"], stats["misses"]) == (2, 2, 4, 2)
    with cache._lock:  # how upstream's wrapper counts a bypass
        cache.bypassed += 1
    cache.clear()
    assert cache.stats()["size"] == 0 and cache.stats()["hits"] == 4 and cache.stats()["bypassed"] == 1
    for bad in (0, -1):
        with pytest.raises(ValueError):
            implementation.PromptEmbedCache(max_size=bad)


def test_wrapper_contract(implementation: ModuleType) -> None:
    assert implementation.install_prompt_embed_cache(object()) is None
    pipeline = _Pipeline()
    cache = implementation.install_prompt_embed_cache(pipeline, max_size=4, model_tag="t")
    assert implementation.install_prompt_embed_cache(pipeline, max_size=16) is cache and cache.max_size == 4
    first = pipeline.encode_prompt("a red fox")
    assert torch.equal(pipeline.encode_prompt(prompt="a red fox"), first)
    pipeline.encode_prompt("a red fox", prompt_embeds=torch.zeros(1))  # precomputed: bypassed
    assert (pipeline.calls, cache.stats()["hits"], cache.stats()["bypassed"]) == (2, 1, 1)
    cache.enabled = False
    pipeline.encode_prompt("a red fox")
    assert pipeline.calls == 3 and cache.stats()["hits"] == 1
    implementation.uninstall_prompt_embed_cache(pipeline)
    pipeline.encode_prompt("a red fox")
    assert pipeline.calls == 4 and getattr(pipeline, "_prompt_embed_cache", None) is None
    implementation.uninstall_prompt_embed_cache(_Pipeline())  # not wrapped: nothing to do


def test_an_encode_that_counts_its_calls_on_self_is_cached(implementation: ModuleType) -> None:
    """A pipeline that keeps a call counter on ``self`` (as users' pipelines do) still hits."""

    class Counting:
        def __init__(self) -> None:
            self.call_count = 0

        def encode_prompt(self, prompt):
            self.call_count += 1
            return torch.full((1, 2), float(len(prompt)))

    pipeline = Counting()
    cache = implementation.install_prompt_embed_cache(pipeline)
    for _ in range(4):
        pipeline.encode_prompt("a red fox")
    assert pipeline.call_count == 1 and cache.stats()["hits"] == 3


def test_config_contract(implementation: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    resolve = implementation.resolve_prompt_embed_cache_config
    assert resolve() == (False, 32)
    assert resolve(enable=True, max_size=8) == (True, 8)
    monkeypatch.setenv("OMNI_DIFFUSION_PROMPT_EMBED_CACHE", "off")
    monkeypatch.setenv("OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE", "7")
    assert resolve(enable=True, max_size=99) == (False, 7)


def test_token_id_tensors_hit_where_tensors_are_keyed(implementation: ModuleType, tensor_keys: bool) -> None:
    """The behaviour the series is for: K fresh id tensors of one prompt, one encode."""
    calls = []

    class TokenIdPipeline:
        def encode_prompt(self, prompt_ids, attention_mask=None):
            calls.append(1)
            return prompt_ids.float() * attention_mask

    pipeline = TokenIdPipeline()
    cache = implementation.install_prompt_embed_cache(pipeline)
    ids = torch.tensor([[5, 6, 7, 0]])
    for _ in range(8):
        pipeline.encode_prompt(ids.clone(), attention_mask=(ids != 0).clone())
    assert len(calls) == (1 if tensor_keys else 8)
    assert cache.stats()["bypassed"] == (0 if tensor_keys else 8)
