"""Encode methods besides encode_prompt: declared, or found by watching the encoders (wrapped to count their calls).

Every wrapped method runs for real on every call: what it reads, writes, pops or moves is its own, as uncached; its
text-encoder calls are what the cache answers, keyed by what reaches the encoder.

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
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.settings.schema import METHODS, PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns
from vllm_omni_prompt_cache.tiny.text_encoder import build_qwen2_encoder

CLIP_LENGTH = 12
T5_LENGTH = 16
PAD = 0


@pytest.fixture
def encoder() -> torch.nn.Module:
    """A fresh encoder per test: an installed cache intercepts its encoder module's calls, whoever makes them."""
    return build_qwen2_encoder()


@pytest.fixture
def reference_encoder() -> torch.nn.Module:
    """The same weights as ``encoder`` in another module, which no cache intercepts: uncached references."""
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
        embeds = torch.cat([clip, t5], dim=1)
        pooled = clip[:, -1]
        batch, n = len(clip_prompt_ids), num_images_per_prompt
        return (
            embeds.repeat(1, n, 1).view(batch * n, embeds.shape[1], -1),
            pooled.repeat(1, n).view(batch * n, -1),
        )


class TextPipeline(CountsEncoderRuns):
    """The text path every pipeline has: ``encode_prompt(prompt)`` over the same encoder. ``encoder_runs`` and
    ``encoder_rows`` count what reached the encoder's forward (a hook on it), not the method's runs."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        self.text_encoder = encoder
        self.count_encoder_calls(encoder)

    @torch.inference_mode()
    def encode_prompt(self, prompt: str | list[str], num_images_per_prompt: int = 1) -> torch.Tensor:
        prompts = [prompt] if isinstance(prompt, str) else prompt
        ids = [[1 + (ord(char) % 500) for char in text] or [1] for text in prompts]
        hidden = self.text_encoder(input_ids=_padded(ids, CLIP_LENGTH)).last_hidden_state
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


# --- Found by watching the encoders: wrapped to count their calls, under the deepest pipeline method ----------


class RenamedAdapter(CountsEncoderRuns, torch.nn.Module):
    """A token-ID adapter in the LTX-2 shape under a name no code of ours knows: its forward injects the
    embeddings of ``_embed_ids`` (its own method name) into the request, then runs a stand-in DiT.
    ``encoder_rows`` counts rows that reached the encoder's forward; ``body_runs`` the runs of ``_embed_ids``."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.dit = torch.nn.Linear(4, 4)
        self.count_encoder_calls(encoder)
        self.body_runs = 0

    @torch.inference_mode()
    def _embed_ids(self, token_ids: list[int], max_sequence_length: int = 16) -> torch.Tensor:
        self.body_runs += 1
        return self.text_encoder(input_ids=_padded([token_ids], max_sequence_length)).last_hidden_state

    def _inject(self, request: dict) -> None:
        request["prompt_embeds"] = self._embed_ids(request["prompt_token_ids"])
        request["negative_prompt_embeds"] = self._embed_ids(request["negative_prompt_ids"])

    def forward(self, request: dict) -> torch.Tensor:
        self._inject(request)
        return self.dit(torch.zeros(4))


def test_an_encode_method_nobody_listed_is_found_by_watching_the_encoder(encoder, reference_encoder) -> None:
    pipeline, reference = RenamedAdapter(encoder), RenamedAdapter(reference_encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=16)
    prompts = [ids(1, 7), ids(2, 9)]
    wrong = 0
    for _ in range(4):
        for prompt in prompts:
            got = {"prompt_token_ids": list(prompt), "negative_prompt_ids": [1]}
            want = {"prompt_token_ids": list(prompt), "negative_prompt_ids": [1]}
            pipeline(got), reference(want)
            wrong += not torch.equal(got["prompt_embeds"], want["prompt_embeds"])
            wrong += not torch.equal(got["negative_prompt_embeds"], want["negative_prompt_embeds"])
    assert wrong == 0
    described = cache.stats()["encode_methods"]
    assert described["_embed_ids"]["state"] == "cached" and described["_embed_ids"]["found"].startswith("found")
    assert set(described) == {"_embed_ids"}  # the deepest method on the stack, not _inject around it, nor forward
    # 16 encoder calls without the cache; with it, each distinct input once: two prompts and the negative.
    assert reference.encoder_rows == 16
    assert pipeline.encoder_rows == 3
    assert pipeline.body_runs == 16  # wrapped only to count: the method itself runs on every call
    counts = cache.stats()["methods"]["_embed_ids"]
    assert (counts["misses"], counts["hits"], counts["bypass_reasons"]) == (3, 13, {})


