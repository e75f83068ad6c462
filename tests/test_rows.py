"""Row-level caching of batched encode_prompt calls, on real (tiny, random-weight) transformers encoders.

Exactness is stated as in docs/design.md: an assembled output is bit-identical to encoding each
row alone and laying the rows out as the uncached call does; against one uncached call on the
whole batch it differs only as much as the encoder's kernels are not batch-invariant.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import pytest
import torch

from vllm_omni_prompt_cache import RowLayout, RowOutput, install_prompt_embed_cache
from vllm_omni_prompt_cache.calls.found import LAYOUT_DROPPED_REASON, UNSTACKABLE_REASON
from vllm_omni_prompt_cache.calls.layouts import QWEN_IMAGE_TEXT, TOKEN_IDS
from vllm_omni_prompt_cache.rows.layout import LayoutMismatch
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.store.prompt_embed_cache import COLLISION_REASON
from vllm_omni_prompt_cache.tiny.text_encoder import QwenStyleTokenPipeline, TokenIdTextPipeline, build_qwen2_encoder

WIDTH = 24


@pytest.fixture(scope="module")
def encoder() -> torch.nn.Module:
    return build_qwen2_encoder()


def token_rows(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, WIDTH - 4, (count,), generator=generator).tolist()
    return [torch.randint(1, 1000, (length,), generator=generator).tolist() for length in lengths]


def collate(rows: list[list[int]], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh right-padded int64 ids and a bool mask, as an RL adapter collates a request batch."""
    width = width or max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(row)
    return ids, ids != 0


