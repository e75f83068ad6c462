"""Encode methods besides encode_prompt: found by watching the encoders, declared, keyed on what they read.

The classes below mirror the *call pattern* of verl-omni's adapters (main a1139baf) without their
diffusion parts:

* ``SD3TokenIdPromptMixin`` as in ``verl_omni/pipelines/sd3_flow_grpo/common.py``: token-ID requests
  go through ``encode_prompt_from_token_ids(clip_prompt_ids: list[list[int]], t5_prompt_ids:
  list[list[int]], num_images_per_prompt, max_sequence_length)``; each id list is right-padded to
  its encoder's fixed length, and copies are ``repeat(1, n, 1).view(B * n, ...)``;
* ``MiniMaxH3RolloutWeightSyncMixin`` as in ``verl_omni/pipelines/minimax_h3_diffusion_nft/common.py``:
  ``_ensure_prompt_text`` stores the request's ids on the instance (``_h3_prompt_ids``) and sets the
  prompt text to ``"[pretokenized]"``; ``encode_prompt(*, task, prompt, ...)`` reads the ids from
  the instance, so every prompt's call has the same arguments.

The full adapters run through ``AsyncOmni`` in ``tests/test_sd3_e2e.py`` and ``tests/test_ltx2_e2e.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.calls.methods import find_encode_methods, resolve_declared_methods
from vllm_omni_prompt_cache.proof.encoder_gate import DIFFERED
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.settings.schema import METHODS, PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns
from vllm_omni_prompt_cache.tiny.text_encoder import build_qwen2_encoder

CLIP_LENGTH = 12
T5_LENGTH = 16
PAD = 0


@pytest.fixture(scope="module")
def encoder() -> torch.nn.Module:
    return build_qwen2_encoder()


def _padded(ids: list[list[int]], length: int) -> torch.Tensor:
    return torch.tensor([row[:length] + [PAD] * (length - len(row[:length])) for row in ids], dtype=torch.long)


class SD3TokenIdPromptMixin:
    """Token-ID SD3 encoding, shaped like verl-omni's (see the module docstring)."""

    text_encoder: torch.nn.Module
    encoder_rows: int

    @torch.inference_mode()
    def encode_prompt_from_token_ids(
        self,
        clip_prompt_ids: list[list[int]],
        t5_prompt_ids: list[list[int]],
        num_images_per_prompt: int = 1,
        max_sequence_length: int = T5_LENGTH,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        clip = self.text_encoder(input_ids=_padded(clip_prompt_ids, CLIP_LENGTH)).last_hidden_state
        t5 = self.text_encoder(input_ids=_padded(t5_prompt_ids, max_sequence_length)).last_hidden_state
        self.encoder_rows += len(clip_prompt_ids)  # once the encoders ran: a hit runs this up to its first (its proof)
        embeds = torch.cat([clip, t5], dim=1)
        pooled = clip[:, -1]
        batch, n = len(clip_prompt_ids), num_images_per_prompt
        return (
            embeds.repeat(1, n, 1).view(batch * n, embeds.shape[1], -1),
            pooled.repeat(1, n).view(batch * n, -1),
        )


class TextPipeline(CountsEncoderRuns):
    """The text path every pipeline has: ``encode_prompt(prompt)`` over the same encoder (its counters are
    kept outside the instance, as a profiler's would be: they are not state the encode depends on)."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        self.text_encoder = encoder

    @torch.inference_mode()
    def encode_prompt(self, prompt: str | list[str], num_images_per_prompt: int = 1) -> torch.Tensor:
        prompts = [prompt] if isinstance(prompt, str) else prompt
        ids = [[1 + (ord(char) % 500) for char in text] or [1] for text in prompts]
        hidden = self.text_encoder(input_ids=_padded(ids, CLIP_LENGTH)).last_hidden_state
        self.encoder_rows += len(prompts)  # once the encoder ran: a hit runs this up to its encoder call (its proof)
        return hidden.repeat_interleave(num_images_per_prompt, dim=0)


class SD3StylePipeline(SD3TokenIdPromptMixin, TextPipeline):
    """Like verl-omni's ``StableDiffusion3PipelineWithLogProb``: text ``encode_prompt`` plus the token path."""


def ids(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1000, (length,), generator=generator).tolist()


def test_method_keys_never_meet_encode_prompt_keys(encoder) -> None:
    """Two methods with the same arguments return different things: their entries stay apart."""

    class TwoMethods(TextPipeline):
        @torch.inference_mode()
        def embed_pooled(self, prompt: str | list[str], num_images_per_prompt: int = 1) -> torch.Tensor:
            return self.encode_prompt.__wrapped__(prompt, num_images_per_prompt)[:, -1]

    pipeline = TwoMethods(encoder)
    path = f"{TwoMethods.__module__}.{TwoMethods.__qualname__}"
    install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(methods={path: ("embed_pooled",)}))
    full = pipeline.encode_prompt("a fox")
    pooled = pipeline.embed_pooled("a fox")
    assert full.dim() == 3 and pooled.dim() == 2
    assert torch.equal(pipeline.embed_pooled("a fox"), pooled)