def test_finding_encodes_can_be_turned_off(encoder, reference_encoder) -> None:
    """With ``find_encodes`` off no method is wrapped by watching: the encoder's calls are still served, counted
    under the encoder's path."""
    pipeline, reference = RenamedAdapter(encoder), RenamedAdapter(reference_encoder)
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(find_encodes=False))
    assert cache is not None  # no encode_prompt, nothing declared, but a text encoder to serve
    for _ in range(2):
        got = {"prompt_token_ids": ids(1, 7), "negative_prompt_ids": [1]}
        want = {"prompt_token_ids": ids(1, 7), "negative_prompt_ids": [1]}
        pipeline(got), reference(want)
        assert torch.equal(got["prompt_embeds"], want["prompt_embeds"])
        assert torch.equal(got["negative_prompt_embeds"], want["negative_prompt_embeds"])
    assert cache.stats()["encode_methods"] == {}
    assert "_embed_ids" not in vars(pipeline)  # not wrapped
    assert pipeline.encoder_rows == 2
    assert (cache.stats()["hits"], cache.stats()["misses"]) == (2, 2)
    methods = cache.stats()["methods"]
    assert (methods["text_encoder"]["hits"], methods["text_encoder"]["misses"]) == (2, 2)
    assert all(counts["hits"] + counts["misses"] == 0 for name, counts in methods.items() if name != "text_encoder")


class StashedIds(CountsEncoderRuns, torch.nn.Module):
    """verl-omni's MiniMax-H3 pattern (minimax_h3_diffusion_nft/common.py): the request's ids are stashed on the
    instance, then ``encode_prompt(prompt="[pretokenized]")`` reads them, with the same arguments for every prompt.
    ``encoder_rows`` counts rows that reached the encoder's forward (a hook on it)."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.count_encoder_calls(encoder)

    def _ensure_prompt_text(self, prompt_ids: list[int]) -> str:
        self._h3_prompt_ids = prompt_ids
        return "[pretokenized]"

    @torch.inference_mode()
    def encode_prompt(self, prompt: str, max_sequence_length: int = 16) -> torch.Tensor:
        token_ids = self._h3_prompt_ids if prompt == "[pretokenized]" else [1 + ord(c) % 500 for c in prompt]
        return self.text_encoder(input_ids=_padded([token_ids], max_sequence_length)).last_hidden_state

    def forward(self, prompt_ids: list[int]) -> torch.Tensor:
        return self.encode_prompt(prompt=self._ensure_prompt_text(prompt_ids))


def test_an_encode_that_reads_stashed_ids_is_served_by_what_reaches_its_encoder(encoder, reference_encoder) -> None:
    pipeline, reference = StashedIds(encoder), StashedIds(reference_encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=16)
    pipeline.encode_prompt("a warm-up text prompt")  # the engine's warm-up: reads no stashed ids
    before = pipeline.encoder_rows
    a, b = ids(1, 6), ids(2, 11)
    wrong = sum(not torch.equal(pipeline(list(x)), reference(list(x))) for x in (a, a, b, a))
    assert wrong == 0
    # Every call has the same arguments; the ids reach the encoder: A (a miss), A (a hit), B (a miss), A (a hit).
    assert pipeline.encoder_rows - before == 2
    assert cache.stats()["encode_methods"]["encode_prompt"]["state"] == "cached"
    assert (cache.stats()["hits"], cache.stats()["misses"]) == (2, 3)


class StashesItsResult(CountsEncoderRuns, torch.nn.Module):
    """UniRL's MiniMax-H3 pattern: ``encode_prompt`` keeps its result on the instance for the trajectory."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.count_encoder_calls(encoder)

    @torch.inference_mode()
    def encode_prompt(self, prompt_ids: list[int]) -> torch.Tensor:
        embeds = self.text_encoder(input_ids=_padded([prompt_ids], 16)).last_hidden_state
        self._rl_text_embeddings = embeds
        self._rl_prompt_length = len(prompt_ids)
        return embeds