def rows_alone(pipeline, rows: list[list[int]], copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: each row encoded alone (a batch of one), padded and laid out as one call would."""
    alone = [pipeline.encode_prompt(*collate([row]), num_images_per_prompt=1) for row in rows]
    longest = max(embeds.shape[1] for embeds, _ in alone)
    embeds = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[1])) for e, _ in alone])
    masks = torch.cat([torch.nn.functional.pad(m, (0, longest - m.shape[1])) for _, m in alone])
    return embeds.repeat_interleave(copies, dim=0), masks.repeat_interleave(copies, dim=0)


class SiblingsBatch:
    """P prompts x K siblings collated into one call, the way max_num_seqs batches requests."""

    def __init__(self, prompts: int, siblings: int, seed: int = 0) -> None:
        self.distinct = token_rows(prompts, seed)
        self.rows = [self.distinct[i % prompts] for i in range(prompts * siblings)]


def test_siblings_in_one_call_encode_each_distinct_row_once_alone(encoder) -> None:
    pipeline = QwenStyleTokenPipeline(encoder)
    reference = QwenStyleTokenPipeline(encoder)
    batch = SiblingsBatch(prompts=3, siblings=4)
    cache = install_prompt_embed_cache(pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    embeds, mask = pipeline.encode_prompt(*collate(batch.rows))
    assert (pipeline.encoder_runs, pipeline.encoder_rows) == (3, 3)  # three runs of one row each
    expected_embeds, expected_mask = rows_alone(reference, batch.rows, copies=1)
    assert torch.equal(embeds, expected_embeds) and torch.equal(mask, expected_mask)
    full_embeds, full_mask = reference.encode_prompt(*collate(batch.rows))
    assert embeds.shape == full_embeds.shape and torch.equal(mask, full_mask)
    # The batch-invariance gap of this encoder on this CPU, reported (docs/benchmarks.md quotes it).
    gap = (embeds - full_embeds).abs().max().item()
    print(f"max |assembled - uncached full batch| = {gap:.3g}")
    assert gap < 1e-4
    stats = cache.snapshot()
    assert (stats.row_misses, stats.row_hits, stats.rows_encoded, stats.size) == (3, 9, 3, 3)
    assert (stats.misses, stats.hits) == (1, 0)


def test_trailing_padding_is_not_part_of_a_row(encoder) -> None:
    """The same prompt padded to two batch widths is one row: the second batch only hits."""
    pipeline = QwenStyleTokenPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    rows = token_rows(4, seed=1)
    pipeline.encode_prompt(*collate(rows[:2], width=WIDTH))
    runs = pipeline.encoder_runs
    embeds, mask = pipeline.encode_prompt(*collate([rows[1], rows[0], rows[1]], width=WIDTH + 9))
    assert pipeline.encoder_runs == runs
    expected = rows_alone(QwenStyleTokenPipeline(encoder), [rows[1], rows[0], rows[1]], copies=1)
    assert torch.equal(embeds, expected[0]) and torch.equal(mask, expected[1])
    assert cache.snapshot().hits == 1


def test_masked_positions_inside_a_row_stay_in_its_key(encoder) -> None:
    """Only trailing masked columns are dropped: a hole in the mask makes a different row."""
    pipeline = QwenStyleTokenPipeline(encoder)
    install_prompt_embed_cache(pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    ids, mask = collate(token_rows(1, seed=2))
    holed = mask.clone()
    holed[0, 2] = False
    pipeline.encode_prompt(ids, mask)
    pipeline.encode_prompt(ids, holed)
    assert pipeline.encoder_runs == 2


def test_copies_are_laid_out_as_the_uncached_call_does(encoder) -> None:
    pipeline = QwenStyleTokenPipeline(encoder)
    install_prompt_embed_cache(pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    rows = token_rows(1, seed=3)
    embeds, mask = pipeline.encode_prompt(*collate(rows), num_images_per_prompt=3)
    expected = QwenStyleTokenPipeline(encoder).encode_prompt(*collate(rows), num_images_per_prompt=3)
    assert torch.equal(embeds, expected[0]) and torch.equal(mask, expected[1])


def test_undeclared_copy_order_keys_a_multi_row_multi_copy_call_whole(encoder) -> None:
    pipeline = QwenStyleTokenPipeline(encoder)
    unordered = dataclasses.replace(TOKEN_IDS, outputs=(RowOutput(pad_dim=1), RowOutput(pad_dim=1)))
    cache = install_prompt_embed_cache(pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=unordered))
    ids, mask = collate(token_rows(2, seed=4))
    first = pipeline.encode_prompt(ids, mask, num_images_per_prompt=2)
    second = pipeline.encode_prompt(ids.clone(), mask.clone(), num_images_per_prompt=2)
    assert pipeline.encoder_runs == 1 and torch.equal(first[0], second[0])
    stats = cache.snapshot()
    ((reason, count),) = stats.whole_call_reasons.items()
    assert count == 2 and "copy order is not declared" in reason
    assert stats.rows_encoded == 2  # the whole call's two rows reached the encoder once


class TextPipeline(torch.nn.Module):
    """Stock QwenImagePipeline.encode_prompt's exact layout code over a real encoder, text in.

    Its embeddings keep each prompt's copies together (``repeat`` on the sequence dimension, then
    ``view``); its mask tiles the batch (``repeat(1, n, 1)`` on a 2-D tensor).
    """

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.inner = QwenStyleTokenPipeline(encoder)

    def encode_prompt(self, prompt, num_images_per_prompt=1, prompt_embeds=None, max_sequence_length=1024):
        prompt = [prompt] if isinstance(prompt, str) else prompt
        ids = [[ord(character) for character in text] for text in prompt]
        prompt_embeds, prompt_embeds_mask = self.inner.encode_prompt(*collate(ids))
        prompt_embeds = prompt_embeds[:, :max_sequence_length]
        prompt_embeds_mask = prompt_embeds_mask[:, :max_sequence_length]
        batch_size, seq_len, _ = prompt_embeds.shape
        prompt_embeds = prompt_embeds.repeat(1, num_images_per_prompt, 1)
        prompt_embeds = prompt_embeds.view(batch_size * num_images_per_prompt, seq_len, -1)
        prompt_embeds_mask = prompt_embeds_mask.repeat(1, num_images_per_prompt, 1)
        prompt_embeds_mask = prompt_embeds_mask.view(batch_size * num_images_per_prompt, seq_len)
        return prompt_embeds, prompt_embeds_mask


@pytest.mark.parametrize("copies", [1, 2, 3])
def test_text_rows_reproduce_stock_interleaved_embeds_and_tiled_mask(encoder, copies) -> None:
    pipeline = TextPipeline(encoder)
    cache = install_prompt_embed_cache(
        pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=QWEN_IMAGE_TEXT)
    )
    prompts = ["a red fox", "a much longer prompt about a cat", "a red fox", "sky"]
    embeds, mask = pipeline.encode_prompt(prompts, num_images_per_prompt=copies)
    reference = TextPipeline(encoder)
    alone = [reference.encode_prompt([text]) for text in prompts]
    longest = max(e.shape[1] for e, _ in alone)
    rows_embeds = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[1])) for e, _ in alone])
    rows_mask = torch.cat([torch.nn.functional.pad(m, (0, longest - m.shape[1])) for _, m in alone])
    assert torch.equal(embeds, rows_embeds.repeat_interleave(copies, dim=0))
    assert torch.equal(mask, rows_mask.repeat(copies, 1))
    full_embeds, full_mask = reference.encode_prompt(prompts, num_images_per_prompt=copies)
    assert torch.equal(mask, full_mask) and (embeds - full_embeds).abs().max().item() < 1e-4
    assert pipeline.inner.encoder_rows == 3
    assert cache.snapshot().row_hits == 1


def test_a_lone_string_and_a_one_element_list_share_a_row(encoder) -> None:
    pipeline = TextPipeline(encoder)
    install_prompt_embed_cache(pipeline, max_size=4, settings=PromptEmbedCacheSettings(row_layout=QWEN_IMAGE_TEXT))
    pipeline.encode_prompt("a red fox")
    pipeline.encode_prompt(["a red fox", "a red fox"])
    assert pipeline.inner.encoder_runs == 1


def test_forced_digest_collisions_return_no_wrong_row(encoder) -> None:
    """Every row digests alike: rows in one call and across calls must still stay apart."""
    pipeline = QwenStyleTokenPipeline(encoder)
    reference = QwenStyleTokenPipeline(encoder)
    cache = install_prompt_embed_cache(
        pipeline,
        max_size=16,
        settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS, digest=lambda _: b"same"),
    )
    rows = [row[:6] for row in token_rows(4, seed=5)]  # equal shapes: identities match, bytes differ
    for batch in ([rows[0], rows[1], rows[0], rows[2]], [rows[3], rows[1], rows[0]]):
        embeds, mask = pipeline.encode_prompt(*collate(batch))
        expected = rows_alone(reference, batch, copies=1)
        assert torch.equal(embeds, expected[0]) and torch.equal(mask, expected[1])
    stats = cache.snapshot()
    assert stats.row_bypass_reasons.get(COLLISION_REASON, 0) >= 3
    assert stats.row_hits >= 1  # the duplicate of rows[0] in the first call, verified byte for byte


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


def race(cache, first: tuple[str, list], second: tuple[str, list], run, release: threading.Event) -> None:
    """Run two batches on two threads: ``first`` claims its rows, then ``second`` starts and waits on
    one of them; only then is ``release`` set (the encoder of ``first`` holds on it)."""
    threads = [threading.Thread(target=run, name=name, args=(name, batch)) for name, batch in (first, second)]
    threads[0].start()
    wait_until(lambda: len(cache.flights), "the first batch has claimed its rows")
    threads[1].start()
    wait_until(lambda: cache.flights.waiters(), "the second batch waits")
    release.set()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive(), f"{thread.name} did not finish"


def test_two_concurrent_batches_sharing_a_missing_row_encode_it_once(encoder) -> None:
    pipeline = QwenStyleTokenPipeline(encoder)
    original = pipeline.encode_prompt
    shared, first_only, second_only = token_rows(3, seed=6)
    encoded: list[int] = []
    second_joined = threading.Event()

    def encode(prompt_ids, attention_mask, num_images_per_prompt=1, max_sequence_length=1024):
        if prompt_ids.shape[1] == len(shared) and threading.current_thread().name == "first":
            assert second_joined.wait(timeout=30)  # hold the shared row until the second batch waits on it
        output = original(prompt_ids, attention_mask, num_images_per_prompt, max_sequence_length)
        encoded.append(prompt_ids.shape[1])  # after the encoder: also on a reference run and a proof (answered)
        return output

    pipeline.encode_prompt = encode
    cache = install_prompt_embed_cache(pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    forwards = encoder_forwards(pipeline)
    results = {}

    def run(name, batch):
        results[name] = pipeline.encode_prompt(*collate(batch))

    race(cache, ("first", [shared, first_only]), ("second", [second_only, shared]), run, second_joined)
    # Each row's miss runs this code twice (the encode, then its reference run with the encoder answered), and the
    # second batch's proof of the shared row it joined runs it once more, answered; the encoder ran 3 times in all
    # (rows_encoded below).
    assert sorted(encoded) == sorted([len(shared)] * 3 + [len(first_only)] * 2 + [len(second_only)] * 2)
    assert sorted(forwards) == sorted([len(shared), len(first_only), len(second_only)])  # each row encoded once
    reference = QwenStyleTokenPipeline(encoder)
    for name, batch in (("first", [shared, first_only]), ("second", [second_only, shared])):
        expected = rows_alone(reference, batch, copies=1)
        assert torch.equal(results[name][0], expected[0])
    stats = cache.snapshot()
    assert (stats.row_misses, stats.row_hits, stats.rows_encoded) == (3, 1, 3)


def encoder_forwards(pipeline) -> list[int]:
    """Return a list the lengths of the text encoder's real forwards are appended to (a proof's or a reference
    run's answered encoder call runs no forward)."""
    forwards: list[int] = []
    pipeline.text_encoder.register_forward_hook(
        lambda module, args, kwargs, output: forwards.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    return forwards


def install_failing_once(pipeline, release: threading.Event):
    """Install the cache over an encoder that, on the thread named "failing", waits for ``release``
    and raises once. Return the cache, the (thread, row length) of every encode, a ``run(name,
    batch)`` for :func:`race`, and the outcome (output or error) of each run by name."""
    original = pipeline.encode_prompt
    encoded: list[tuple[str, int]] = []
    failed: list[bool] = []

    def encode(prompt_ids, attention_mask, num_images_per_prompt=1, max_sequence_length=1024):
        name = threading.current_thread().name
        encoded.append((name, prompt_ids.shape[1]))
        if name == "failing" and not failed:
            assert release.wait(timeout=30)
            failed.append(True)
            raise RuntimeError("encoder out of memory")
        return original(prompt_ids, attention_mask, num_images_per_prompt, max_sequence_length)

    pipeline.encode_prompt = encode
    cache = install_prompt_embed_cache(pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    outcome: dict = {}

    def run(name, batch):
        try:
            outcome[name] = pipeline.encode_prompt(*collate(batch))
        except RuntimeError as error:
            outcome[name] = error

    return cache, encoded, run, outcome


def test_a_failed_row_encode_is_retried_by_the_batch_that_waited(encoder) -> None:
    pipeline = QwenStyleTokenPipeline(encoder)
    shared, other = token_rows(2, seed=7)
    waiting = threading.Event()
    cache, _, run, outcome = install_failing_once(pipeline, waiting)
    race(cache, ("failing", [shared]), ("waiter", [other, shared]), run, waiting)
    assert isinstance(outcome["failing"], RuntimeError)
    expected = rows_alone(QwenStyleTokenPipeline(encoder), [other, shared], copies=1)
    assert torch.equal(outcome["waiter"][0], expected[0])
    assert len(cache) == 2


def test_entry_budget_counts_rows(encoder) -> None:
    pipeline = QwenStyleTokenPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=2, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    rows = token_rows(3, seed=8)
    embeds, _ = pipeline.encode_prompt(*collate(rows))
    assert torch.equal(embeds, rows_alone(QwenStyleTokenPipeline(encoder), rows, copies=1)[0])
    stats = cache.snapshot()
    assert (stats.size, stats.evictions, stats.row_misses) == (2, 1, 3)


def test_precomputed_embeddings_stay_a_bypass_and_count_no_rows(encoder) -> None:
    pipeline = TextPipeline(encoder)
    cache = install_prompt_embed_cache(
        pipeline, max_size=4, settings=PromptEmbedCacheSettings(row_layout=QWEN_IMAGE_TEXT)
    )
    pipeline.encode_prompt(["a"], prompt_embeds=torch.zeros(1, 2, 3))
    stats = cache.snapshot()
    assert stats.bypass_reasons == {"precomputed prompt_embeds given": 1} and stats.rows_encoded == 0


def test_a_layout_that_does_not_match_the_outputs_is_dropped_once(encoder, caplog) -> None:
    pipeline = QwenStyleTokenPipeline(encoder)
    wrong = RowLayout(
        rows=("prompt_ids", "attention_mask"),
        mask="attention_mask",
        outputs=(RowOutput(), RowOutput(), RowOutput()),
        name="three outputs",
    )
    cache = install_prompt_embed_cache(pipeline, max_size=8, settings=PromptEmbedCacheSettings(row_layout=wrong))
    rows = token_rows(2, seed=9)
    with caplog.at_level(logging.WARNING, logger="vllm_omni_prompt_cache.rows.layout_proofs"):
        outputs = [pipeline.encode_prompt(*collate(rows)) for _ in range(3)]
    expected = QwenStyleTokenPipeline(encoder).encode_prompt(*collate(rows))
    assert all(torch.equal(embeds, expected[0]) for embeds, _ in outputs)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "three outputs" in caplog.records[0].message
    stats = cache.snapshot()
    assert stats.whole_call_reasons == {LAYOUT_DROPPED_REASON: 1}
    # Call 1 found the mismatch (a miss, served uncached), call 2 was keyed whole (a miss), call 3 hit.
    assert (stats.misses, stats.hits, stats.calls, len(cache)) == (2, 1, 3, 1)
    assert stats.rows_encoded == 1 + 2  # the one row that showed the mismatch, then the whole call's two


def test_a_layout_naming_a_missing_parameter_is_refused_at_install(encoder, caplog) -> None:
    pipeline = TokenIdTextPipeline(encoder)
    layout = RowLayout(rows=("input_ids",), outputs=(RowOutput(),))
    with caplog.at_level(logging.WARNING, logger="vllm_omni_prompt_cache.calls.layouts"):
        install_prompt_embed_cache(pipeline, max_size=4, settings=PromptEmbedCacheSettings(row_layout=layout))
    assert "has no parameter 'input_ids'" in caplog.text


def test_a_declared_layout_on_the_class_is_used(encoder) -> None:
    class Declared(TokenIdTextPipeline):
        # Outputs keep the input width (no trimming): rows are keyed with their padding.
        prompt_embed_row_layout = RowLayout(
            rows=("prompt_ids", "attention_mask"),
            copies="num_images_per_prompt",
            outputs=(RowOutput(pad_dim=1, copies="interleave"), RowOutput(pad_dim=1, copies="interleave")),
        )

    pipeline = Declared(encoder)
    install_prompt_embed_cache(pipeline, max_size=8)
    batch = SiblingsBatch(prompts=2, siblings=3, seed=10)
    ids, mask = collate(batch.rows, width=WIDTH)
    embeds, embeds_mask = pipeline.encode_prompt(ids, mask, num_images_per_prompt=2)
    expected = TokenIdTextPipeline(encoder).encode_prompt(ids, mask, num_images_per_prompt=2)
    assert pipeline.encoder_runs == 2
    assert torch.equal(embeds_mask, expected[1]) and (embeds - expected[0]).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ({"prompt_ids": torch.zeros(2, 3), "attention_mask": torch.ones(3, 3)}, "disagree on the batch size"),
        ({"prompt_ids": torch.zeros(0, 3), "attention_mask": torch.ones(0, 3)}, "empty batch"),
        ({"prompt_ids": 7, "attention_mask": torch.ones(1, 3)}, "not rows"),
        ({"prompt_ids": torch.zeros(1, 3), "attention_mask": torch.ones(1)}, "not a [B, L] tensor"),
        ({"prompt_ids": torch.zeros(2, 3), "attention_mask": torch.tensor([[1, 0, 0], [0, 0, 0]])}, "no position"),
    ],
)
def test_calls_the_layout_cannot_split_say_why(arguments, reason) -> None:
    split = TOKEN_IDS.split({**arguments, "num_images_per_prompt": 1, "max_sequence_length": 8})
    assert isinstance(split, str) and reason in split


