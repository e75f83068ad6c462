"""A text encoder replaced on the pipeline after install (``pipeline.text_encoder = new``).

An encoder call's key holds the encoder's path on the pipeline, its mode and dtype and its inputs, not its weights:
the entries were made with the old encoder, and the same token ids reaching the new one would find them. So a
replacement re-hooks the new encoder and drops every entry; the call that sees it encodes (a miss), and the calls
after are served what the new encoder computes. An encode of the old encoder still running when the entries are
dropped must not be kept after the drop, as a whole call or as the rows of a batched call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.tiny.text_encoder import QwenStyleTokenPipeline, TokenIdTextPipeline, build_qwen2_encoder

#: How long a thread of a race waits for the other before the test fails instead of hanging.
WAIT_S = 30


def _ids(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 100, (1, 16), generator=torch.Generator().manual_seed(seed))
    return ids, ids != 0


def _uncached(encoder: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return TokenIdTextPipeline(encoder).encode_prompt(ids, mask)


def _counts(pipeline: TokenIdTextPipeline) -> tuple[int, int, int]:
    """Real runs of the pipeline's encoders' forwards (hooks on each), the cache's hits and misses."""
    stats = pipeline._prompt_embed_cache.stats()
    return pipeline.encoder_runs, stats["hits"], stats["misses"]


def _replace(pipeline: TokenIdTextPipeline, replacement: torch.nn.Module) -> None:
    pipeline.count_encoder_calls(replacement)  # its runs are counted with the old one's
    pipeline.text_encoder = replacement


def _replace_encoder_after_hits(pipeline: TokenIdTextPipeline) -> tuple[torch.Tensor, torch.Tensor]:
    """Serve one prompt three times (a miss, two hits), then put another encoder (weights from seed 1) in its
    place; return the prompt."""
    ids, mask = _ids()
    for _ in range(3):
        pipeline.encode_prompt(ids.clone(), mask.clone())
    assert _counts(pipeline) == (1, 2, 1)
    _replace(pipeline, build_qwen2_encoder(seed=1))
    return ids, mask


def test_a_replaced_text_encoder_is_never_served_the_old_encoders_embedding(caplog) -> None:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder(seed=0))
    old = _uncached(build_qwen2_encoder(seed=0), *_ids())
    install_prompt_embed_cache(pipeline, max_size=8)
    ids, mask = _replace_encoder_after_hits(pipeline)
    expected = _uncached(build_qwen2_encoder(seed=1), ids, mask)  # a twin: the replacement's own runs are counted
    assert not torch.equal(expected[0], old[0]), "the two encoders must differ for this test to mean anything"

    with caplog.at_level(logging.INFO, logger="vllm_omni_prompt_cache"):
        first = pipeline.encode_prompt(ids.clone(), mask.clone())
    assert torch.equal(first[0], expected[0])
    assert _counts(pipeline) == (2, 2, 2), "the call that saw the replacement encodes and is counted a miss"
    assert "TokenIdTextPipeline.text_encoder: it was replaced" in caplog.text
    assert pipeline._prompt_embed_cache_installation.encoders == ["text_encoder"]

    # Re-hooked: the calls after are hits of what the new encoder computed.
    for _ in range(3):
        served = pipeline.encode_prompt(ids.clone(), mask.clone())
        assert torch.equal(served[0], expected[0])
    assert _counts(pipeline) == (2, 5, 2)


def test_the_directory_tier_files_the_new_encoders_entry_under_its_own_weights(tmp_path) -> None:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder(seed=0))
    install_prompt_embed_cache(pipeline, max_size=8, settings=PromptEmbedCacheSettings(directory=tmp_path))
    ids, mask = _replace_encoder_after_hits(pipeline)
    expected = _uncached(build_qwen2_encoder(seed=1), ids, mask)  # a twin: the replacement's own runs are counted

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
    pipeline.text_encoder = pipeline.text_encoder  # the same object: nothing to drop

    pipeline.encode_prompt(ids.clone(), mask.clone())

    assert _counts(pipeline) == (1, 1, 1)


def _when_it_runs(module: torch.nn.Module, forward: int, then: Callable[[], None]) -> None:
    """Call ``then()`` once, at the end of ``module``'s ``forward``-th forward (1: its first)."""
    runs = [0]

    def hook(*_: object) -> None:
        runs[0] += 1
        if runs[0] == forward:
            then()

    module.register_forward_hook(hook)


