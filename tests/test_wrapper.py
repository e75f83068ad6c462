"""How encode_prompt is intercepted, on a real (tiny, random-weight) transformers text encoder."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch

from vllm_omni_prompt_cache import (
    PromptEmbedCache,
    install_prompt_embed_cache,
    uninstall_prompt_embed_cache,
)
from vllm_omni_prompt_cache.calls.method_calls import DISABLED_REASON
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.settings.schema import PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.store.prompt_embed_cache import COLLISION_REASON
from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns
from vllm_omni_prompt_cache.tiny.text_encoder import QwenStyleTokenPipeline, TokenIdTextPipeline, build_qwen2_encoder

PROMPTS = 8
GROUP_SIZE = 16
LENGTH = 24


@pytest.fixture
def encoder() -> torch.nn.Module:
    """A fresh encoder per test: an installed cache intercepts its encoder module's calls, whoever makes them."""
    return build_qwen2_encoder()


@pytest.fixture
def reference_encoder() -> torch.nn.Module:
    """The same weights as ``encoder`` in another module, which no cache intercepts: uncached references."""
    return build_qwen2_encoder()


@pytest.fixture
def pipeline(encoder) -> TokenIdTextPipeline:
    return TokenIdTextPipeline(encoder)


def prompt_token_ids(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1024) for _ in range(rng.randrange(8, LENGTH))] for _ in range(count)]