@pytest.mark.parametrize("copies", [0, -1, 2.0, True])
def test_copies_must_be_a_positive_integer(copies) -> None:
    split = TOKEN_IDS.split(
        {"prompt_ids": torch.zeros(1, 3), "attention_mask": torch.ones(1, 3), "num_images_per_prompt": copies}
    )
    assert isinstance(split, str) and "num_images_per_prompt" in split


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rows": (), "outputs": (RowOutput(),)}, "at least one argument"),
        ({"rows": ("a",), "outputs": ()}, "non-empty tuple of RowOutput"),
        ({"rows": ("a",), "outputs": (RowOutput(),), "mask": "b"}, "must be one of its rows"),
        ({"rows": ("a",), "outputs": (RowOutput(),), "copies": "a"}, "cannot also be a row"),
    ],
)
def test_bad_layout_declarations_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        RowLayout(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [({"pad_dim": 0}, "pad_dim"), ({"copies": "zip"}, "copies")])
def test_bad_row_outputs_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        RowOutput(**kwargs)


def test_row_outputs_of_the_wrong_form_raise_layout_mismatch() -> None:
    split = TOKEN_IDS.split(
        {"prompt_ids": torch.zeros(1, 3), "attention_mask": torch.ones(1, 3), "num_images_per_prompt": 1}
    )
    with pytest.raises(LayoutMismatch, match="tuple of 2 tensors"):
        split.check_row(torch.zeros(1, 3, 4))
    with pytest.raises(LayoutMismatch, match=r"expected a \[1, \.\.\.\] tensor"):
        split.check_row((torch.zeros(2, 3, 4), torch.zeros(2, 3)))


