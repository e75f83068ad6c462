"""Encode methods besides encode_prompt: known, declared, refused, on a real tiny transformers encoder.

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

from vllm_omni_prompt_cache import install_prompt_embed_cache, uninstall_prompt_embed_cache
from vllm_omni_prompt_cache.config import METHODS, PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.tiny.text_encoder import build_qwen2_encoder
from vllm_omni_prompt_cache.vllm_omni.methods import (
    HIDDEN_INPUTS,
    KNOWN_METHODS,
    find_encode_methods,
    resolve_declared_methods,
)

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

    # The cache recognises the method by its class's name and package: this class stands where
    # verl-omni's is (a same-named class elsewhere is not recognised, see below).
    __module__ = "verl_omni.pipelines.sd3_flow_grpo.common"

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
        self.encoder_rows += len(clip_prompt_ids)
        clip = self.text_encoder(input_ids=_padded(clip_prompt_ids, CLIP_LENGTH)).last_hidden_state
        t5 = self.text_encoder(input_ids=_padded(t5_prompt_ids, max_sequence_length)).last_hidden_state
        embeds = torch.cat([clip, t5], dim=1)
        pooled = clip[:, -1]
        batch, n = len(clip_prompt_ids), num_images_per_prompt
        return (
            embeds.repeat(1, n, 1).view(batch * n, embeds.shape[1], -1),
            pooled.repeat(1, n).view(batch * n, -1),
        )


class TextPipeline:
    """The text path every pipeline has: ``encode_prompt(prompt)`` over the same encoder."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        self.text_encoder = encoder
        self.encoder_rows = 0

    @torch.inference_mode()
    def encode_prompt(self, prompt: str | list[str], num_images_per_prompt: int = 1) -> torch.Tensor:
        prompts = [prompt] if isinstance(prompt, str) else prompt
        self.encoder_rows += len(prompts)
        ids = [[1 + (ord(char) % 500) for char in text] or [1] for text in prompts]
        hidden = self.text_encoder(input_ids=_padded(ids, CLIP_LENGTH)).last_hidden_state
        return hidden.repeat_interleave(num_images_per_prompt, dim=0)


class SD3StylePipeline(SD3TokenIdPromptMixin, TextPipeline):
    """Like verl-omni's ``StableDiffusion3PipelineWithLogProb``: text ``encode_prompt`` plus the token path."""


def ids(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1000, (length,), generator=generator).tolist()


def test_a_known_encode_method_is_cached_beside_encode_prompt_with_its_own_counts(encoder) -> None:
    pipeline = SD3StylePipeline(encoder)
    reference = SD3StylePipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=16)
    assert [m.name for m in find_encode_methods(reference)] == ["encode_prompt", "encode_prompt_from_token_ids"]
    clip, t5 = [ids(1, 7), ids(2, 9)], [ids(3, 11), ids(4, 5)]

    # One request per forward, as at max_num_seqs 1: each sibling is a fresh list of one prompt.
    for _ in range(4):
        for row in range(2):
            got = pipeline.encode_prompt_from_token_ids([list(clip[row])], [list(t5[row])], 1, T5_LENGTH)
            want = reference.encode_prompt_from_token_ids([clip[row]], [t5[row]], 1, T5_LENGTH)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        pipeline.encode_prompt([""])  # the CFG negative, through the text path
    assert pipeline.encoder_rows == 3  # two prompts and the empty negative, each once

    # A batch of both prompts, two copies each (max_num_seqs > 1): rows served, nothing encoded.
    got = pipeline.encode_prompt_from_token_ids([clip[1], clip[0]], [t5[1], t5[0]], 2, T5_LENGTH)
    want = reference.encode_prompt_from_token_ids([clip[1], clip[0]], [t5[1], t5[0]], 2, T5_LENGTH)
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)  # batch-invariance gap only
    stats = cache.stats()
    by_method = stats["methods"]
    assert set(by_method) == {"encode_prompt", "encode_prompt_from_token_ids"}
    token_path = by_method["encode_prompt_from_token_ids"]
    text_path = by_method["encode_prompt"]
    # 8 one-prompt calls: 2 misses, 6 hits; the batched call is a miss too (its check ran the encoder).
    assert (token_path["hits"], token_path["misses"]) == (6, 3)
    assert token_path["row_misses"] == 2 and token_path["bypass_reasons"] == {}
    assert (text_path["hits"], text_path["misses"], text_path["bypass_reasons"]) == (3, 1, {})
    assert stats["hits"] == token_path["hits"] + text_path["hits"]  # the totals are the methods' sums
    assert stats["misses"] == token_path["misses"] + text_path["misses"]
    # The batched call was checked once against the uncached call (a proven layout found by name).
    assert token_path["layout_checks"] == 1 and token_path["layout_mismatches"] == 0

    cache.clear()  # new weights: every method's entries go
    pipeline.encode_prompt_from_token_ids([clip[0]], [t5[0]], 1, T5_LENGTH)
    assert pipeline.encoder_rows == 3 + 2 + 1  # the check's 2 rows, then the re-encode
    uninstall_prompt_embed_cache(pipeline)
    assert "encode_prompt_from_token_ids" not in vars(pipeline) and "encode_prompt" not in vars(pipeline)
    assert not hasattr(pipeline, "_prompt_embed_cache")


