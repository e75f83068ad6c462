"""The contract vLLM-Omni's own unit tests pin on the module this package replaces, held by the plugin.

vLLM-Omni's ``tests/diffusion/cache/test_prompt_embed_cache.py`` drives ``install_prompt_embed_cache`` with
pipelines that count their calls on ``self`` (``self.call_count += 1`` inside ``encode_prompt``) and
return the count, so a hit is seen as a count that did not move. These tests are ours, written against
that contract: identical arguments hit without calling the method, positional and keyword spellings
share an entry, ``enabled`` toggles at run time, install is idempotent and uninstall restores, and the
settings resolve from the same arguments and environment variables (where ours refuses a bad value,
naming it, instead of ignoring it). A pipeline without a text encoder the cache can watch has nothing a
proof could compare (see ``encoder_gate.py``): its hits are served on the key, as upstream serves them;
one with a text encoder runs its encode up to the encoder on a hit, so there a counter on ``self``
counts calls while the encoder runs once per prompt.

Marked ``release``: the release matrix runs them against every supported vLLM-Omni release.
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni_prompt_cache import (
    PromptEmbedCache,
    install_prompt_embed_cache,
    resolve_prompt_embed_cache_config,
    uninstall_prompt_embed_cache,
)
from vllm_omni_prompt_cache.settings.schema import PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.tiny.text_encoder import build_qwen2_encoder

pytestmark = pytest.mark.release

ENABLE_ENV = "OMNI_DIFFUSION_PROMPT_EMBED_CACHE"
SIZE_ENV = "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE"


class CountsItsCalls:
    """Text in, a tensor of its own call count out: a hit is a count that did not move."""

    def __init__(self) -> None:
        self.call_count = 0

    def encode_prompt(self, prompt, device=None, num_images_per_prompt=1, prompt_embeds=None):
        self.call_count += 1
        return torch.tensor([float(self.call_count)])


class CountsItsCallsAroundAnEncoder(torch.nn.Module):
    """Token ids through a real (tiny) text encoder, its calls counted on ``self`` before the encoder runs."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.call_count = 0
        self.encoder_runs = 0
        encoder.register_forward_hook(self._ran)

    def _ran(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        self.encoder_runs += 1

    @torch.inference_mode()
    def encode_prompt(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.call_count += 1
        return self.text_encoder(input_ids=prompt_ids, attention_mask=attention_mask).last_hidden_state


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(ENABLE_ENV, raising=False)
    monkeypatch.delenv(SIZE_ENV, raising=False)
    return monkeypatch


def test_identical_arguments_hit_without_calling_the_method() -> None:
    pipeline = CountsItsCalls()
    cache = install_prompt_embed_cache(pipeline, max_size=4)
    first = pipeline.encode_prompt("a red fox", device="cpu")
    again = pipeline.encode_prompt("a red fox", device="cpu")
    assert pipeline.call_count == 1 and torch.equal(first, again)
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["bypassed"]) == (1, 1, 0)


def test_positional_and_keyword_spellings_share_one_entry() -> None:
    pipeline = CountsItsCalls()
    cache = install_prompt_embed_cache(pipeline)
    pipeline.encode_prompt("a red fox")
    pipeline.encode_prompt(prompt="a red fox")
    assert pipeline.call_count == 1 and cache.stats()["hits"] == 1


def test_other_prompts_and_other_ids_miss() -> None:
    pipeline = CountsItsCalls()
    cache = install_prompt_embed_cache(pipeline)
    pipeline.encode_prompt("a red fox")
    pipeline.encode_prompt("a blue fox")
    assert pipeline.call_count == 2 and cache.stats()["misses"] == 2


def test_the_enabled_switch_takes_effect_at_run_time() -> None:
    pipeline = CountsItsCalls()
    cache = install_prompt_embed_cache(pipeline, enabled=True)
    pipeline.encode_prompt("a red fox")
    pipeline.encode_prompt("a red fox")
    assert cache.stats()["hits"] == 1
    cache.enabled = False
    pipeline.encode_prompt("a red fox")
    pipeline.encode_prompt("a red fox")
    assert cache.stats()["hits"] == 1 and pipeline.call_count == 3
    cache.enabled = True
    pipeline.encode_prompt("a red fox")
    assert cache.stats()["hits"] == 2 and pipeline.call_count == 3


def test_installed_disabled_every_call_runs_and_nothing_is_counted_as_a_hit() -> None:
    pipeline = CountsItsCalls()
    cache = install_prompt_embed_cache(pipeline, enabled=False)
    pipeline.encode_prompt("a red fox")
    pipeline.encode_prompt("a red fox")
    assert pipeline.call_count == 2 and (cache.stats()["hits"], cache.stats()["misses"]) == (0, 0)


def test_precomputed_embeddings_pass_through() -> None:
    pipeline = CountsItsCalls()
    cache = install_prompt_embed_cache(pipeline)
    for _ in range(2):
        pipeline.encode_prompt("a red fox", prompt_embeds=torch.zeros(1))
    assert pipeline.call_count == 2 and (cache.stats()["bypassed"], cache.stats()["hits"]) == (2, 0)


def test_install_is_idempotent_and_uninstall_restores_the_original() -> None:
    pipeline = CountsItsCalls()
    first = install_prompt_embed_cache(pipeline, max_size=4)
    assert isinstance(first, PromptEmbedCache)
    assert install_prompt_embed_cache(pipeline, max_size=16) is first and first.max_size == 4
    uninstall_prompt_embed_cache(pipeline)
    assert getattr(pipeline, "_prompt_embed_cache", None) is None
    pipeline.encode_prompt("a red fox")
    pipeline.encode_prompt("a red fox")
    assert pipeline.call_count == 2
    uninstall_prompt_embed_cache(pipeline)  # a second uninstall is harmless


def test_nothing_to_wrap_returns_none() -> None:
    class NoEncode:
        pass

    assert install_prompt_embed_cache(NoEncode()) is None


def test_the_lru_bound_holds_through_the_wrapper() -> None:
    pipeline = CountsItsCalls()
    cache = install_prompt_embed_cache(pipeline, max_size=2)
    for prompt in ("a", "b", "c", "a"):  # c evicts a; a runs again
        pipeline.encode_prompt(prompt)
    assert pipeline.call_count == 4 and cache.stats()["size"] == 2


def test_a_cached_tensor_is_detached() -> None:
    class NeedsGrad:
        def encode_prompt(self, prompt):
            return torch.ones(1, requires_grad=True)

    pipeline = NeedsGrad()
    install_prompt_embed_cache(pipeline)
    pipeline.encode_prompt("a red fox")
    assert not pipeline.encode_prompt("a red fox").requires_grad


def test_with_a_text_encoder_the_count_on_self_counts_calls_and_the_encoder_runs_once_per_prompt() -> None:
    pipeline = CountsItsCallsAroundAnEncoder(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    first = pipeline.encode_prompt(ids)
    again = pipeline.encode_prompt(ids.clone(), attention_mask=None)
    other = pipeline.encode_prompt(ids + 1)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert (pipeline.encoder_runs, pipeline.call_count) == (2, 3)  # the hit ran the encode up to its encoder
    stats = cache.stats()
    assert (stats["hits"], stats["misses"]) == (1, 2)


def test_settings_resolve_from_the_same_arguments_and_environment(clean_env: pytest.MonkeyPatch) -> None:
    assert resolve_prompt_embed_cache_config() == (False, 32)
    assert resolve_prompt_embed_cache_config(enable=True, max_size=8) == (True, 8)
    assert resolve_prompt_embed_cache_config(enable=True, max_size=None) == (True, 32)
    for truthy in ("1", "true", "TRUE", "yes", "on"):
        clean_env.setenv(ENABLE_ENV, truthy)
        assert resolve_prompt_embed_cache_config(enable=False)[0] is True
    for falsy in ("0", "false", "FALSE", "no", "off"):
        clean_env.setenv(ENABLE_ENV, falsy)
        assert resolve_prompt_embed_cache_config(enable=True)[0] is False
    clean_env.delenv(ENABLE_ENV)
    clean_env.setenv(SIZE_ENV, "7")
    assert resolve_prompt_embed_cache_config(max_size=99)[1] == 7


@pytest.mark.parametrize(
    ("variable", "value"), [(ENABLE_ENV, "garbage"), (SIZE_ENV, "0"), (SIZE_ENV, "-5"), (SIZE_ENV, "abc")]
)
def test_a_bad_environment_value_is_refused_naming_it(clean_env: pytest.MonkeyPatch, variable: str, value: str) -> None:
    """Where upstream ignores a bad value, ours refuses it, naming the variable (a value silently dropped is
    a cache silently off or unbounded)."""
    clean_env.setenv(variable, value)
    with pytest.raises(PromptEmbedCacheConfigError, match=variable):
        resolve_prompt_embed_cache_config(enable=True, max_size=12)