def test_a_row_whose_encode_raises_releases_the_rows_it_had_not_encoded(encoder) -> None:
    """Batch [a, b]: a's encode raises while another call waits on b; that call encodes b itself."""
    pipeline = QwenStyleTokenPipeline(encoder)
    a, b = token_rows(2, seed=11)
    b_waited = threading.Event()
    cache, encoded, run, outcome = install_failing_once(pipeline, b_waited)
    forwards = encoder_forwards(pipeline)
    race(cache, ("failing", [a, b]), ("waiter", [b]), run, b_waited)
    assert isinstance(outcome["failing"], RuntimeError)
    # b was never encoded by the failing call; the waiter's miss ran the method once more, answered (its reference run).
    assert encoded == [("failing", len(a)), ("waiter", len(b)), ("waiter", len(b))]
    assert forwards == [len(b)]  # the encoder itself ran once: b, by the waiter
    assert torch.equal(outcome["waiter"][0], rows_alone(QwenStyleTokenPipeline(encoder), [b], copies=1)[0])
    assert not len(cache.flights)
    stats = cache.snapshot()
    assert (stats.row_misses, stats.rows_encoded, stats.misses, len(cache)) == (1, 2, 2, 1)


def test_rows_encoded_across_a_clear_are_returned_but_not_kept(encoder) -> None:
    pipeline = QwenStyleTokenPipeline(encoder)
    original = pipeline.encode_prompt
    cache = None

    def encode(prompt_ids, attention_mask, num_images_per_prompt=1, max_sequence_length=1024):
        if pipeline.encoder_rows == 0:
            cache.clear()  # new weights arrive while the first row is being encoded
        return original(prompt_ids, attention_mask, num_images_per_prompt, max_sequence_length)

    pipeline.encode_prompt = encode
    cache = install_prompt_embed_cache(pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    rows = token_rows(2, seed=12)
    first, _ = pipeline.encode_prompt(*collate(rows))
    assert len(cache) == 0  # both rows were claimed before the clear: neither is kept
    second, _ = pipeline.encode_prompt(*collate(rows))
    assert pipeline.encoder_rows == 4 and len(cache) == 2 and torch.equal(first, second)


def test_without_verification_identical_rows_still_share_one_encode(encoder) -> None:
    pipeline = QwenStyleTokenPipeline(encoder)
    install_prompt_embed_cache(
        pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS, verify=False)
    )
    batch = SiblingsBatch(prompts=2, siblings=4, seed=13)
    embeds, _ = pipeline.encode_prompt(*collate(batch.rows))
    assert pipeline.encoder_rows == 2
    assert torch.equal(embeds, rows_alone(QwenStyleTokenPipeline(encoder), batch.rows, copies=1)[0])