def collate(token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh right-padded int64 ids tensor and bool mask, as verl-omni's adapter builds them."""
    ids = torch.zeros(1, LENGTH, dtype=torch.int64)
    ids[0, : len(token_ids)] = torch.tensor(token_ids)
    return ids, ids != 0


def test_install_is_idempotent_and_uninstall_restores(pipeline) -> None:
    cache = install_prompt_embed_cache(pipeline, max_size=4)
    assert isinstance(cache, PromptEmbedCache)
    assert install_prompt_embed_cache(pipeline, max_size=99) is cache
    assert pipeline._prompt_embed_cache is cache
    assert pipeline._prompt_embed_cache_original_fn.__func__ is TokenIdTextPipeline.encode_prompt
    uninstall_prompt_embed_cache(pipeline)
    assert pipeline.encode_prompt.__func__ is TokenIdTextPipeline.encode_prompt
    assert not hasattr(pipeline, "_prompt_embed_cache")
    uninstall_prompt_embed_cache(pipeline)  # a second uninstall is harmless


def test_the_cache_keeps_one_state_object_on_the_pipeline_beside_upstreams_two_attributes(pipeline) -> None:
    before = set(vars(pipeline))
    cache = install_prompt_embed_cache(pipeline, max_size=4)
    added = set(vars(pipeline)) - before - {"encode_prompt"}
    assert added == {"_prompt_embed_cache", "_prompt_embed_cache_original_fn", "_prompt_embed_cache_installation"}
    installation = pipeline._prompt_embed_cache_installation
    assert installation.cache is cache and list(installation.methods) == ["encode_prompt"]
    assert installation.originals["encode_prompt"] is pipeline._prompt_embed_cache_original_fn
    uninstall_prompt_embed_cache(pipeline)
    assert set(vars(pipeline)) == before


def test_install_returns_none_without_a_callable_encode_prompt() -> None:
    class NoEncoder:
        encode_prompt = None

    assert install_prompt_embed_cache(object()) is None
    assert install_prompt_embed_cache(NoEncoder()) is None


def test_an_unreadable_signature_leaves_encode_prompt_alone(caplog) -> None:
    """A C-extension encode function has no signature to key by: said once, nothing wrapped."""

    class CompiledEncoder:
        encode_prompt = staticmethod(next)  # a builtin: inspect.signature raises ValueError

    pipeline = CompiledEncoder()
    with caplog.at_level(logging.WARNING, logger="vllm_omni_prompt_cache"):
        assert install_prompt_embed_cache(pipeline) is None
    (warning,) = [r.getMessage() for r in caplog.records if r.name.startswith("vllm_omni_prompt_cache")]
    assert warning.startswith("Prompt-embed cache: cannot read the signature of CompiledEncoder.encode_prompt (")
    assert warning.endswith("); not wrapped.")
    assert pipeline.encode_prompt is next and not hasattr(pipeline, "_prompt_embed_cache")
    assert pipeline.encode_prompt(iter([7])) == 7


def test_a_row_layout_setting_is_refused_by_name_and_a_layout_attribute_changes_nothing(
    encoder, reference_encoder
) -> None:
    """Row layouts were removed: a batched call's rows are cut where they reach the text encoder. The setting
    given in code is refused naming it; a pipeline class that still declares a layout is served as any other."""
    with pytest.raises(PromptEmbedCacheConfigError, match="row_layout"):
        PromptEmbedCacheSettings(row_layout="token-ids")

    class StillDeclared(QwenStyleTokenPipeline):
        prompt_embed_row_layout = "token-ids"

    reference = QwenStyleTokenPipeline(reference_encoder)
    pipeline = StillDeclared(encoder)
    cache = install_prompt_embed_cache(pipeline)
    first, second = prompt_token_ids(2, seed=4)
    for rows in ([first, second], [first], [first, second]):
        served = pipeline.encode_prompt(*collate_rows(rows))
        expected = reference.encode_prompt(*collate_rows(rows))
        assert all(torch.equal(got, want) for got, want in zip(served, expected, strict=True))
    runs = pipeline.encoder_runs
    pipeline.encode_prompt(*collate_rows([first, second]))  # every row found: the encoder is not reached
    assert pipeline.encoder_runs == runs and cache.stats()["hits"] >= 2


def collate_rows(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(rows), LENGTH, dtype=torch.int64)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(row)
    return ids, ids != 0


def run_rollout(pipeline, token_ids, negative_ids=None):
    """Every sibling request collates fresh tensors and calls encode_prompt, like an RL adapter."""
    outputs = []
    for _ in range(GROUP_SIZE):
        for ids_list in token_ids:
            ids, mask = collate(ids_list)
            outputs.append((ids_list, pipeline.encode_prompt(ids, mask, num_images_per_prompt=1)))
            if negative_ids is not None:
                negative, negative_mask = collate(negative_ids)
                pipeline.encode_prompt(negative, negative_mask, num_images_per_prompt=1)
    return outputs


def test_rl_rollout_encodes_each_prompt_once_and_matches_uncached(encoder, reference_encoder) -> None:
    token_ids = prompt_token_ids(PROMPTS)
    reference = TokenIdTextPipeline(reference_encoder)
    cached = TokenIdTextPipeline(encoder)
    cache = install_prompt_embed_cache(cached, max_size=64)

    outputs = run_rollout(cached, token_ids)

    assert cached.encoder_runs == PROMPTS
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["bypassed"]) == (PROMPTS * GROUP_SIZE - PROMPTS, PROMPTS, 0)
    for ids_list, (embeds, mask) in outputs:
        expected_embeds, expected_mask = reference.encode_prompt(*collate(ids_list))
        assert torch.equal(embeds, expected_embeds)  # bit-identical
        assert torch.equal(mask, expected_mask)


def test_rl_rollout_with_a_shared_negative_prompt(pipeline) -> None:
    cache = install_prompt_embed_cache(pipeline, max_size=64)
    run_rollout(pipeline, prompt_token_ids(PROMPTS), negative_ids=[7, 7, 7])
    calls = 2 * PROMPTS * GROUP_SIZE
    assert pipeline.encoder_runs == PROMPTS + 1
    assert cache.stats()["hits"] == calls - PROMPTS - 1


def test_stock_style_list_calls_still_hit(pipeline) -> None:
    """Calls that upstream already cached (lists of ints) keep hitting, now keyed by content too."""

    def by_list(p, ids_list):
        return p.encode_prompt(torch.tensor([ids_list]))

    cache = install_prompt_embed_cache(pipeline)
    by_list(pipeline, [1, 2, 3])
    by_list(pipeline, [1, 2, 3])
    assert cache.stats()["hits"] == 1