def test_a_declared_method_is_resolved_with_clear_errors() -> None:
    path = f"{SD3StylePipeline.__module__}.{SD3StylePipeline.__qualname__}"
    assert resolve_declared_methods({path: ("encode_prompt_from_token_ids",)}, "a test") == {
        path: ("encode_prompt_from_token_ids",)
    }
    # A path through a re-export resolves to where the class is defined, which its MRO names.
    assert resolve_declared_methods({"torch.nn.Linear": ("forward",)}, "a test") == {
        "torch.nn.modules.linear.Linear": ("forward",)
    }
    linear = torch.nn.Linear(2, 2)
    declared = resolve_declared_methods({"torch.nn.Linear": ("forward",)}, "a test")
    assert [m.name for m in find_encode_methods(linear, declared)] == ["forward"]
    with pytest.raises(PromptEmbedCacheConfigError) as raised:
        resolve_declared_methods({path: ("encode_from_ids",)}, "a test")
    assert str(raised.value) == (
        f"invalid {METHODS.name} entry {path}=encode_from_ids from a test: {path} has no method "
        "'encode_from_ids'; expected methods of it that encode prompts"
    )
    with pytest.raises(PromptEmbedCacheConfigError, match=r"no_such_package\.mod\.Pipeline is not an importable class"):
        resolve_declared_methods({"no_such_package.mod.Pipeline": ("encode",)}, "a test")
    with pytest.raises(PromptEmbedCacheConfigError, match=r"torch\.nn\.NoSuchModule is not an importable class"):
        resolve_declared_methods({"torch.nn.NoSuchModule": ("forward",)}, "a test")


def test_the_worker_install_resolves_the_setting_and_names_a_bad_class(encoder, monkeypatch) -> None:
    """``prompt_embed_cache_methods`` from the environment, as a diffusion worker reads it."""
    from vllm_omni_prompt_cache.settings.resolved import resolve_prompt_embed_cache_settings
    from vllm_omni_prompt_cache.vllm_omni import runner

    path = f"{TextPipeline.__module__}.{TextPipeline.__qualname__}"
    monkeypatch.setenv(METHODS.env, f"{path}=encode_prompt_from_token_ids")  # declared on a base class
    settings = resolve_prompt_embed_cache_settings(enable=True)

    class Adapter(TextPipeline):  # defines the method in a class nobody listed
        encode_prompt_from_token_ids = SD3TokenIdPromptMixin.encode_prompt_from_token_ids

    with pytest.raises(PromptEmbedCacheConfigError, match=f"{path} has no method 'encode_prompt_from_token_ids'"):
        runner.install_for_stage(Adapter(encoder), settings, "tiny")
    monkeypatch.setenv(METHODS.env, f"{__name__}.SD3StylePipeline=encode_prompt_from_token_ids")
    settings = resolve_prompt_embed_cache_settings(enable=True)
    pipeline = SD3StylePipeline(encoder)
    cache = runner.install_for_stage(pipeline, settings, "tiny")
    assert set(cache.stats()["methods"]) == {"encode_prompt", "encode_prompt_from_token_ids"}
    monkeypatch.setenv(METHODS.env, "no_such_package.Pipeline=encode")
    with pytest.raises(PromptEmbedCacheConfigError, match=r"no_such_package\.Pipeline is not an importable class"):
        runner.install_for_stage(SD3StylePipeline(encoder), resolve_prompt_embed_cache_settings(enable=True), "tiny")


def test_an_encode_prompt_set_on_the_instance_is_wrapped(encoder) -> None:
    """Upstream's contract reads ``pipeline.encode_prompt``: one given to the instance only is cached too."""
    from types import SimpleNamespace

    text = TextPipeline(encoder)
    pipeline = SimpleNamespace(encode_prompt=text.encode_prompt)
    cache = install_prompt_embed_cache(pipeline, max_size=4)
    assert cache is not None and [m.name for m in find_encode_methods(pipeline)] == ["encode_prompt"]
    first = pipeline.encode_prompt("a fox")
    assert torch.equal(pipeline.encode_prompt("a fox"), first) and text.encoder_rows == 1
    assert (cache.hits, cache.misses) == (1, 1)