def test_the_byte_budget_counts_row_entries(encoder) -> None:
    generator = torch.Generator().manual_seed(14)
    rows = [torch.randint(1, 1000, (10,), generator=generator).tolist() for _ in range(3)]  # equal entry sizes
    sizer = QwenStyleTokenPipeline(encoder)  # one row's entry size, measured on its own cache
    sizing = install_prompt_embed_cache(sizer, max_size=16, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    sizer.encode_prompt(*collate(rows[:1]))
    one_row = sizing.snapshot().bytes
    pipeline = QwenStyleTokenPipeline(encoder)
    cache = install_prompt_embed_cache(
        pipeline,
        max_size=16,
        settings=PromptEmbedCacheSettings(max_bytes=2 * one_row, row_layout=TOKEN_IDS),
    )
    embeds, _ = pipeline.encode_prompt(*collate(rows))
    stats = cache.snapshot()
    assert (stats.size, stats.evictions, stats.bytes) == (2, 1, 2 * one_row)
    assert torch.equal(embeds, rows_alone(QwenStyleTokenPipeline(encoder), rows, copies=1)[0])


def test_rows_of_different_dtypes_are_served_whole_without_dropping_the_layout() -> None:
    """Weights changed dtype without a clear: the cached row cannot be stacked with a fresh one."""
    encoder = build_qwen2_encoder(seed=1)
    pipeline = QwenStyleTokenPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    a, b = token_rows(2, seed=15)
    pipeline.encode_prompt(*collate([a]))  # a cached in fp32
    encoder.double()
    embeds, _ = pipeline.encode_prompt(*collate([a, b]))
    assert embeds.dtype == torch.float64  # what the uncached call returns now
    assert cache.snapshot().whole_call_reasons == {UNSTACKABLE_REASON: 1}
    pipeline.encode_prompt(*collate([b]))  # the layout is still in use: b was cached by the call above
    assert cache.snapshot().row_hits >= 1


def test_a_mask_layout_refuses_rows_it_cannot_trim() -> None:
    arguments = {"prompt_ids": [[5, 6, 0], [7, 0, 0]], "attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}
    split = TOKEN_IDS.split({**arguments, "num_images_per_prompt": 1, "max_sequence_length": 8})
    assert split == "argument 'prompt_ids' is not a [B, 3, ...] tensor to trim with 'attention_mask'"


def test_an_undeclared_copy_order_is_never_guessed() -> None:
    layout = RowLayout(rows=("prompt",), copies="copies", outputs=(RowOutput(),))
    assert RowOutput().copies is None
    split = layout.split({"prompt": ["a", "b"], "copies": 2})
    assert isinstance(split, str) and "copy order is not declared" in split
    assert not isinstance(layout.split({"prompt": ["a"], "copies": 2}), str)  # one row: no order to know


def test_a_one_row_call_and_the_same_row_cut_from_a_batch_share_one_entry(encoder) -> None:
    """The one-row fast path keys the call's arguments as given; a batch keys each cut, trimmed row."""
    pipeline = QwenStyleTokenPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    short, long = sorted(token_rows(2, seed=21), key=len)
    assert len(short) < len(long)
    pipeline.encode_prompt(*collate([short]))
    pipeline.encode_prompt(*collate([long]))
    assert pipeline.encoder_rows == 2
    embeds, _ = pipeline.encode_prompt(*collate([long, short, short]))  # short is padded here: trimmed
    assert pipeline.encoder_rows == 2 and cache.snapshot().row_hits == 3
    assert torch.equal(embeds, rows_alone(QwenStyleTokenPipeline(encoder), [long, short, short], copies=1)[0])
    pipeline.encode_prompt(*collate([short], width=len(short) + 3))  # one row with padding: split and trimmed
    assert pipeline.encoder_rows == 2


def test_a_flat_list_of_token_ids_is_one_prompt_not_rows() -> None:
    split = TOKEN_IDS.split(
        {"prompt_ids": [7, 8, 9], "attention_mask": None, "num_images_per_prompt": 1, "max_sequence_length": 8}
    )
    assert split == "argument 'prompt_ids' is a list, not rows"


@pytest.mark.parametrize(
    ("mask", "single"),
    [
        (None, True),
        (torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.bfloat16), True),
        (torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.bfloat16), False),
        (torch.tensor([[True, False, True]]), True),
        (torch.tensor([[1, 1, 0]]), False),
        (torch.ones(1, 3, requires_grad=True), True),
    ],
)
def test_the_one_row_test_reads_any_mask(mask, single) -> None:
    arguments = {"prompt_ids": torch.ones(1, 3, dtype=torch.int64), "attention_mask": mask}
    assert TOKEN_IDS.is_single_row({**arguments, "num_images_per_prompt": 1, "max_sequence_length": 8}) is single