class HandsInputsToEncoder(CountsEncoderRuns, torch.nn.Module):
    """Passes its ids and mask to its text encoder untouched (the stand-in cuda tensors below cannot run tensor
    ops without a GPU; ``tests/test_cuda.py`` runs a real pipeline on one). ``encoder_runs`` counts the
    encoder's forward runs (a hook on it), not the method's."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.count_encoder_calls(encoder)

    @torch.inference_mode()
    def encode_prompt(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.text_encoder(input_ids=prompt_ids, attention_mask=attention_mask).last_hidden_state


def test_a_call_from_another_device_keys_as_the_cpu_callers_call(encoder, accept_device_reporting_tensors) -> None:
    """The same ids and mask reported on cuda:0 key as what a CPU caller's encoder call stored: the device is not
    in the key of what reaches the text encoder. (Serving it places the entry on the caller's device, which takes a
    real GPU: ``tests/test_cuda.py``.)"""
    from device_reporting import ReportsCudaDevice

    from vllm_omni_prompt_cache.keys.call_key import value_key

    pipeline = HandsInputsToEncoder(encoder)
    cache = install_prompt_embed_cache(pipeline)
    seen: list[tuple] = []
    encoder.register_forward_pre_hook(lambda module, args, kwargs: seen.append((args, kwargs)), with_kwargs=True)
    ids, mask = collate([4, 5, 6])
    pipeline.encode_prompt(ids, mask.long())
    assert (pipeline.encoder_runs, cache.stats()["misses"]) == (1, 1)
    ((args, kwargs),) = seen
    on_cpu = value_key((args, kwargs))
    on_cuda = value_key((args, {name: ReportsCudaDevice(value.clone()) for name, value in kwargs.items()}))
    assert ReportsCudaDevice(ids).device.type == "cuda"
    assert on_cuda[0] == on_cpu[0]  # the identity
    assert [bytes(part) for part in on_cuda[1]] == [bytes(part) for part in on_cpu[1]]  # the bytes a hit compares


def test_disabled_cache_counts_bypasses_and_never_stores(pipeline) -> None:
    cache = install_prompt_embed_cache(pipeline, enabled=False)
    for _ in range(3):
        pipeline.encode_prompt(*collate([1, 2]))
    assert pipeline.encoder_runs == 3
    assert cache.stats()["bypass_reasons"] == {DISABLED_REASON: 3}


def test_unkeyable_argument_bypasses_with_its_reason(pipeline) -> None:
    class TracedMask(torch.Tensor):
        """A tensor subclass such as a tracing or distributed wrapper: not read exactly."""

    cache = install_prompt_embed_cache(pipeline)
    ids, mask = collate([1, 2])
    pipeline.encode_prompt(ids, mask.as_subclass(TracedMask))
    (reason,) = cache.stats()["bypass_reasons"]  # keyed where it reaches the text encoder: its mask
    assert reason.startswith("text encoder input: tensor subclass")
    assert pipeline.encoder_runs == 1


def _wrong_embeddings(pipeline: TokenIdTextPipeline, reference: TokenIdTextPipeline) -> int:
    """Encode 20 prompts three times; return how many results differ from the uncached reference's."""
    wrong = 0
    for _ in range(3):
        for ids_list in prompt_token_ids(20, seed=3):
            embeds, mask = pipeline.encode_prompt(*collate(ids_list))
            expected, expected_mask = reference.encode_prompt(*collate(ids_list))
            wrong += not (torch.equal(embeds, expected) and torch.equal(mask, expected_mask))
    return wrong