# --- Found by watching the encoders: any class, any name -------------------------------------------------


class RenamedAdapter(CountsEncoderRuns, torch.nn.Module):
    """A token-ID adapter in the LTX-2 shape under a name no code of ours knows: its forward injects the
    embeddings of ``_embed_ids`` (its own method name) into the request, then runs a stand-in DiT."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.dit = torch.nn.Linear(4, 4)

    @torch.inference_mode()
    def _embed_ids(self, token_ids: list[int], max_sequence_length: int = 16) -> torch.Tensor:
        hidden = self.text_encoder(input_ids=_padded([token_ids], max_sequence_length)).last_hidden_state
        self.encoder_rows += 1  # once the encoder ran: a hit runs this up to its encoder call (its proof)
        return hidden

    def _inject(self, request: dict) -> None:
        request["prompt_embeds"] = self._embed_ids(request["prompt_token_ids"])
        request["negative_prompt_embeds"] = self._embed_ids(request["negative_prompt_ids"])

    def forward(self, request: dict) -> torch.Tensor:
        self._inject(request)
        return self.dit(torch.zeros(4))


def test_an_encode_method_nobody_listed_is_found_by_watching_the_encoder(encoder) -> None:
    pipeline, reference = RenamedAdapter(encoder), RenamedAdapter(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=16)
    prompts = [ids(1, 7), ids(2, 9)]
    wrong = 0
    for _ in range(4):
        for prompt in prompts:
            got, want = (
                {"prompt_token_ids": list(prompt), "negative_prompt_ids": [1]},
                {
                    "prompt_token_ids": list(prompt),
                    "negative_prompt_ids": [1],
                },
            )
            pipeline(got), reference(want)
            wrong += not torch.equal(got["prompt_embeds"], want["prompt_embeds"])
            wrong += not torch.equal(got["negative_prompt_embeds"], want["negative_prompt_embeds"])
    assert wrong == 0
    described = cache.stats()["encode_methods"]
    assert described["_embed_ids"]["state"] == "cached" and described["_embed_ids"]["found"].startswith("found")
    assert set(described) == {"_embed_ids"}  # the deepest method the encoder calls share: tried first, kept
    # Request 1's prompt row opened the encode and its negative (the same encoder again) settled it, so
    # both ran before _embed_ids was wrapped; request 2 was its first call (kept, and its negative a miss
    # kept); then each distinct row once more at most, plus one first-hit check: 16 rows without the cache.
    assert reference.encoder_rows == 16
    assert pipeline.encoder_rows == 2 + 2 + 1 + 1
    assert cache.stats()["methods"]["_embed_ids"]["audits"] == 1  # the first-hit check


def test_finding_encodes_can_be_turned_off(encoder) -> None:
    pipeline = RenamedAdapter(encoder)
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(find_encodes=False))
    assert cache is None  # no encode_prompt, nothing declared: nothing to wrap


class StashedIds(CountsEncoderRuns, torch.nn.Module):
    """verl-omni's MiniMax-H3 pattern (minimax_h3_diffusion_nft/common.py): the request's ids are stashed on the
    instance, then ``encode_prompt(prompt="[pretokenized]")`` reads them, with the same arguments for every prompt."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder

    def _ensure_prompt_text(self, prompt_ids: list[int]) -> str:
        self._h3_prompt_ids = prompt_ids
        return "[pretokenized]"

    @torch.inference_mode()
    def encode_prompt(self, prompt: str, max_sequence_length: int = 16) -> torch.Tensor:
        token_ids = self._h3_prompt_ids if prompt == "[pretokenized]" else [1 + ord(c) % 500 for c in prompt]
        hidden = self.text_encoder(input_ids=_padded([token_ids], max_sequence_length)).last_hidden_state
        self.encoder_rows += 1  # once the encoder ran: a hit runs this up to its encoder call (its proof)
        return hidden

    def forward(self, prompt_ids: list[int]) -> torch.Tensor:
        return self.encode_prompt(prompt=self._ensure_prompt_text(prompt_ids))