def test_method_keys_never_meet_encode_prompt_keys(encoder) -> None:
    """Two methods with the same arguments return different things: their entries stay apart."""

    class TwoMethods(TextPipeline):
        @torch.inference_mode()
        def embed_pooled(self, prompt: str | list[str], num_images_per_prompt: int = 1) -> torch.Tensor:
            return self.encode_prompt.__wrapped__(prompt, num_images_per_prompt)[:, -1]

    pipeline = TwoMethods(encoder)
    path = f"{TwoMethods.__module__}.{TwoMethods.__qualname__}"
    install_prompt_embed_cache(pipeline, methods={path: ("embed_pooled",)})
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


def test_a_same_named_class_of_another_package_is_not_taken_for_the_adapter(encoder) -> None:
    """A fork's class of the adapter's name, defined elsewhere, has code nobody read: not cached."""
    fork = type("SD3TokenIdPromptMixin", (), dict(vars(SD3TokenIdPromptMixin)) | {"__module__": "my_fork.sd3"})
    pipeline = type("ForkPipeline", (fork, TextPipeline), {})(encoder)
    assert [m.name for m in find_encode_methods(pipeline)] == ["encode_prompt"]

    class SameNameOverride(SD3StylePipeline):  # defines it again, even under the owner's own name
        def encode_prompt_from_token_ids(self, *args, **kwargs):  # type: ignore[override]
            return super().encode_prompt_from_token_ids(*args, **kwargs)

    SameNameOverride.__name__ = "SD3TokenIdPromptMixin"
    assert [m.name for m in find_encode_methods(SameNameOverride(encoder))] == ["encode_prompt"]


def test_a_known_method_that_a_subclass_replaced_is_not_cached_unless_declared(encoder) -> None:
    """The known entry vouches for the code it was read in, not for an override nobody read."""

    class Overriding(SD3StylePipeline):
        def encode_prompt_from_token_ids(self, *args, **kwargs):  # type: ignore[override]
            return super().encode_prompt_from_token_ids(*args, **kwargs)

    assert [m.name for m in find_encode_methods(Overriding(encoder))] == ["encode_prompt"]
    path = f"{Overriding.__module__}.{Overriding.__qualname__}"
    declared = find_encode_methods(Overriding(encoder), {path: ("encode_prompt_from_token_ids",)})
    assert [m.name for m in declared] == ["encode_prompt", "encode_prompt_from_token_ids"]
    assert declared[1].source == f"declared for {path} by the {METHODS.name} setting"


# --- hidden input: the MiniMax-H3 pattern --------------------------------------------------------


class MiniMaxH3RolloutWeightSyncMixin:
    """Reads the request's ids from the instance, as verl-omni's MiniMax-H3 adapter does."""

    text_encoder: torch.nn.Module
    _h3_prompt_ids: torch.Tensor | None = None

    @torch.inference_mode()
    def encode_prompt(self, *, task: str, prompt: str, image=None, prepared_videos=None, **kwargs):
        prompt_ids = getattr(self, "_h3_prompt_ids", None)
        if prompt_ids is None or task != "t2va":
            raise NotImplementedError("the text path is not mirrored")
        hidden = self.text_encoder(input_ids=prompt_ids.unsqueeze(0)).last_hidden_state[0]
        return hidden, torch.ones(hidden.shape[0], dtype=torch.long)

    def _ensure_prompt_text(self, request: dict) -> None:
        self._h3_prompt_ids = torch.as_tensor(request["prompt_token_ids"], dtype=torch.long)
        request["prompt"] = "[pretokenized]"


class H3StylePipeline(MiniMaxH3RolloutWeightSyncMixin):
    def __init__(self, encoder: torch.nn.Module) -> None:
        self.text_encoder = encoder

    def forward(self, request: dict):
        self._ensure_prompt_text(request)
        try:
            return self.encode_prompt(task="t2va", prompt=request["prompt"])
        finally:
            self._h3_prompt_ids = None


def test_an_encode_that_reads_hidden_input_is_never_served_from_the_cache(encoder, caplog) -> None:
    hidden = HIDDEN_INPUTS[0]
    assert (hidden.owner, hidden.method) == (MiniMaxH3RolloutWeightSyncMixin.__name__, "encode_prompt")
    pipeline = H3StylePipeline(encoder)
    with caplog.at_level(logging.WARNING, logger="vllm_omni_prompt_cache"):
        cache = install_prompt_embed_cache(pipeline, max_size=8)
    assert any("_h3_prompt_ids" in record.getMessage() for record in caplog.records)
    first, second = ids(11, 9), ids(12, 9)
    outputs = [pipeline.forward({"prompt_token_ids": row})[0] for row in (first, second, first)]
    reference = H3StylePipeline(encoder)
    expected = [reference.forward({"prompt_token_ids": row})[0] for row in (first, second, first)]
    assert not torch.equal(outputs[0], outputs[1])  # two prompts, same arguments: two embeddings
    assert all(torch.equal(got, want) for got, want in zip(outputs, expected, strict=True))
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], len(cache)) == (0, 0, 0)
    assert stats["bypass_reasons"] == {hidden.reason: 3}
    assert hidden.reason.startswith("encode_prompt reads self._h3_prompt_ids (set by _ensure_prompt_text), which")


