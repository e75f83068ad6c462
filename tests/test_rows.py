"""Batched text-encoder calls served row by row, through ``install_prompt_embed_cache`` on a real (tiny,
random-weight) transformers encoder.

Rows are cut where they reach the encoder, as given (padding included). The first batched call of an encoder is
served uncached and its distinct rows encoded alone and compared with it; after that only a call's missing rows
reach the encoder, as one sub-batch. What reached the encoder is read by a forward pre-hook on it (a hit reaches
nothing). Every output is compared with an uncached twin's (same weights): within the batch-invariance tolerance
for an assembled batch, bit-identical for a call the encoder ran whole.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections import Counter

import torch
from transformers.modeling_outputs import BaseModelOutput

from vllm_omni_prompt_cache import PromptEmbedCache, install_prompt_embed_cache
from vllm_omni_prompt_cache.calls.encoder_calls import ROWS_DEPEND
from vllm_omni_prompt_cache.keys import call_key
from vllm_omni_prompt_cache.rows.encoder_rows import GAP_TOLERANCE
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder

WIDTH = 12
JOIN_S = 60  # a thread still alive after this failed the test


def prompt_rows(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, WIDTH - 1, (count,), generator=generator).tolist()
    return [torch.randint(1, 1000, (length,), generator=generator).tolist() for length in lengths]


def collate(rows: list[list[int]], width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh right-padded int64 ids and a bool mask, as an RL adapter collates a request batch."""
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(row)
    return ids, ids != 0


def as_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[tuple]:
    """Each row as the encoder receives it: its padded ids and its mask."""
    return [(tuple(i), tuple(m)) for i, m in zip(ids.tolist(), mask.long().tolist(), strict=True)]


def padded(rows: list[list[int]], width: int = WIDTH) -> list[tuple]:
    return as_rows(*collate(rows, width))