def test_a_one_row_key_reuses_the_mask_read_for_its_test_and_equals_the_key_of_that_row_cut_from_a_batch() -> None:
    import inspect

    from vllm_omni_prompt_cache.keys.call_key import CallKeyBuilder, freeze_witness, witness_matches

    builder = CallKeyBuilder(inspect.signature(QwenStyleTokenPipeline.encode_prompt), "tiny")
    ids = torch.tensor([[5, 6, 7]])
    single = TOKEN_IDS.single_row_key(
        {"self": None, "prompt_ids": ids, "attention_mask": ids != 0, "num_images_per_prompt": 1}
        | {"max_sequence_length": 8}
    )
    (view,) = single.host_views.values()
    assert view.base is not None or view.flags.owndata is False  # a view of the mask, not a copy
    key = builder.build_from_arguments(single.arguments, row=True, host_views=single.host_views)
    padded = torch.tensor([[5, 6, 7], [9, 0, 0]])
    split = TOKEN_IDS.split(
        {"self": None, "prompt_ids": padded, "attention_mask": padded != 0, "num_images_per_prompt": 1}
        | {"max_sequence_length": 8}
    )
    cut = builder.build_from_arguments(split.key_arguments(0), row=True)
    assert key.identity == cut.identity and witness_matches(freeze_witness(cut.witness), key.witness)
    assert key.identity == builder.build_from_arguments(single.arguments, row=True).identity  # views change nothing