def test_an_encode_that_reads_stashed_ids_is_keyed_on_them(encoder) -> None:
    pipeline, reference = StashedIds(encoder), StashedIds(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=16)
    pipeline.encode_prompt("a warm-up text prompt")  # the engine's warm-up: reads no stashed ids
    before = pipeline.encoder_rows
    a, b = ids(1, 6), ids(2, 11)
    wrong = sum(not torch.equal(pipeline(list(x)), reference(list(x))) for x in (a, a, b, a))
    assert wrong == 0
    # A (its read of the ids grows the key; kept under it), A (a hit, checked once), B, A (a hit).
    assert pipeline.encoder_rows - before == 2 + 1
    keyed_on = cache.stats()["encode_methods"]["encode_prompt"]["keyed_on"]
    assert "self._h3_prompt_ids (content)" in keyed_on


class StashesItsResult(CountsEncoderRuns, torch.nn.Module):
    """UniRL's MiniMax-H3 pattern: ``encode_prompt`` keeps its result on the instance for the trajectory."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder

    @torch.inference_mode()
    def encode_prompt(self, prompt_ids: list[int]) -> torch.Tensor:
        embeds = self.text_encoder(input_ids=_padded([prompt_ids], 16)).last_hidden_state
        self.encoder_rows += 1  # once the encoder ran: a hit runs this up to its encoder call (its proof)
        self._rl_text_embeddings = embeds
        self._rl_prompt_length = len(prompt_ids)
        return embeds


def test_a_hit_replays_what_the_encode_wrote(encoder) -> None:
    pipeline = StashesItsResult(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=16)
    a, b = ids(1, 6), ids(2, 11)
    states = []
    for x in (a, b, a, b, a):
        out = pipeline.encode_prompt(list(x))
        states.append((out, pipeline._rl_text_embeddings, pipeline._rl_prompt_length))
    assert pipeline.encoder_rows == 3  # a, b, and the first hit's check
    for (out, stashed, length), x in zip(states, (a, b, a, b, a), strict=True):
        assert stashed is out and length == len(x)
    assert torch.equal(states[4][0], states[0][0])
    assert cache.stats()["encode_methods"]["encode_prompt"]["writes_replayed"] == [
        "self._rl_text_embeddings",
        "self._rl_prompt_length",
    ]


class Holder:
    """A helper object no key can hold by content, as a request's state often is."""

    def __init__(self, ids: list[int], scale: float = 1.0) -> None:
        self.ids, self.scale = ids, scale


def test_an_object_read_before_the_encoder_is_proven_by_what_reaches_the_encoder(encoder) -> None:
    """No key can hold the holder, but what it hands the encoder is compared before each hit is served."""

    class ReadsAHolder(StashedIds):
        @torch.inference_mode()
        def encode_prompt(self, prompt: str, max_sequence_length: int = 16) -> torch.Tensor:
            hidden = self.text_encoder(input_ids=_padded([self.holder.ids], max_sequence_length)).last_hidden_state
            self.encoder_rows += 1  # once the encoder ran: a hit runs this up to its encoder call (its proof)
            return hidden

    pipeline, reference = ReadsAHolder(encoder), ReadsAHolder(encoder)
    cache = install_prompt_embed_cache(pipeline)
    a, b = ids(1, 6), ids(2, 9)
    wrong = 0
    for x in (a, a, b, a, b):
        pipeline.holder, reference.holder = Holder(x), Holder(x)  # set per request, after install
        wrong += not torch.equal(pipeline.encode_prompt("[pretokenized]"), reference.encode_prompt("[pretokenized]"))
    assert wrong == 0 and pipeline.encoder_rows == 2
    stats = cache.stats()
    assert stats["encode_methods"]["encode_prompt"]["state"] == "cached"
    assert (stats["hits"], stats["proven_hits"], stats["unproven_reasons"]) == (3, 3, {DIFFERED: 1})


def test_an_object_read_after_the_encoder_that_cannot_be_keyed_is_served_uncached_and_says_why(encoder, caplog) -> None:
    class ScalesByAHolder(StashedIds):
        @torch.inference_mode()
        def encode_prompt(self, prompt: str, max_sequence_length: int = 16) -> torch.Tensor:
            hidden = self.text_encoder(input_ids=_padded([[3, 4, 5]], max_sequence_length)).last_hidden_state
            self.encoder_rows += 1
            return hidden * self.holder.scale  # read after the encoder: no proof sees it

    pipeline = ScalesByAHolder(encoder)
    cache = install_prompt_embed_cache(pipeline)
    pipeline.holder = Holder([], scale=2.0)  # set after install, as a request's state is
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            pipeline.encode_prompt("[pretokenized]")
    assert pipeline.encoder_rows == 3
    why = "reads self.holder (a Holder), which cannot be keyed"
    assert cache.stats()["encode_methods"]["encode_prompt"]["refusal"] == why
    # The first call encoded (a miss) and found what it read; the two after it bypassed, naming it.
    counts = cache.stats()["methods"]["encode_prompt"]
    assert (counts["misses"], counts["bypass_reasons"]) == (1, {why: 2})
    assert sum("is not cached" in record.getMessage() for record in caplog.records) == 1


