"""Audits: encoder calls answered from the cache, encoded again and compared.

The cache keeps what a text encoder returned for the inputs that reached it; everything around the encoder runs for
real on every call. So a template kept on a component reaches the encoder's input and its key (the first test), and
a factor read after the encoder is read on every call (the second). What no key and no check sees is an encoder
whose output changes unseen: weights written through ``.data``, which moves no version counter
(``encoder_state.py``). That is what an audit is for: with a share ``f``, each encoder call answered from the cache
is, with probability ``f``, encoded again and the kept output compared (``encoder_calls.py``, ``_audited``). Where
the cache recognises no text encoder (an encoder with no token table: a one-hot matmul), the method is cached whole
on its arguments, as upstream does, and served stale.
"""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings, resolve_prompt_embed_cache_settings
from vllm_omni_prompt_cache.settings.schema import AUDIT, PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder

IDS = torch.tensor([[3, 1, 4, 1, 5, 9]])


class TemplatedPipeline(TokenIdTextPipeline):
    """Prepends ``self.template_ids`` to the prompt's ids inside ``encode_prompt``, the template kept on the text
    encoder (a component, as a tokenizer whose template changes is)."""

    @property
    def template_ids(self) -> torch.Tensor:
        return getattr(self.text_encoder, "template_ids", torch.tensor([[7, 7]]))

    @template_ids.setter
    def template_ids(self, value: torch.Tensor) -> None:
        self.text_encoder.template_ids = value

    def encode_prompt(self, prompt_ids, attention_mask=None):
        ids = torch.cat([self.template_ids.expand(prompt_ids.shape[0], -1), prompt_ids], dim=1)
        return super().encode_prompt(ids, torch.ones_like(ids))


class RescaledPipeline(TokenIdTextPipeline):
    """Scales its embeddings by ``self.output_scale``, kept on the text encoder and read after the encoder ran."""

    @property
    def output_scale(self) -> float:
        return getattr(self.text_encoder, "output_scale", 1.0)

    @output_scale.setter
    def output_scale(self, value: float) -> None:
        self.text_encoder.output_scale = value

    def encode_prompt(self, prompt_ids, attention_mask=None):
        embeds, mask = super().encode_prompt(prompt_ids, attention_mask)
        return embeds * self.output_scale, mask


class OneHotEncoder(torch.nn.Module):
    """A text encoder the cache does not recognise (mirrors no model): no token table, a one-hot matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(1024, 8, generator=torch.Generator().manual_seed(1)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> object:
        from transformers.modeling_outputs import BaseModelOutput

        hidden = torch.nn.functional.one_hot(input_ids, 1024).to(self.weight.dtype) @ self.weight
        return BaseModelOutput(last_hidden_state=hidden)


def same(left: tuple, right: tuple) -> bool:
    return all(torch.equal(a, b) for a, b in zip(left, right, strict=True))


def written_unseen(encoder: torch.nn.Module) -> None:
    """Double the encoder's final norm weight through ``.data``: every output doubles, no version counter moves."""
    before = encoder.norm.weight._version
    encoder.norm.weight.data.mul_(2)
    assert encoder.norm.weight._version == before


def test_a_template_changed_on_a_component_reaches_the_encoders_key() -> None:
    """The changed template reaches the encoder: another input, another key; the call encodes."""
    pipeline = TemplatedPipeline(build_qwen2_encoder())
    reference = TemplatedPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline)
    before = pipeline.encode_prompt(IDS)
    assert same(before, reference.encode_prompt(IDS))
    pipeline.template_ids = reference.template_ids = torch.tensor([[8, 8]])
    after = pipeline.encode_prompt(IDS)
    assert same(after, reference.encode_prompt(IDS)) and not same(after, before)
    assert pipeline.encoder_runs == 2
    assert (cache.stats()["misses"], cache.stats()["hits"]) == (2, 0)


def test_a_factor_read_after_the_encoder_is_read_on_every_call_and_a_method_cached_whole_serves_it_stale() -> None:
    """State read after the encoder, on a component, is read on every call: the method runs, its encoder's call is
    answered. Where the cache recognises no encoder the method is cached whole, as upstream does: served stale."""
    pipeline = RescaledPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline)
    before = pipeline.encode_prompt(IDS)
    pipeline.output_scale = 2.0
    again = pipeline.encode_prompt(IDS)
    assert torch.equal(again[0], before[0] * 2) and pipeline.encoder_runs == 1
    assert (cache.stats()["misses"], cache.stats()["hits"]) == (1, 1)
    unwatched = RescaledPipeline(OneHotEncoder())
    cache = install_prompt_embed_cache(unwatched)
    before = unwatched.encode_prompt(IDS)
    unwatched.output_scale = 2.0
    assert same(unwatched.encode_prompt(IDS), before) and unwatched.encoder_runs == 1
    assert cache.stats()["key_only_hits"] == 1


def test_an_audit_encodes_an_answered_encoder_call_again_and_finds_it_equal() -> None:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    reference = TokenIdTextPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(audit=1.0))
    expected = reference.encode_prompt(IDS)
    for _ in range(4):  # a miss, then hits that agree with a fresh encode: served from the cache
        assert same(pipeline.encode_prompt(IDS), expected)
    stats = cache.snapshot()
    assert (stats.misses, stats.hits, stats.audits, stats.audit_mismatches) == (1, 3, 3, 0)
    assert pipeline.encoder_runs == 1 + 3  # each hit's encoder call encoded again
    assert stats.enabled and stats.size == 1
    assert cache.stats()["methods"]["encode_prompt"]["audits"] == 3