def test_forced_digest_collisions_never_return_a_wrong_embedding(encoder, reference_encoder) -> None:
    pipeline = TokenIdTextPipeline(encoder)
    # Every tensor digests to the same 16 bytes: all ids collide on identity.
    cache = install_prompt_embed_cache(
        pipeline, max_size=64, settings=PromptEmbedCacheSettings(digest=lambda buffer: bytes(16))
    )
    assert _wrong_embeddings(pipeline, TokenIdTextPipeline(reference_encoder)) == 0
    stats = cache.stats()
    assert stats["bypass_reasons"].get(COLLISION_REASON, 0) > 0
    assert stats["hits"] + stats["misses"] + stats["bypassed"] == 60


def test_forced_collisions_of_encoder_keys_never_return_a_wrong_embedding(
    encoder, reference_encoder, monkeypatch
) -> None:
    """Every tensor of what reaches the text encoder digests to the same 16 bytes: every encoder call's key
    collides on identity; the bytes compared on a hit keep each call's own embedding."""
    from vllm_omni_prompt_cache.keys import call_key

    monkeypatch.setattr(call_key, "default_digest", lambda buffer: bytes(16))
    pipeline = TokenIdTextPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=64)
    assert _wrong_embeddings(pipeline, TokenIdTextPipeline(reference_encoder)) == 0
    stats = cache.stats()
    assert stats["bypass_reasons"].get(COLLISION_REASON, 0) > 0
    assert stats["hits"] + stats["misses"] + stats["bypassed"] == 60


def test_concurrent_threads_get_correct_results_and_stats_add_up(encoder, reference_encoder) -> None:
    reference = TokenIdTextPipeline(reference_encoder)
    pipeline = TokenIdTextPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=3)  # smaller than the key set: evictions too
    token_ids = prompt_token_ids(5, seed=11)
    expected = {tuple(ids): reference.encode_prompt(*collate(ids))[0] for ids in token_ids}
    calls_per_thread = 40
    wrong = []
    barrier = threading.Barrier(8)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        barrier.wait()
        for _ in range(calls_per_thread):
            ids = rng.choice(token_ids)
            embeds, _ = pipeline.encode_prompt(*collate(ids))
            if not torch.equal(embeds, expected[tuple(ids)]):
                wrong.append(ids)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    stats = cache.stats()
    assert wrong == []
    assert stats["hits"] + stats["misses"] + stats["bypassed"] == 8 * calls_per_thread
    assert stats["bypassed"] == 0
    assert pipeline.encoder_runs == stats["misses"]  # no call encoded without being counted
    assert stats["size"] <= 3


class GatedPipeline(TokenIdTextPipeline):
    """Its text encoder waits for ``release`` (a hook on the encoder's forward: the encode method itself runs on
    every call), so concurrent callers are sure to overlap one encode."""

    def __init__(self, text_encoder: torch.nn.Module) -> None:
        super().__init__(text_encoder)
        self.started = threading.Event()
        self.release = threading.Event()
        text_encoder.register_forward_pre_hook(self._gate)

    def _gate(self, module: torch.nn.Module, args: tuple) -> None:
        self.started.set()
        if not self.release.wait(10):
            raise TimeoutError("the test never released the encoder")


def test_concurrent_identical_calls_share_one_encode_through_the_wrapper(encoder, reference_encoder) -> None:
    """Single-flight seen from encode_prompt: callers whose encoder call arrives during an encode wait for it."""
    reference = TokenIdTextPipeline(reference_encoder).encode_prompt(*collate([9, 8, 7]))[0]
    pipeline = GatedPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline)
    results: list[torch.Tensor] = []

    def call() -> None:
        results.append(pipeline.encode_prompt(*collate([9, 8, 7]))[0])

    threads = [threading.Thread(target=call) for _ in range(6)]
    threads[0].start()
    try:
        assert pipeline.started.wait(10)
        for thread in threads[1:]:
            thread.start()
        deadline = time.monotonic() + 10
        while cache.flights.waiters() < 5:  # one flight: the first caller's
            assert time.monotonic() < deadline, "the later callers never waited on the first one's encode"
            time.sleep(0.001)
    finally:
        pipeline.release.set()
        for thread in threads:
            thread.join(20)
    assert pipeline.encoder_runs == 1
    assert len(results) == 6 and all(torch.equal(result, reference) for result in results)
    assert (cache.stats()["hits"], cache.stats()["misses"]) == (5, 1)