def test_a_queue_an_encode_pops_before_its_encoder_is_served_proven(encoder) -> None:
    """Popping is a change a hit repeats: the proof runs the encode up to its encoder call, pop included."""

    class Queue(StashedIds):
        @torch.inference_mode()
        def encode_prompt(self, prompt: str, max_sequence_length: int = 16) -> torch.Tensor:
            token_ids = self.queue.pop(0)
            hidden = self.text_encoder(input_ids=_padded([token_ids], max_sequence_length)).last_hidden_state
            self.encoder_rows += 1
            return hidden

    a, b = ids(1, 5), ids(2, 5)
    pipeline, reference = Queue(encoder), Queue(encoder)
    cache = install_prompt_embed_cache(pipeline)
    pipeline.queue, reference.queue = [a, b, a, b, a], [a, b, a, b, a]
    wrong = sum(not torch.equal(pipeline.encode_prompt("x"), reference.encode_prompt("x")) for _ in range(5))
    assert wrong == 0 and pipeline.encoder_rows == 2 and pipeline.queue == []
    assert cache.stats()["encode_methods"]["encode_prompt"]["instrumentation"] == ["self.queue"]


def test_state_read_before_the_encoder_and_changed_after_it_is_not_cached(encoder) -> None:
    """A cursor moved once the encode ran: a hit, stopped at the encoder, could not move it."""

    class Cursor(StashedIds):
        @torch.inference_mode()
        def encode_prompt(self, prompt: str, max_sequence_length: int = 16) -> torch.Tensor:
            token_ids = self.pending[self.position]
            hidden = self.text_encoder(input_ids=_padded([token_ids], max_sequence_length)).last_hidden_state
            self.position += 1
            return hidden

    a, b = ids(1, 5), ids(2, 5)
    pipeline, reference = Cursor(encoder), Cursor(encoder)
    cache = install_prompt_embed_cache(pipeline)
    for each in (pipeline, reference):
        each.pending, each.position = [a, b, a, b], 0
    wrong = sum(not torch.equal(pipeline.encode_prompt("x"), reference.encode_prompt("x")) for _ in range(4))
    assert wrong == 0 and pipeline.position == 4
    assert cache.stats()["encode_methods"]["encode_prompt"]["refusal"] == (
        "changes self.position, read before its text encoder and again after: a hit could not repeat it"
    )


class _Batch:
    """An object no key can hold, as a request or a collated batch is."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids


class InnermostTakesABatch(CountsEncoderRuns, torch.nn.Module):
    """The method nearest the encoder takes an object; the one around it takes the ids."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder

    def _run_encoder(self, batch: _Batch) -> torch.Tensor:
        hidden = self.text_encoder(input_ids=batch.ids).last_hidden_state
        self.encoder_rows += 1  # once the encoder ran: a hit runs this up to its encoder call (its proof)
        return hidden

    @torch.inference_mode()
    def embed(self, token_ids: list[int]) -> torch.Tensor:
        return self._run_encoder(_Batch(_padded([token_ids], 16)))


def test_a_refuted_candidate_hands_over_to_the_method_around_it(encoder) -> None:
    pipeline, reference = InnermostTakesABatch(encoder), InnermostTakesABatch(encoder)
    cache = install_prompt_embed_cache(pipeline)
    a, b = ids(1, 6), ids(2, 9)
    outputs = [pipeline.embed(list(x)) for x in (a, b, a, b, a, b, a)]
    assert all(
        torch.equal(out, reference.embed(list(x))) for out, x in zip(outputs, (a, b, a, b, a, b, a), strict=True)
    )
    described = cache.stats()["encode_methods"]
    assert described["_run_encoder"]["state"] == "not an encode"
    assert described["_run_encoder"]["refusal"].startswith("its arguments cannot be keyed")
    assert described["embed"]["state"] == "cached"
    # a and b revealed the encode (the second settled the first), b tried _run_encoder (refuted),
    # a was embed's first call (kept), b a miss, then hits (the first one checked once).
    assert pipeline.encoder_rows == 2 + 1 + 1 + 1 + 1
