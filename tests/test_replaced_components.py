"""A component an encode reads (a text encoder, a tokenizer) replaced on the pipeline after install.

The key holds a component by name, guarded by its identity: the entries were made with the old one, and a
hit's proof would find the same token ids reaching the new encoder and serve what the old one computed.
So a replacement drops every entry and the method is learned again; the call that sees it encodes (a miss),
and the calls after are served what the new encoder computes.
"""

from __future__ import annotations

import logging

import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.calls.layouts import TOKEN_IDS
from vllm_omni_prompt_cache.calls.row_calls import RowCalls
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.tiny.text_encoder import QwenStyleTokenPipeline, TokenIdTextPipeline, build_qwen2_encoder


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    return ids, ids != 0


def _uncached(encoder: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return TokenIdTextPipeline(encoder).encode_prompt(ids, mask)


def _counts(pipeline: TokenIdTextPipeline) -> tuple[int, int, int]:
    stats = pipeline._prompt_embed_cache.stats()
    return pipeline.encoder_runs, stats["hits"], stats["misses"]


def _replace_encoder_after_hits(pipeline: TokenIdTextPipeline) -> tuple[torch.nn.Module, tuple]:
    """Serve one prompt three times (a miss, two hits), then put another encoder (other weights) in its place."""
    ids, mask = _ids()
    for _ in range(3):
        pipeline.encode_prompt(ids.clone(), mask.clone())
    assert _counts(pipeline) == (1, 2, 1)
    replacement = build_qwen2_encoder(seed=1)
    pipeline.text_encoder = replacement
    return replacement, (ids, mask)


def test_a_replaced_text_encoder_is_never_served_the_old_encoders_embedding(caplog) -> None:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder(seed=0))
    old = _uncached(build_qwen2_encoder(seed=0), *_ids())
    install_prompt_embed_cache(pipeline, max_size=8)
    replacement, (ids, mask) = _replace_encoder_after_hits(pipeline)
    expected = _uncached(replacement, ids, mask)
    assert not torch.equal(expected[0], old[0]), "the two encoders must differ for this test to mean anything"

    with caplog.at_level(logging.INFO, logger="vllm_omni_prompt_cache"):
        first = pipeline.encode_prompt(ids.clone(), mask.clone())
    assert torch.equal(first[0], expected[0])
    assert _counts(pipeline) == (2, 2, 2), "the call that saw the replacement encodes and is counted a miss"
    assert "TokenIdTextPipeline.encode_prompt: self.text_encoder was replaced" in caplog.text

    # Learned again, guarded by the new encoder: the calls after are hits of what it computed.
    for _ in range(3):
        served = pipeline.encode_prompt(ids.clone(), mask.clone())
        assert torch.equal(served[0], expected[0])
    assert _counts(pipeline) == (2, 5, 2)


def test_the_directory_tier_files_the_new_encoders_entry_under_its_own_weights(tmp_path) -> None:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder(seed=0))
    install_prompt_embed_cache(pipeline, max_size=8, settings=PromptEmbedCacheSettings(directory=tmp_path))
    replacement, (ids, mask) = _replace_encoder_after_hits(pipeline)
    expected = _uncached(replacement, ids, mask)

    served = pipeline.encode_prompt(ids.clone(), mask.clone())
    assert torch.equal(served[0], expected[0])
    assert _counts(pipeline) == (2, 2, 2)

    # Another process with the new weights reads the file the call after the replacement wrote.
    reader = TokenIdTextPipeline(build_qwen2_encoder(seed=1))
    install_prompt_embed_cache(reader, max_size=8, settings=PromptEmbedCacheSettings(directory=tmp_path))
    assert torch.equal(reader.encode_prompt(ids.clone(), mask.clone())[0], expected[0])
    assert reader.encoder_runs == 0


def test_the_same_component_set_again_keeps_the_entries() -> None:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    install_prompt_embed_cache(pipeline, max_size=8)
    ids, mask = _ids()
    pipeline.encode_prompt(ids, mask)
    pipeline.text_encoder = pipeline.text_encoder  # the same object: nothing to relearn

    pipeline.encode_prompt(ids.clone(), mask.clone())

    assert _counts(pipeline) == (1, 1, 1)