def test_what_the_encode_writes_is_written_on_every_call(encoder, reference_encoder) -> None:
    pipeline, reference = StashesItsResult(encoder), StashesItsResult(reference_encoder)
    install_prompt_embed_cache(pipeline, max_size=16)
    a, b = ids(1, 6), ids(2, 11)
    states = []
    for x in (a, b, a, b, a):
        out = pipeline.encode_prompt(list(x))
        states.append((out, pipeline._rl_text_embeddings, pipeline._rl_prompt_length))
        assert torch.equal(out, reference.encode_prompt(list(x)))
    assert pipeline.encoder_rows == 2  # a, b
    for (out, stashed, length), x in zip(states, (a, b, a, b, a), strict=True):
        assert stashed is out and length == len(x)
    assert torch.equal(states[4][0], states[0][0])


class Holder:
    """A helper object no key can hold by content, as a request's state often is."""

    def __init__(self, ids: list[int], scale: float = 1.0) -> None:
        self.ids, self.scale = ids, scale


def test_an_object_read_before_the_encoder_needs_no_key_what_reaches_the_encoder_is_keyed(
    encoder, reference_encoder
) -> None:
    """No key can hold the holder; what it hands the encoder is what the encoder's calls are keyed by."""

    class ReadsAHolder(StashedIds):
        @torch.inference_mode()
        def encode_prompt(self, prompt: str, max_sequence_length: int = 16) -> torch.Tensor:
            return self.text_encoder(input_ids=_padded([self.holder.ids], max_sequence_length)).last_hidden_state

    pipeline, reference = ReadsAHolder(encoder), ReadsAHolder(reference_encoder)
    cache = install_prompt_embed_cache(pipeline)
    a, b = ids(1, 6), ids(2, 9)
    wrong = 0
    for x in (a, a, b, a, b):
        pipeline.holder, reference.holder = Holder(x), Holder(x)  # set per request, after install
        wrong += not torch.equal(pipeline.encode_prompt("[pretokenized]"), reference.encode_prompt("[pretokenized]"))
    assert wrong == 0 and pipeline.encoder_rows == 2
    stats = cache.stats()
    assert stats["encode_methods"]["encode_prompt"]["state"] == "cached"
    assert (stats["hits"], stats["misses"], stats["bypassed"]) == (3, 2, 0)


def test_an_object_read_after_the_encoder_is_read_on_every_call(encoder, reference_encoder, caplog) -> None:
    class ScalesByAHolder(StashedIds):
        @torch.inference_mode()
        def encode_prompt(self, prompt: str, max_sequence_length: int = 16) -> torch.Tensor:
            hidden = self.text_encoder(input_ids=_padded([[3, 4, 5]], max_sequence_length)).last_hidden_state
            return hidden * self.holder.scale  # read after the encoder: the method runs, so it is read

    pipeline, reference = ScalesByAHolder(encoder), ScalesByAHolder(reference_encoder)
    cache = install_prompt_embed_cache(pipeline)
    wrong = 0
    with caplog.at_level(logging.WARNING):
        for scale in (2.0, 3.0, 2.0):
            pipeline.holder, reference.holder = Holder([], scale=scale), Holder([], scale=scale)
            wrong += not torch.equal(
                pipeline.encode_prompt("[pretokenized]"), reference.encode_prompt("[pretokenized]")
            )
    assert wrong == 0
    assert pipeline.encoder_rows == 1  # the encoder's input never changed
    counts = cache.stats()["methods"]["encode_prompt"]
    assert (counts["misses"], counts["hits"], counts["bypass_reasons"]) == (1, 2, {})
    assert not any("is not cached" in record.getMessage() for record in caplog.records)


def test_a_queue_an_encode_pops_is_popped_on_every_call(encoder, reference_encoder) -> None:
    class Queue(StashedIds):
        @torch.inference_mode()
        def encode_prompt(self, prompt: str, max_sequence_length: int = 16) -> torch.Tensor:
            token_ids = self.queue.pop(0)
            return self.text_encoder(input_ids=_padded([token_ids], max_sequence_length)).last_hidden_state

    a, b = ids(1, 5), ids(2, 5)
    pipeline, reference = Queue(encoder), Queue(reference_encoder)
    install_prompt_embed_cache(pipeline)
    pipeline.queue, reference.queue = [a, b, a, b, a], [a, b, a, b, a]
    wrong = sum(not torch.equal(pipeline.encode_prompt("x"), reference.encode_prompt("x")) for _ in range(5))
    assert wrong == 0 and pipeline.encoder_rows == 2 and pipeline.queue == []