class Forwards:
    """The rows of each real run of an encoder, read by a forward pre-hook."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        self.calls: list[list[tuple]] = []
        encoder.register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self.calls.append(as_rows(kwargs["input_ids"], kwargs["attention_mask"]))

    def take(self) -> list[list[tuple]]:
        calls, self.calls = self.calls, []
        return calls


@dataclasses.dataclass
class Bench:
    cached: TokenIdTextPipeline
    uncached: TokenIdTextPipeline  # a twin with the same weights and no cache
    cache: PromptEmbedCache
    forwards: Forwards

    def encode(self, rows: list[list[int]], width: int = WIDTH, copies: int = 1) -> tuple[tuple, tuple]:
        """Return what the cached pipeline and its uncached twin return for one collated batch."""
        ids, mask = collate(rows, width)
        return self.call(ids, mask, copies)

    def call(self, ids: torch.Tensor, mask: torch.Tensor, copies: int = 1) -> tuple[tuple, tuple]:
        served = self.cached.encode_prompt(ids.clone(), mask.clone(), num_images_per_prompt=copies)
        return served, self.uncached.encode_prompt(ids, mask, num_images_per_prompt=copies)


def bench(make_encoder=build_qwen2_encoder, **settings) -> Bench:
    cached, uncached = TokenIdTextPipeline(make_encoder()), TokenIdTextPipeline(make_encoder())
    forwards = Forwards(cached.text_encoder)
    cache = install_prompt_embed_cache(cached, max_size=64, settings=PromptEmbedCacheSettings(**settings))
    assert cache is not None
    return Bench(cached, uncached, cache, forwards)


def assert_within_tolerance(served: tuple, expected: tuple) -> None:
    """The mask equal; each row of the embeddings within the batch-invariance tolerance of the uncached call's,
    relative to that row's largest value (another row's embedding would differ by the order of its values)."""
    (embeds, mask), (want, want_mask) = served, expected
    assert torch.equal(mask, want_mask)
    assert (embeds.shape, embeds.dtype) == (want.shape, want.dtype)
    rows = want.reshape(len(want), -1).double()
    gaps = (embeds.reshape(rows.shape).double() - rows).abs().amax(1) / rows.abs().amax(1).clamp_min(1e-30)
    assert float(gaps.max()) <= GAP_TOLERANCE[want.dtype], f"rows differ by {gaps.tolist()}"


def assert_equal(served: tuple, expected: tuple) -> None:
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(served, expected, strict=True))


def test_the_first_batched_call_is_served_uncached_and_its_distinct_rows_checked_alone() -> None:
    b = bench()
    r0, r1, r2 = prompt_rows(3, seed=1)
    served, expected = b.encode([r0, r1, r0, r2], copies=2)
    assert_equal(served, expected)  # the uncached call's own output
    batch = padded([r0, r1, r0, r2])
    assert b.forwards.take() == [batch, [batch[0]], [batch[1]], [batch[3]]]  # r0 alone once, not twice
    stats = b.cache.snapshot()
    # The check is the batch served uncached (its 4 rows); the 3 distinct rows encoded alone are the entries kept.
    assert (stats.layout_checks, stats.layout_check_rows, stats.layout_mismatches, stats.size) == (1, 4, 0, 3)
    assert (stats.rows_encoded, stats.row_misses, stats.row_hits) == (3, 3, 1)
    assert stats.layout_check_max_gap <= GAP_TOLERANCE[torch.float32]
    served, expected = b.encode([r2, r0, r1, r1])  # every row kept by the check: nothing reaches the encoder
    assert b.forwards.take() == []
    assert_within_tolerance(served, expected)
    stats = b.cache.snapshot()
    assert (stats.layout_checks, stats.hits) == (1, 1)


def test_later_batches_send_only_their_missing_rows_to_the_encoder_as_one_sub_batch() -> None:
    b = bench()
    pool = prompt_rows(10, seed=2)
    b.encode(pool[:2])  # the check
    b.forwards.take()
    served, expected = b.encode([pool[2], pool[0], pool[3], pool[2], pool[1], pool[4]], copies=3)
    assert b.forwards.take() == [padded([pool[2], pool[3], pool[4]])]  # one run: the missing rows, once each
    assert_within_tolerance(served, expected)
    # Batches drawn with repeats: each call's missing rows, in one run; each distinct row encoded once in all.
    known = set(padded(pool[:5]))
    draw = random.Random(0)
    for batch in [draw.choices(pool, k=draw.randint(2, 6)) for _ in range(8)] + [pool]:
        missing = list(dict.fromkeys(row for row in padded(batch) if row not in known))
        served, expected = b.encode(batch)
        assert b.forwards.take() == ([missing] if missing else [])
        assert_within_tolerance(served, expected)
        known.update(missing)
    assert b.cache.snapshot().layout_checks == 1 and len(b.cache) == len(pool)


def test_one_row_calls_are_bit_identical_to_uncached_encoded_or_answered() -> None:
    b = bench()
    row, other = prompt_rows(2, seed=3)
    b.encode([row, other])  # the check: a one-row call is bit-identical even after it
    b.forwards.take()
    for copies in (1, 1, 3):
        served, expected = b.encode([row], copies=copies)
        assert_equal(served, expected)
    assert b.forwards.take() == [padded([row])]  # encoded once, then answered


def test_duplicates_inside_one_batch_reach_the_encoder_once() -> None:
    b = bench()
    known, missing = prompt_rows(2, seed=4)
    b.encode([known, known])
    assert b.forwards.take() == [padded([known, known]), padded([known])]
    served, expected = b.encode([missing, missing, known, missing])
    assert b.forwards.take() == [padded([missing])]
    assert_within_tolerance(served, expected)
    assert torch.equal(served[0][0], served[0][1]) and torch.equal(served[0][0], served[0][3])


def weak_digest(data: object) -> bytes:
    return b"x" * 16


def test_a_digest_collision_never_serves_another_rows_embedding(monkeypatch) -> None:
    """Every tensor digests alike: rows of one width share one key identity and differ only in their bytes."""
    monkeypatch.setattr(call_key, "default_digest", weak_digest)  # what encoder keys digest with (see below)
    b = bench(digest=weak_digest)
    r = prompt_rows(5, seed=5)
    batches = [[r[0], r[1], r[0]], [r[2], r[1], r[0], r[2]], [r[3], r[4], r[1]], [r[4]], [r[0]], [r[4], r[3], r[4]]]
    for batch in batches:
        served, expected = b.encode(batch)
        assert_within_tolerance(served, expected)
    encoded = Counter(row for call in b.forwards.take()[3:] for row in call)  # after the check's batch and rows
    assert max(encoded.values()) > 1  # the collisions were real: rows a sound digest keeps had to be encoded again
    assert b.cache.snapshot().bypass_reasons  # and a one-row call's collision is said


def test_the_digest_setting_keys_encoder_calls() -> None:
    digested = []
    b = bench(digest=lambda data: digested.append(1) or weak_digest(data))
    b.encode(prompt_rows(2, seed=6))
    assert digested


def test_rows_encoded_after_a_collision_are_not_counted_as_hits(monkeypatch) -> None:
    monkeypatch.setattr(call_key, "default_digest", weak_digest)
    b = bench()
    rows = prompt_rows(4, seed=6)
    b.encode(rows[:2])
    before = b.cache.snapshot()
    b.encode(rows[2:])  # both rows collide with a kept row's identity: encoded, not served
    counts = b.cache.snapshot().since(before)
    assert sum(map(len, b.forwards.take()[3:])) == 2
    assert (counts.row_hits, counts.row_bypassed) == (0, 2)


class BatchMeanEncoder(torch.nn.Module):
    """A text encoder whose rows depend on each other: each row's hidden states plus the batch's mean."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build_qwen2_encoder()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> BaseModelOutput:
        hidden = self.inner(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return BaseModelOutput(last_hidden_state=hidden + hidden.mean(dim=0, keepdim=True))


def test_an_encoder_whose_rows_depend_on_each_other_is_found_out_and_then_served_as_uncached() -> None:
    b = bench(BatchMeanEncoder)
    r0, r1, r2 = prompt_rows(3, seed=7)
    served, expected = b.encode([r0, r1, r0, r2])
    assert_equal(served, expected)
    stats = b.cache.snapshot()
    assert (stats.layout_checks, stats.layout_mismatches, len(b.cache)) == (1, 1, 0)
    assert b.forwards.take()[0] == padded([r0, r1, r0, r2])
    batches = [[r0, r1, r0, r2], [r0, r1, r0, r2], [r2, r0, r1], [r1, r0], [r1], [r1]]
    for batch in batches:
        served, expected = b.encode(batch)
        assert_equal(served, expected)  # every call bit-identical: no row is ever served apart from its batch
        assert b.forwards.take() in ([], [padded(batch)])
    stats = b.cache.snapshot()
    assert stats.whole_call_reasons == {ROWS_DEPEND: 4}
    assert (stats.layout_checks, stats.layout_mismatches) == (1, 1)


def test_rows_padded_to_another_width_or_masked_otherwise_are_other_rows() -> None:
    b = bench()
    r0, r1 = prompt_rows(2, seed=8)
    b.encode([r0, r1])
    b.forwards.take()
    served, expected = b.encode([r1, r0], width=WIDTH + 3)  # no trimming: both rows are new
    assert b.forwards.take() == [padded([r1, r0], WIDTH + 3)]
    assert served[0].shape[1] == WIDTH + 3
    assert_within_tolerance(served, expected)
    ids, mask = collate([r0, r1])
    mask[0, 1] = False  # a hole inside r0's attended positions
    served, expected = b.call(ids, mask)
    assert b.forwards.take() == [as_rows(ids, mask)[:1]]  # r0 as masked now; r1 as before, answered
    assert_within_tolerance(served, expected)


def run_threads(targets: dict[str, object]) -> None:
    threads = [threading.Thread(target=target, name=name) for name, target in targets.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish"


def test_two_threads_whose_batches_share_a_missing_row_encode_it_once() -> None:
    b = bench()
    shared, first, second, warm = prompt_rows(4, seed=9)
    b.encode([warm, warm])
    b.forwards.take()
    # Each thread's encoder run waits for the other's: both have claimed their rows before either encodes.
    both_encoding = threading.Barrier(2, timeout=JOIN_S / 2)

    def wait_for_the_other(module: torch.nn.Module, args: tuple) -> None:
        both_encoding.wait()  # its return value must not reach the hook's: it would replace the arguments

    b.cached.text_encoder.register_forward_pre_hook(wait_for_the_other)
    batches = {"one": [shared, first], "two": [second, shared]}
    results: dict[str, object] = {}

    def run(name: str) -> None:
        try:
            results[name] = b.cached.encode_prompt(*collate(batches[name]))
        except BaseException as error:
            results[name] = error

    run_threads({name: lambda name=name: run(name) for name in batches})
    calls = b.forwards.take()
    assert len(calls) == 2  # one run each
    assert Counter(row for call in calls for row in call) == Counter(padded([shared, first, second]))
    for name, batch in batches.items():
        assert isinstance(results[name], tuple), results[name]
        assert_within_tolerance(results[name], b.uncached.encode_prompt(*collate(batch)))


def test_a_row_whose_encode_failed_is_encoded_by_the_call_that_waited_on_it() -> None:
    b = bench()
    shared, own, other, warm = prompt_rows(4, seed=10)
    b.encode([warm, warm])
    b.forwards.take()
    owner_encoding, waiter_encoding = threading.Event(), threading.Event()

    def fail_the_owner(module: torch.nn.Module, args: tuple) -> None:
        if threading.current_thread().name == "owner":
            owner_encoding.set()
            assert waiter_encoding.wait(JOIN_S / 2)  # the waiter has claimed its rows, joined the shared one
            raise RuntimeError("encoder out of memory")
        waiter_encoding.set()

    b.cached.text_encoder.register_forward_pre_hook(fail_the_owner)
    results: dict[str, object] = {}

    def run(name: str, batch: list[list[int]], after: threading.Event | None = None) -> None:
        try:
            assert after is None or after.wait(JOIN_S / 2)
            results[name] = b.cached.encode_prompt(*collate(batch))
        except BaseException as error:
            results[name] = error

    run_threads(
        {"owner": lambda: run("owner", [shared, own]), "waiter": lambda: run("waiter", [other, shared], owner_encoding)}
    )
    assert isinstance(results["owner"], RuntimeError) and isinstance(results["waiter"], tuple), results
    assert b.forwards.take() == [padded([shared, own]), padded([other]), padded([shared])]  # the first raised
    assert_within_tolerance(results["waiter"], b.uncached.encode_prompt(*collate([other, shared])))
    assert not len(b.cache.flights)
    served, expected = b.encode([shared, own, other])
    assert b.forwards.take() == [padded([own])]
    assert_within_tolerance(served, expected)


def test_rows_kept_before_the_encoder_changed_dtype_are_not_served_after() -> None:
    b = bench()
    rows = prompt_rows(3, seed=11)
    b.encode(rows[:2])
    b.forwards.take()
    b.cached.text_encoder.double()
    b.uncached.text_encoder.double()
    served, expected = b.encode(rows)
    assert served[0].dtype == torch.float64  # what the uncached call returns now
    assert_within_tolerance(served, expected)
    assert Counter(row for call in b.forwards.take() for row in call).keys() == set(padded(rows))