def test_without_the_refusal_the_hidden_input_pattern_would_get_a_wrong_embedding(encoder) -> None:
    """Why the refusal exists: the same class under a name nobody knows is keyed on its arguments."""

    renamed = type("RenamedMixin", (), dict(vars(MiniMaxH3RolloutWeightSyncMixin)))
    pipeline = type(
        "UnknownH3", (renamed,), {"__init__": H3StylePipeline.__init__, "forward": H3StylePipeline.forward}
    )(encoder)
    install_prompt_embed_cache(pipeline, max_size=8)
    first = pipeline.forward({"prompt_token_ids": ids(11, 9)})[0]
    second = pipeline.forward({"prompt_token_ids": ids(12, 9)})[0]
    assert torch.equal(first, second)  # served the first prompt's embedding: the hazard the refusal prevents


def test_a_subclass_of_both_hidden_input_classes_names_the_adapters_attribute() -> None:
    """verl-omni's adapter subclasses vLLM-Omni's MiniMaxH3Pipeline, whose encode_prompt is refused too."""
    from vllm_omni_prompt_cache.vllm_omni.methods import hidden_input

    class MiniMaxH3Pipeline:
        def encode_prompt(self, prepared):
            return prepared

    class Adapter(MiniMaxH3RolloutWeightSyncMixin, MiniMaxH3Pipeline):
        pass

    assert "self._h3_prompt_ids" in hidden_input(Adapter, "encode_prompt").reason
    assert "by broadcast from rank 0" in hidden_input(MiniMaxH3Pipeline, "encode_prompt").reason
    assert hidden_input(MiniMaxH3Pipeline, "encode_prompt_from_token_ids") is None


def test_a_wrapped_method_called_by_another_runs_inside_the_outer_call(encoder) -> None:
    """MAGI-2's encode_prompt calls its _encode_prompts (both wrapped): one encode is one call and one entry."""

    class Magi2Pipeline(TextPipeline):
        __module__ = "vllm_omni.diffusion.models.magi2.pipeline_magi2"  # where the known method lives

        def _encode_prompts(self, prompts: tuple[str, ...]) -> torch.Tensor:
            return TextPipeline.encode_prompt(self, list(prompts))

        def encode_prompt(self, prompt: str) -> torch.Tensor:  # type: ignore[override]
            return self._encode_prompts((prompt,))

    pipeline = Magi2Pipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=8)
    first = pipeline.encode_prompt("a fox")
    assert torch.equal(pipeline.encode_prompt("a fox"), first)
    assert torch.equal(pipeline._encode_prompts(("a fox",)), first)  # as its forward calls it: its own entry
    pipeline._encode_prompts(("a fox",))  # and again: a hit
    stats = cache.stats()
    assert pipeline.encoder_rows == 2  # encode_prompt's miss (through _encode_prompts), _encode_prompts' miss
    assert (stats["hits"], stats["misses"], stats["bypassed"], len(cache)) == (2, 2, 0, 2)
    by_method = stats["methods"]
    assert (by_method["encode_prompt"]["hits"], by_method["encode_prompt"]["misses"]) == (1, 1)
    assert (by_method["_encode_prompts"]["hits"], by_method["_encode_prompts"]["misses"]) == (1, 1)


def test_upstream_counter_assignment_moves_encode_prompts_share_and_zero_resets_all(encoder) -> None:
    pipeline = SD3StylePipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=8)
    pipeline.encode_prompt("a")
    pipeline.encode_prompt("a")
    pipeline.encode_prompt_from_token_ids([ids(1, 4)], [ids(2, 4)])
    assert (cache.hits, cache.misses) == (1, 2)
    cache.hits += 1  # as upstream's wrapper counts
    assert cache.stats()["methods"]["encode_prompt"]["hits"] == 2 and cache.hits == 2
    cache.hits = cache.misses = cache.bypassed = 0
    assert (cache.hits, cache.misses, cache.bypassed) == (0, 0, 0)
    assert all(counts["hits"] == counts["misses"] == 0 for counts in cache.stats()["methods"].values())


def test_the_registries_name_real_classes_and_methods() -> None:
    assert {(known.owner, known.method) for known in KNOWN_METHODS} >= {
        ("SD3TokenIdPromptMixin", "encode_prompt_from_token_ids"),
        ("LTX23PipelineWithLogProb", "_encode_token_ids"),
        ("Magi2Pipeline", "_encode_prompts"),
    }


def test_the_worker_install_resolves_the_setting_and_names_a_bad_class(encoder, monkeypatch) -> None:
    """``prompt_embed_cache_methods`` from the environment, as a diffusion worker reads it."""
    from vllm_omni_prompt_cache.config import resolve_prompt_embed_cache_settings
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
