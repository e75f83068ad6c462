"""Audits: hits encoded again and compared, catching an encode that reads more than its arguments.

The pipeline is a token-ID ``encode_prompt`` that scales its embeddings by a factor kept on its text
encoder and read after the encoder ran: a component's state, which keys stand for by identity.
Changing the factor changes the embedding of the same arguments. Where the cache recognises the
encoder (a tiny real Qwen2), a hit's proof runs the code after the encoder too and sees it (see
``encoder_gate.py``); where it does not (an encoder with no token table: a one-hot matmul), hits are
served on their key alone, and nothing but an audit can see it: what an audit is for. A template kept the
same way but read before the encoder reaches it, and the proof serves nothing stale (the first test).
"""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.proof.encoder_gate import DIFFERED, DIFFERED_AFTER
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings, resolve_prompt_embed_cache_settings
from vllm_omni_prompt_cache.settings.schema import AUDIT, PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder

IDS = torch.tensor([[3, 1, 4, 1, 5, 9]])


class TemplatedPipeline(TokenIdTextPipeline):
    """Prepends ``self.template_ids`` to the prompt's ids inside ``encode_prompt``, the template kept on the text
    encoder (a component, which keys stand for by identity, as they do for a tokenizer whose template changes)."""

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


def test_a_template_changed_on_a_component_is_never_served_stale() -> None:
    """Keys compare arguments and the pipeline's own state, not a component's; the changed template reaches the
    encoder, so the hit's proof sees it and the call encodes."""
    pipeline = TemplatedPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline)
    before = pipeline.encode_prompt(IDS)
    pipeline.template_ids = torch.tensor([[8, 8]])
    after = pipeline.encode_prompt(IDS)
    assert not same(after, before) and pipeline.encoder_runs == 2
    assert cache.stats()["unproven_reasons"] == {DIFFERED: 1}


def test_a_factor_read_after_the_encoder_is_proven_and_without_a_proof_only_an_audit_sees_it() -> None:
    """State read after the encoder, on a component, reaches no key: a hit's proof sees what it does to the output
    where the cache recognises the encoder; where it does not, a hit is served on its key, stale: what the audit
    is for."""
    pipeline = RescaledPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline)
    before = pipeline.encode_prompt(IDS)
    pipeline.output_scale = 2.0
    again = pipeline.encode_prompt(IDS)
    assert torch.equal(again[0], before[0] * 2) and pipeline.encoder_runs == 2
    assert cache.stats()["unproven_reasons"] == {DIFFERED_AFTER: 1}
    unwatched = RescaledPipeline(OneHotEncoder())
    cache = install_prompt_embed_cache(unwatched)
    before = unwatched.encode_prompt(IDS)
    unwatched.output_scale = 2.0
    assert same(unwatched.encode_prompt(IDS), before) and unwatched.encoder_runs == 1
    assert cache.stats()["key_only_hits"] == 1


def test_an_audit_serves_the_fresh_encode_and_turns_the_class_off(caplog) -> None:
    encoder = OneHotEncoder()
    pipeline = RescaledPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(audit=1.0))
    first = pipeline.encode_prompt(IDS)
    for _ in range(3):  # hits that agree with a fresh encode: served from the cache
        assert same(pipeline.encode_prompt(IDS), first)
    stats = cache.snapshot()
    assert (stats.hits, stats.audits, stats.audit_mismatches, pipeline.encoder_runs) == (3, 3, 0, 4)
    caplog.set_level(logging.WARNING, logger="vllm_omni_prompt_cache")
    pipeline.output_scale = 2.0
    expected = RescaledPipeline(encoder)
    expected.output_scale = pipeline.output_scale
    fresh = expected.encode_prompt(IDS)
    assert same(pipeline.encode_prompt(IDS), fresh)  # the audit's encode, not the stale entry
    stats = cache.snapshot()
    assert (stats.audits, stats.audit_mismatches, stats.enabled, stats.size) == (4, 1, False, 0)
    runs = pipeline.encoder_runs
    assert same(pipeline.encode_prompt(IDS), fresh) and pipeline.encoder_runs == runs + 1  # off: encoded
    (reason,) = cache.snapshot().bypass_reasons
    assert reason.startswith("an audit found a served entry differing from a fresh encode")
    warned = [record.message for record in caplog.records if "an audit re-encoded a hit" in record.message]
    assert len(warned) == 1 and "RescaledPipeline" in warned[0]
    later = install_prompt_embed_cache(RescaledPipeline(encoder))  # the class stays off in this process
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
    encoder = build_qwen2_encoder()
    ranks = [RescaledPipeline(encoder) for _ in range(2)]
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


class MaskedPipeline(RescaledPipeline):
    """Returns an additive attention mask with -inf where padding is, as some pipelines do."""

    def encode_prompt(self, prompt_ids, attention_mask=None):
        embeds, mask = super().encode_prompt(prompt_ids, attention_mask)
        additive = torch.zeros(mask.shape, dtype=embeds.dtype).masked_fill(mask == 0, float("-inf"))
        additive[..., 0] = float("-inf")  # one masked position, so the output holds an infinity
        return embeds, additive


def test_infinities_in_the_same_places_are_no_mismatch() -> None:
    pipeline = MaskedPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(audit=1.0))
    for _ in range(3):
        pipeline.encode_prompt(IDS)
    stats = cache.snapshot()
    assert (stats.audits, stats.audit_mismatches, stats.enabled) == (2, 0, True)


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
    from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
    from vllm_omni_prompt_cache.vllm_omni import runner

    settings = PromptEmbedCacheSettings(enabled=True, audit=1.0)
    several = runner.install_for_stage(RescaledPipeline(build_qwen2_encoder()), settings, "tiny", ranks=2)
    one = runner.install_for_stage(RescaledPipeline(build_qwen2_encoder()), settings, "tiny", ranks=1)
    assert several.audit is None and one.audit is not None