def test_byte_budget_holds_through_the_wrapper(pipeline) -> None:
    ids, mask = collate([1, 2, 3])
    embeds, out_mask = pipeline.encode_prompt(ids, mask)
    per_entry = embeds.untyped_storage().nbytes() + out_mask.untyped_storage().nbytes() + ids.numel() * 8 + mask.numel()
    pipeline = TokenIdTextPipeline(pipeline.text_encoder)
    cache = install_prompt_embed_cache(
        pipeline,
        max_size=100,
        settings=PromptEmbedCacheSettings(max_bytes=2 * per_entry + per_entry // 2),
    )
    for ids_list in prompt_token_ids(6, seed=5):
        pipeline.encode_prompt(*collate(ids_list))
        assert cache.stats()["bytes"] <= cache.max_bytes
    assert cache.stats()["size"] == 2


class RequestInfoPipeline(TokenIdTextPipeline):
    """A pipeline whose encode_prompt also takes a free-form argument it does not read for encoding."""

    def encode_prompt(self, prompt_ids, attention_mask=None, num_images_per_prompt=1, request_info=None):
        return super().encode_prompt(prompt_ids, attention_mask, num_images_per_prompt)


def test_hostile_arguments_the_encoder_never_sees_do_not_matter(encoder, reference_encoder) -> None:
    """Arguments that never reach the text encoder (request metadata that points back at itself, or nests deep)
    are not keyed: the encoder's calls are, and are served."""
    reference = RequestInfoPipeline(reference_encoder)
    pipeline = RequestInfoPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline)
    loop = {"trace": []}
    loop["trace"].append(loop)  # e.g. request metadata that points back at itself
    deep = []
    for _ in range(5_000):
        deep = [deep]
    ids, mask = collate([3, 1, 4, 1, 5])
    for info in (loop, deep):
        cached = pipeline.encode_prompt(ids, mask, request_info=info)
        uncached = reference.encode_prompt(ids, mask, request_info=info)
        assert all(torch.equal(got, want) for got, want in zip(cached, uncached, strict=True))
    stats = cache.stats()
    assert stats["bypass_reasons"] == {}
    assert (stats["hits"], stats["misses"], stats["bypassed"]) == (1, 1, 0)
    assert pipeline.encoder_runs == 1


class MaskHandedBack(CountsEncoderRuns):
    """Returns the attention mask it was given (the caller's tensor), as some encodes do. ``encoder_runs``
    counts the encoder's forward runs (a hook on it), not the method's."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        self.encoder = encoder
        self.count_encoder_calls(encoder)

    @torch.inference_mode()
    def encode_prompt(self, tokens, token_mask):
        hidden = self.encoder(input_ids=tokens, attention_mask=token_mask.long()).last_hidden_state
        return hidden, token_mask


def test_an_output_that_is_the_callers_input_is_kept_as_a_copy(encoder) -> None:
    pipeline = MaskHandedBack(encoder)
    cache = install_prompt_embed_cache(pipeline)
    ids, mask = collate_rows(prompt_token_ids(2))
    expected_embeds, expected_mask = (tensor.clone() for tensor in pipeline.encode_prompt(ids, mask))
    runs = pipeline.encoder_runs  # the first batched call also encoded its rows alone, to compare
    mask.fill_(True)  # the adapter reuses its buffer for the next batch
    embeds, cached_mask = pipeline.encode_prompt(ids.clone(), expected_mask.clone())
    assert pipeline.encoder_runs == runs and cache.stats()["hits"] == 1
    assert torch.equal(cached_mask, expected_mask) and torch.equal(embeds, expected_embeds)