def test_an_encode_of_the_replaced_encoder_that_ends_after_the_clear_is_not_kept(monkeypatch) -> None:
    """Two threads, the replacement between them: call X learns with encoder E1; after its encode, before it
    keeps the result, E1 is replaced by E2 and call Y sees it and drops every entry. X's result was made with
    E1: kept after the clear, the calls after would be served it (the same token ids reach E2, so their proof
    passes). Made to happen: X waits until Y has cleared, and Y waits there until X has kept."""
    import threading

    pipeline = TokenIdTextPipeline(build_qwen2_encoder(seed=0))
    install_prompt_embed_cache(pipeline, max_size=8)
    ids, mask = _ids()
    pipeline.encode_prompt(ids.clone(), mask.clone())
    pipeline.text_encoder = build_qwen2_encoder(seed=1)  # E1: the next call (X) learns the method again with it
    e2 = build_qwen2_encoder(seed=2)
    expected = _uncached(e2, ids, mask)

    installation = pipeline._prompt_embed_cache_installation
    state = installation.methods["encode_prompt"].state
    cache = pipeline._prompt_embed_cache
    y_cleared, x_kept = threading.Event(), threading.Event()
    finish_learning, clear = state.finish_learning, cache.clear
    y_served: list = []

    def y() -> None:
        pipeline.text_encoder = e2
        y_served.append(pipeline.encode_prompt(ids.clone(), mask.clone()))

    y_thread = threading.Thread(target=y)

    def finish_learning_then_replace(*, check: bool) -> bool:
        ended = finish_learning(check=check)
        if threading.current_thread() is threading.main_thread():  # X: Y replaces E1 and clears
            monkeypatch.setattr(state, "finish_learning", finish_learning)
            y_thread.start()
            assert y_cleared.wait(10)
        return ended

    def clear_then_signal() -> None:
        clear()
        if threading.current_thread() is not threading.main_thread():  # Y: it goes on once X has kept its result
            y_cleared.set()
            assert x_kept.wait(10)

    monkeypatch.setattr(state, "finish_learning", finish_learning_then_replace)
    monkeypatch.setattr(cache, "clear", clear_then_signal)

    pipeline.encode_prompt(ids.clone(), mask.clone())  # X
    assert y_cleared.is_set(), "the race did not happen"
    x_kept.set()
    y_thread.join(60)  # Y ends once its encode is served; the bound only keeps a hang from blocking the suite
    assert torch.equal(y_served[0][0], expected[0])
    served = pipeline.encode_prompt(ids.clone(), mask.clone())
    assert torch.equal(served[0], expected[0]), "served the embedding of the encoder that was replaced"


class ScaledRows(QwenStyleTokenPipeline):
    """Qwen-Image's token-id encode (as ``QwenStyleTokenPipeline``) scaled by ``self.scale``, pipeline data its
    rows' keys come to hold once an encode has read it (their first rows are moved to the grown keys)."""

    def __init__(self, text_encoder: torch.nn.Module) -> None:
        super().__init__(text_encoder)
        self.scale = 0.5

    def encode_prompt(
        self,
        prompt_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        num_images_per_prompt: int = 1,
        max_sequence_length: int = 1024,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask = super().encode_prompt(prompt_ids, attention_mask, num_images_per_prompt, max_sequence_length)
        return embeds * self.scale, mask


def test_rows_moved_to_their_grown_keys_after_a_clear_are_not_kept(monkeypatch) -> None:
    """Call X encodes two rows with encoder E1; their encodes read ``self.scale``, so they are moved to keys that
    hold it. Before X moves them, E1 is replaced by E2 and call Y sees it and drops every entry. X's rows were
    made with E1: moved after the clear, a later call of one of them would be served E1's embedding (the same
    token ids reach E2, so its proof passes). Made to happen: X's move waits until Y has run to its end."""
    import threading

    pipeline = ScaledRows(build_qwen2_encoder(seed=0))
    install_prompt_embed_cache(pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    e2 = build_qwen2_encoder(seed=2)
    first = torch.randint(1, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    second = torch.randint(1, 100, (1, 16), generator=torch.Generator().manual_seed(1))
    batch = torch.cat([first, second])
    keep_rows = RowCalls.keep_rows
    raced: list[bool] = []

    def y() -> None:  # Y: the replacement, seen by a call of the first row alone
        pipeline.text_encoder = e2
        pipeline.encode_prompt(first.clone(), first != 0)

    def replace_then_keep_rows(*args, **kwargs) -> None:
        if not raced:
            raced.append(True)
            thread = threading.Thread(target=y)
            thread.start()
            thread.join(30)
        keep_rows(*args, **kwargs)

    monkeypatch.setattr(RowCalls, "keep_rows", replace_then_keep_rows)
    pipeline.encode_prompt(batch.clone(), batch != 0)  # X
    assert raced, "the race did not happen: X's rows were not moved"

    expected = ScaledRows(e2).encode_prompt(second, second != 0)
    served = pipeline.encode_prompt(second.clone(), second != 0)
    assert torch.equal(served[0], expected[0]), "served the row the replaced encoder made"