def test_the_one_row_test_refuses_what_split_must_judge() -> None:
    ids = torch.ones(1, 0, dtype=torch.int64)
    base = {"num_images_per_prompt": 1, "max_sequence_length": 8}
    assert TOKEN_IDS.is_single_row({**base, "prompt_ids": ids, "attention_mask": ids.bool()}) is False
    two = torch.ones(2, 3, dtype=torch.int64)
    assert TOKEN_IDS.is_single_row({**base, "prompt_ids": two, "attention_mask": two.bool()}) is False
    one = torch.ones(1, 3, dtype=torch.int64)
    copies = {**base, "num_images_per_prompt": 2, "prompt_ids": one, "attention_mask": one.bool()}
    assert TOKEN_IDS.is_single_row(copies) is False


def test_a_one_row_output_of_the_wrong_form_drops_the_layout_and_is_served_uncached(encoder, caplog) -> None:
    pipeline = QwenStyleTokenPipeline(encoder)
    unordered = dataclasses.replace(TOKEN_IDS, copies=None, name="copies not declared")
    cache = install_prompt_embed_cache(pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=unordered))
    ids, mask = collate(token_rows(1, seed=22))
    with caplog.at_level(logging.WARNING, logger="vllm_omni_prompt_cache.rows.layout_proofs"):
        embeds, _ = pipeline.encode_prompt(ids, mask, num_images_per_prompt=2)  # two rows out of one
    assert torch.equal(embeds, QwenStyleTokenPipeline(encoder).encode_prompt(ids, mask, num_images_per_prompt=2)[0])
    assert "'copies not declared'" in caplog.text and len(cache) == 0
    assert cache.snapshot().whole_call_reasons == {LAYOUT_DROPPED_REASON: 1}