def test_state_read_before_the_encoder_and_changed_after_it_moves_on_every_call(encoder, reference_encoder) -> None:
    """A cursor moved once the encoder ran: the method runs on a hit too, so it moves."""

    class Cursor(StashedIds):
        @torch.inference_mode()
        def encode_prompt(self, prompt: str, max_sequence_length: int = 16) -> torch.Tensor:
            token_ids = self.pending[self.position]
            hidden = self.text_encoder(input_ids=_padded([token_ids], max_sequence_length)).last_hidden_state
            self.position += 1
            return hidden

    a, b = ids(1, 5), ids(2, 5)
    pipeline, reference = Cursor(encoder), Cursor(reference_encoder)
    cache = install_prompt_embed_cache(pipeline)
    for each in (pipeline, reference):
        each.pending, each.position = [a, b, a, b], 0
    wrong = sum(not torch.equal(pipeline.encode_prompt("x"), reference.encode_prompt("x")) for _ in range(4))
    assert wrong == 0 and pipeline.position == 4
    assert pipeline.encoder_rows == 2
    assert cache.stats()["encode_methods"]["encode_prompt"]["state"] == "cached"
    assert (cache.stats()["hits"], cache.stats()["misses"]) == (2, 2)


class _Batch:
    """An object no key can hold, as a request or a collated batch is."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids


class InnermostTakesABatch(CountsEncoderRuns, torch.nn.Module):
    """The method nearest the encoder takes an object; the one around it takes the ids."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.count_encoder_calls(encoder)

    def _run_encoder(self, batch: _Batch) -> torch.Tensor:
        return self.text_encoder(input_ids=batch.ids).last_hidden_state

    @torch.inference_mode()
    def embed(self, token_ids: list[int]) -> torch.Tensor:
        return self._run_encoder(_Batch(_padded([token_ids], 16)))


def test_a_found_encoder_call_is_counted_under_the_deepest_method_whatever_its_arguments(
    encoder, reference_encoder
) -> None:
    """The method nearest the encoder is found, though no key could hold its argument: nothing keys it, its
    encoder's calls are keyed; the method around it is left alone."""
    pipeline, reference = InnermostTakesABatch(encoder), InnermostTakesABatch(reference_encoder)
    cache = install_prompt_embed_cache(pipeline)
    a, b = ids(1, 6), ids(2, 9)
    outputs = [pipeline.embed(list(x)) for x in (a, b, a, b, a, b, a)]
    assert all(
        torch.equal(out, reference.embed(list(x))) for out, x in zip(outputs, (a, b, a, b, a, b, a), strict=True)
    )
    described = cache.stats()["encode_methods"]
    assert set(described) == {"_run_encoder"}
    assert described["_run_encoder"]["state"] == "cached" and described["_run_encoder"]["found"].startswith("found")
    assert pipeline.encoder_rows == 2  # a and b, once each
    counts = cache.stats()["methods"]["_run_encoder"]
    assert (counts["misses"], counts["hits"], counts["bypass_reasons"]) == (2, 5, {})


def test_a_declared_method_is_counted_under_its_own_name_and_a_found_one_is_not_added(
    encoder, reference_encoder
) -> None:
    """Declared ``embed``: the encoder calls it makes count under it; ``_run_encoder`` inside it is not wrapped."""
    path = f"{InnermostTakesABatch.__module__}.{InnermostTakesABatch.__qualname__}"
    pipeline, reference = InnermostTakesABatch(encoder), InnermostTakesABatch(reference_encoder)
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(methods={path: ("embed",)}))
    a, b = ids(1, 6), ids(2, 9)
    for x in (a, b, a, a):
        assert torch.equal(pipeline.embed(list(x)), reference.embed(list(x)))
    described = cache.stats()["encode_methods"]
    assert set(described) == {"embed"} and described["embed"]["state"] == "cached"
    assert not described["embed"]["found"].startswith("found")
    counts = cache.stats()["methods"]["embed"]
    assert (counts["misses"], counts["hits"]) == (2, 2)
    assert pipeline.encoder_rows == 2