def test_an_encode_of_the_replaced_encoder_that_ends_after_the_clear_is_not_kept(monkeypatch) -> None:
    """Two threads, the replacement between them: call X's encoder call runs E1; before its result is kept, E1
    is replaced by E2 and call Y sees it and drops every entry. X's result was made with E1 under the key E2's
    call of the same ids has: kept after the drop, Y and the calls after would be served it. Made to happen: X
    waits, inside E1's forward, until Y has dropped the entries, and Y waits there until X has returned."""
    pipeline = TokenIdTextPipeline(build_qwen2_encoder(seed=0))
    install_prompt_embed_cache(pipeline, max_size=8)
    ids, mask = _ids()
    pipeline.encode_prompt(ids.clone(), mask.clone())
    e1, e2 = build_qwen2_encoder(seed=1), build_qwen2_encoder(seed=2)
    _replace(pipeline, e1)  # the next call (X) sees E1, drops the entries, and encodes with it
    expected = _uncached(build_qwen2_encoder(seed=2), ids, mask)  # a twin of E2: E2's own calls will be served
    assert not torch.equal(expected[0], _uncached(build_qwen2_encoder(seed=1), ids, mask)[0])

    cache = pipeline._prompt_embed_cache
    clear = cache.clear
    y_cleared, x_returned = threading.Event(), threading.Event()
    y_served: list = []

    def y() -> None:
        _replace(pipeline, e2)
        y_served.append(pipeline.encode_prompt(ids.clone(), mask.clone()))

    y_thread = threading.Thread(target=y, daemon=True)

    def clear_then_wait() -> None:
        clear()
        if threading.current_thread() is y_thread:  # Y: it goes on once X has returned
            y_cleared.set()
            assert x_returned.wait(WAIT_S)

    def start_y_and_wait() -> None:  # X, inside E1's forward: its result is not kept yet
        y_thread.start()
        assert y_cleared.wait(WAIT_S), "Y never dropped the entries"

    monkeypatch.setattr(cache, "clear", clear_then_wait)
    _when_it_runs(e1, 1, start_y_and_wait)

    pipeline.encode_prompt(ids.clone(), mask.clone())  # X
    assert y_cleared.is_set(), "the race did not happen"
    x_returned.set()
    y_thread.join(WAIT_S)
    assert not y_thread.is_alive(), "Y hung"
    assert torch.equal(y_served[0][0], expected[0]), "Y was served the embedding of the encoder that was replaced"
    served = pipeline.encode_prompt(ids.clone(), mask.clone())
    assert torch.equal(served[0], expected[0]), "served the embedding of the encoder that was replaced"


def test_rows_of_the_replaced_encoder_kept_after_the_clear_are_not_served(monkeypatch) -> None:
    """Call X is E1's first batched call (two rows): served uncached, each row encoded alone to check that rows
    are independent, then kept as row entries. Before X keeps them, E1 is replaced by E2 and call Y sees it and
    drops every entry. X's rows were made with E1 under the keys E2's rows of the same ids have: kept after the
    drop, a later batch holding one of them would be served E1's row. Made to happen: at the end of E1's last
    forward in X, Y runs to its end."""
    e1, e2 = build_qwen2_encoder(seed=1), build_qwen2_encoder(seed=2)
    pipeline = QwenStyleTokenPipeline(e1)
    install_prompt_embed_cache(pipeline, max_size=16)
    first, second, third = (_ids(seed)[0] for seed in (0, 1, 2))
    raced: list[bool] = []

    def y() -> None:  # Y: the replacement, seen by a call of the first row alone
        _replace(pipeline, e2)
        pipeline.encode_prompt(first.clone(), first != 0)
        raced.append(True)

    def run_y() -> None:
        thread = threading.Thread(target=y, daemon=True)
        thread.start()
        thread.join(WAIT_S)
        assert not thread.is_alive(), "Y hung"

    _when_it_runs(e1, 3, run_y)  # the batch, then each of its two rows alone: the third is the last
    batch = torch.cat([first, second])
    x = pipeline.encode_prompt(batch.clone(), batch != 0)  # X
    assert raced, "the race did not happen"
    # The references run twins of E1 and E2 (same seeds): E2's own calls are served by the cache.
    assert torch.equal(x[0], QwenStyleTokenPipeline(build_qwen2_encoder(seed=1)).encode_prompt(batch, batch != 0)[0])

    later = torch.cat([third, second])
    expected = QwenStyleTokenPipeline(build_qwen2_encoder(seed=2)).encode_prompt(later, later != 0)
    served = pipeline.encode_prompt(later.clone(), later != 0)
    assert torch.equal(served[0][1], expected[0][1]), "served the row the replaced encoder made"
    assert torch.equal(served[0], expected[0])