def test_an_encoder_changed_unseen_is_caught_by_an_audit_served_fresh_and_the_class_turned_off(caplog) -> None:
    """Weights written through ``.data``: no key, no version counter sees it. The audit's encode differs from the
    entry: the call is served the fresh output, the cache turns off for the pipeline's class."""
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    reference = TokenIdTextPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(audit=1.0))
    first = pipeline.encode_prompt(IDS)
    assert same(pipeline.encode_prompt(IDS), first)
    assert (cache.snapshot().audits, cache.snapshot().audit_mismatches) == (1, 0)
    caplog.set_level(logging.WARNING, logger="vllm_omni_prompt_cache")
    written_unseen(pipeline.text_encoder)
    written_unseen(reference.text_encoder)
    fresh = reference.encode_prompt(IDS)
    assert not same(fresh, first)
    assert same(pipeline.encode_prompt(IDS), fresh)  # the audit's encode, not the stale entry
    stats = cache.snapshot()
    assert (stats.audits, stats.audit_mismatches, stats.enabled, stats.size) == (2, 1, False, 0)
    runs = pipeline.encoder_runs
    assert same(pipeline.encode_prompt(IDS), fresh) and pipeline.encoder_runs == runs + 1  # off: encoded
    (reason,) = cache.snapshot().bypass_reasons
    assert reason.startswith("an audit found a served entry differing from a fresh encode")
    warned = [record.message for record in caplog.records if "an audit re-encoded a hit" in record.message]
    assert len(warned) == 1 and "TokenIdTextPipeline" in warned[0]
    later = install_prompt_embed_cache(TokenIdTextPipeline(build_qwen2_encoder()))  # the class stays off
    assert not later.enabled and later.off_reason == reason


def test_a_fraction_audits_about_that_share_of_hits() -> None:
    pipeline = RescaledPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(audit=0.25))
    for _ in range(401):
        pipeline.encode_prompt(IDS)
    stats = cache.snapshot()
    assert stats.hits == 400 and 60 <= stats.audits <= 140 and stats.audit_mismatches == 0  # 100 +- 4.6 sd
    assert pipeline.encoder_runs == 1 + stats.audits


@pytest.mark.parametrize(("text", "share"), [("0.01", 0.01), ("5%", 0.05), ("off", 0.0), ("1", 1.0)])
def test_audit_spellings(monkeypatch, text, share) -> None:
    monkeypatch.setenv(AUDIT.env, text)
    assert resolve_prompt_embed_cache_settings().audit == share


@pytest.mark.parametrize("bad", ["-0.1", "1.5", "abc", "150%"])
def test_a_bad_audit_share_is_refused_naming_the_setting(monkeypatch, bad) -> None:
    monkeypatch.setenv(AUDIT.env, bad)
    with pytest.raises(PromptEmbedCacheConfigError, match=f"invalid prompt_embed_cache_audit='{bad}' from environment"):
        resolve_prompt_embed_cache_settings()


def test_ranks_that_see_the_same_calls_audit_the_same_hits() -> None:
    """An encoder with collectives must run on every rank of a stage or on none."""
    ranks = [RescaledPipeline(build_qwen2_encoder()) for _ in range(2)]
    caches = [install_prompt_embed_cache(rank, settings=PromptEmbedCacheSettings(audit=0.3)) for rank in ranks]
    runs = []
    for rank in ranks:
        trace = []
        for _ in range(60):
            before = rank.encoder_runs
            rank.encode_prompt(IDS)
            trace.append(rank.encoder_runs - before)
        runs.append(trace)
    assert runs[0] == runs[1] and 0 < caches[0].snapshot().audits < 59


class MaskingEncoder(torch.nn.Module):
    """A text encoder that returns an additive attention mask beside its hidden states, -inf where padding is (and
    at one more position, so the output holds an infinity)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build_qwen2_encoder()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        additive = torch.zeros(attention_mask.shape, dtype=hidden.dtype).masked_fill(attention_mask == 0, float("-inf"))
        additive[..., 0] = float("-inf")
        return hidden, additive


class MaskedPipeline(TokenIdTextPipeline):
    def encode_prompt(self, prompt_ids, attention_mask=None):
        mask = torch.ones_like(prompt_ids) if attention_mask is None else attention_mask
        return self.text_encoder(input_ids=prompt_ids, attention_mask=mask.long())


def test_infinities_in_the_same_places_are_no_mismatch() -> None:
    pipeline = MaskedPipeline(MaskingEncoder())
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(audit=1.0))
    outputs = [pipeline.encode_prompt(IDS) for _ in range(3)]
    assert all(bool(output[1].isinf().any()) and same(output, outputs[0]) for output in outputs)
    stats = cache.snapshot()
    assert (stats.hits, stats.audits, stats.audit_mismatches, stats.enabled) == (2, 2, 0, True)


def test_an_audit_whose_encode_fails_leaves_the_hit_served() -> None:
    pipeline = RescaledPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(audit=1.0))
    first = pipeline.encode_prompt(IDS)

    def out_of_memory(module, args):
        raise torch.OutOfMemoryError("simulated: the audit's encode found no room")

    hook = pipeline.text_encoder.register_forward_pre_hook(out_of_memory)
    try:
        assert same(pipeline.encode_prompt(IDS), first)
    finally:
        hook.remove()
    stats = cache.snapshot()
    assert (stats.hits, stats.audits, stats.enabled) == (1, 0, True)


def test_a_stage_of_several_ranks_keeps_audits_off() -> None:
    from vllm_omni_prompt_cache.vllm_omni import runner

    settings = PromptEmbedCacheSettings(enabled=True, audit=1.0)
    several = runner.install_for_stage(RescaledPipeline(build_qwen2_encoder()), settings, "tiny", ranks=2)
    one = runner.install_for_stage(RescaledPipeline(build_qwen2_encoder()), settings, "tiny", ranks=1)
    assert several.audit is None and one.audit is not None
