"""Thread safety of a wrapped method's :class:`~vllm_omni_prompt_cache.keys.method_state.MethodState`.

Two threads call a method found by watching the encoder while it is still in its first use; one of
them is held inside its first encode until the other has finished its own first use and served a hit.
Every call must return its own prompt's uncached encode, every call must be counted once, and the
method must be learned once: confirmed once, its first hit checked once, cached, not refused.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable

import pytest
import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.keys.method_state import MethodState
from vllm_omni_prompt_cache.keys.reads import Trace
from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns
from vllm_omni_prompt_cache.tiny.text_encoder import build_qwen2_encoder

LENGTH = 16
ROUNDS = 6
#: What each adapter runs inside its encode, after the encoder, by id: kept off the instance, so no key reads it.
HOLDS: dict[int, Callable[[], None]] = {}


@pytest.fixture(scope="module")
def encoder() -> torch.nn.Module:
    return build_qwen2_encoder()


def _padded(ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids[:LENGTH] + [0] * (LENGTH - len(ids[:LENGTH]))], dtype=torch.long)


def _ids(seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1000, (5 + seed % 7,), generator=generator).tolist()


class HeldAdapter(CountsEncoderRuns, torch.nn.Module):
    """A token-ID adapter whose encode method no code of ours names (it is found by watching the encoder);
    ``hold`` runs inside each encode, after the encoder (see ``HOLDS``)."""

    def __init__(self, encoder: torch.nn.Module, hold: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.dit = torch.nn.Linear(4, 4)
        self.scale = 1.0  # pipeline state the encode reads: data in its key
        HOLDS[id(self)] = hold

    @torch.inference_mode()
    def _embed_ids(self, token_ids: list[int]) -> torch.Tensor:
        hidden = self.text_encoder(input_ids=_padded(token_ids)).last_hidden_state
        self.encoder_rows += 1  # once the encoder ran: a hit runs this up to its encoder call (its proof)
        HOLDS[id(self)]()
        return hidden * self.scale

    @torch.inference_mode()
    def forward(self, token_ids: list[int]) -> torch.Tensor:
        return self.dit(self._embed_ids(token_ids)[..., :4])


def test_two_threads_in_a_methods_first_use_learn_it_once(encoder, caplog) -> None:
    reference = HeldAdapter(encoder)
    prompts = [_ids(seed) for seed in range(4)]
    expected = [reference._embed_ids(list(prompt)) for prompt in prompts]

    held_inside = threading.Event()  # thread B is inside its first use's encode
    released = threading.Event()  # thread A has finished its first use and served (and checked) a hit
    thread_b: list[threading.Thread] = []

    def hold() -> None:
        if thread_b and threading.current_thread() is thread_b[0] and not held_inside.is_set():
            held_inside.set()
            released.wait(20)

    pipeline = HeldAdapter(encoder, hold)
    cache = install_prompt_embed_cache(pipeline, max_size=64)
    pipeline(_ids(99))  # the encoder runs outside every wrapped method: _embed_ids is found and wrapped
    assert cache.stats()["encode_methods"]["_embed_ids"]["state"] == "learning"
    counted = cache.hits + cache.misses + cache.bypassed
    barrier = threading.Barrier(2)
    calls, wrong = [0, 0], []

    def call(index: int, prompt: int) -> None:
        got = pipeline._embed_ids(list(prompts[prompt]))
        calls[index] += 1
        if not torch.equal(got, expected[prompt]):
            wrong.append((index, prompt))

    def first(index: int) -> None:  # A: its first use while B's is under way, then a hit (checked)
        barrier.wait(20)
        assert held_inside.wait(20), "thread B never reached its first encode"
        call(index, 0)
        call(index, 0)
        released.set()

    def second(index: int) -> None:  # B: its first use, held inside its encode until A is past its own
        barrier.wait(20)
        call(index, 1)

    def rounds(index: int, start: threading.Barrier) -> None:
        for round_ in range(ROUNDS):
            start.wait(20)
            call(index, (index + round_) % len(prompts))

    with caplog.at_level(logging.INFO, logger="vllm_omni_prompt_cache"):
        _run_in_two_threads(first, second, thread_b)
        start = threading.Barrier(2)
        _run_in_two_threads(lambda index: rounds(index, start), lambda index: rounds(index, start), [])
    assert released.is_set() and held_inside.is_set()
    assert wrong == []
    stats = cache.stats()
    assert stats["hits"] + stats["misses"] + stats["bypassed"] - counted == sum(calls) == 3 + 2 * ROUNDS
    assert stats["bypassed"] == 0
    described = stats["encode_methods"]["_embed_ids"]
    assert (described["state"], described["refusal"]) == ("cached", None)
    assert "self.scale (content)" in described["keyed_on"]
    assert stats["methods"]["_embed_ids"]["audits"] == 1  # the first hit checked once, not once per learner
    confirmed = [record for record in caplog.records if "_embed_ids is cached" in record.getMessage()]
    assert len(confirmed) == 1


def _run_in_two_threads(first, second, second_thread: list[threading.Thread]) -> None:
    """Run ``first(0)`` and ``second(1)`` on two threads (the second noted in ``second_thread``); re-raise."""
    failures: list[BaseException] = []

    def guarded(target, index: int) -> None:
        try:
            target(index)
        except BaseException as error:  # reported on the test's thread
            failures.append(error)

    threads = [threading.Thread(target=guarded, args=(target, index)) for index, target in enumerate((first, second))]
    second_thread.append(threads[1])
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a thread never finished"
    if failures:
        raise failures[0]


def test_a_hit_reading_the_state_while_another_call_learns_sees_whole_values() -> None:
    """A hit reads a method's components and data without its lock (``state_argument``) while another thread's
    encode merges what it read (``learn``): each merge publishes new lists and dicts, never changing those the
    hit iterates."""
    from types import SimpleNamespace

    batches, per_batch = 6, 200
    instance = SimpleNamespace()
    for index in range(batches * per_batch):
        setattr(instance, f"module_{index}", torch.nn.Identity())
        setattr(instance, f"length_{index}", index)
    state = MethodState("encode", "a test", inferred=False, learning=False)
    learned = threading.Event()
    failures: list[BaseException] = []

    def hit() -> None:
        try:
            while not learned.is_set():
                held = state.state_argument(instance)
                assert held is None or [name for name, _ in held] == state.data[: len(held)]
        except BaseException as error:  # reported on the test's thread
            failures.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: inside the iterations
    reader = threading.Thread(target=hit)
    reader.start()
    try:
        for batch in range(batches):
            trace = Trace(instance)
            for index in range(batch * per_batch, (batch + 1) * per_batch):
                trace.read(f"module_{index}", getattr(instance, f"module_{index}"))
                trace.read(f"length_{index}", index)
            assert state.learn(trace, torch.zeros(1)) == (True, None)
    finally:
        learned.set()
        reader.join(60)
        sys.setswitchinterval(interval)
    assert failures == []
    assert len(state.components) == len(state.data) == batches * per_batch