class MaskHandedBack(QwenStyleTokenPipeline):
    """Returns the attention mask it was given (a view of the caller's tensor), as some encodes do."""

    def encode_prompt(self, prompt_ids, attention_mask=None, num_images_per_prompt=1, max_sequence_length=512):
        embeds, _ = super().encode_prompt(prompt_ids, attention_mask, num_images_per_prompt, max_sequence_length)
        return embeds, attention_mask[:, : embeds.shape[1]]


def test_a_one_row_call_whose_output_is_a_view_of_the_callers_mask_is_kept_as_a_copy(encoder) -> None:
    """A one-row call is keyed and encoded from the caller's own tensors (no split copies them)."""
    pipeline = MaskHandedBack(encoder)
    install_prompt_embed_cache(pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    rows = token_rows(1)
    ids, mask = collate(rows)
    expected = [tensor.clone() for tensor in pipeline.encode_prompt(ids, mask)]
    mask.fill_(False)  # the adapter reuses its buffer for the next batch
    embeds, cached_mask = pipeline.encode_prompt(*collate(rows))
    assert pipeline.encoder_runs == 1
    assert torch.equal(cached_mask, expected[1]) and torch.equal(embeds, expected[0])


def test_a_call_whose_assembly_raises_still_counts_its_rows_and_itself(encoder, monkeypatch) -> None:
    """Rows served before the output could be assembled (no memory left for it, say) were served: counted."""
    from vllm_omni_prompt_cache.rows.layout import RowSplit

    pipeline = QwenStyleTokenPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    ids, mask = collate(token_rows(2, seed=31))
    pipeline.encode_prompt(ids, mask)

    def out_of_memory(self, row_values):
        raise MemoryError("no memory for the output")

    monkeypatch.setattr(RowSplit, "assemble", out_of_memory)
    with pytest.raises(MemoryError):
        pipeline.encode_prompt(ids.clone(), mask.clone())
    stats = cache.snapshot()
    assert (stats.row_misses, stats.row_hits, stats.rows_encoded) == (2, 2, 2)
    assert (stats.misses, stats.hits) == (2, 0)  # the failed call is a call, as a whole call that raises is


class FormSensitiveText:
    """A text encode whose output for a bare string differs from that for a list of one (as pipelines that
    template or pad the two forms apart do): rows of one form must never be served for the other unchecked."""

    def encode_prompt(self, prompt, num_images_per_prompt=1):
        bare = isinstance(prompt, str)
        prompts = [prompt] if bare else list(prompt)
        embeds = torch.tensor([[[float(len(each)) + (100.0 if bare else 0.0)]] for each in prompts])
        return (embeds.repeat_interleave(num_images_per_prompt, 0),)


@pytest.mark.parametrize("first", [["a", "bb"], "a"], ids=["after a batch", "after the bare string"])
def test_a_one_prompt_call_is_not_served_the_other_forms_row_unchecked(first) -> None:
    text = RowLayout(rows=("prompt",), copies="num_images_per_prompt", outputs=(RowOutput(pad_dim=1),), name="text")
    path = f"{FormSensitiveText.__module__}.{FormSensitiveText.__qualname__}"
    pipeline, reference = FormSensitiveText(), FormSensitiveText()
    install_prompt_embed_cache(
        pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layouts={path: text})
    )  # a setting: checked, not trusted
    pipeline.encode_prompt(first)
    other = ["a"] if isinstance(first, str) else "a"
    assert torch.equal(pipeline.encode_prompt(other)[0], reference.encode_prompt(other)[0])
