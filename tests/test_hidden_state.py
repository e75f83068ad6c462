"""No wrong embedding, wherever an adapter keeps a request's token ids.

Each case is a pipeline with a real (tiny, random-weight) transformers text encoder whose encode takes
the same arguments for every prompt and finds the request's ids somewhere else: on a component, in a
helper object made at ``__init__``, in a config changed in place, outside the pipeline, behind a
callable, or around attribute access. The request sequence A, A, A, B, A, C, B repeats A truly before
anything changes, so a cache that trusts the method's arguments alone serves A's embedding for B. With
default settings, through the public ``install_prompt_embed_cache``, every call must equal the uncached
encode of its own ids (an encoder of the same weights no cache is installed around), both when the encode
is ``encode_prompt`` and when it is a method found by watching the encoder (``_embed_request`` below,
called from ``forward``). The encode runs for real on every call; what reaches the text encoder is its key
(``calls/encoder_calls.py``), so each distinct prompt is still encoded once (counted by a hook on the
encoder's forward).
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import functools
import threading
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.calls.encoder_calls import EncoderCalls
from vllm_omni_prompt_cache.encoders.text_encoders import child_modules
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.store.prompt_embed_cache import PromptEmbedCache
from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns
from vllm_omni_prompt_cache.tiny.text_encoder import build_qwen2_encoder

LENGTH = 12
SEQUENCE = "AAABACB"
PROMPTS = {"A": [5, 17, 29, 3], "B": [88, 41, 7, 7, 90, 12], "C": [600, 2]}


def padded(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded int64 ids ``[1, LENGTH]`` and their long mask, as an adapter collates one prompt."""
    tensor = torch.zeros(1, LENGTH, dtype=torch.int64)
    tensor[0, : len(ids)] = torch.tensor(ids)
    return tensor, (tensor != 0).long()


@torch.inference_mode()
def embed(encoder: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """What an encode of ``ids`` returns, uncached: the reference every served call is compared with."""
    input_ids, mask = padded(ids)
    return encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state


@pytest.fixture
def encoder() -> torch.nn.Module:
    """The cached pipeline's text encoder: fresh per test, so its hooks and its interception are this test's alone."""
    return build_qwen2_encoder()


@pytest.fixture
def reference() -> torch.nn.Module:
    """The same weights (the same seed), around which no cache is installed: what every served call is compared with."""
    return build_qwen2_encoder()


# --- Where the ids are kept: set per request by the adapter (stash), read by the encode (read) ---------------


class PretokenizedTokenizer:
    """A tokenizer stand-in that hands back the ids the pipeline's forward gave it (it loads like one)."""

    @classmethod
    def from_pretrained(cls, path: str) -> PretokenizedTokenizer:
        return cls()

    def __init__(self) -> None:
        self._pending: list[int] = []

    def hand_back(self, ids: list[int]) -> None:
        self._pending = ids

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": self._pending}


class Processor:
    """A processor stand-in whose method the adapter patches per request with ``functools.partial`` (as
    verl-omni's Qwen3-Omni training adapter patches ``self.processor.get_rope_index``)."""

    @classmethod
    def from_pretrained(cls, path: str) -> Processor:
        return cls()

    def request_ids(self) -> list[int]:
        return []


def _given(ids: list[int]) -> list[int]:
    return ids


class PlainHelper:
    def __init__(self) -> None:
        self.ids: list[int] = []


@dataclasses.dataclass
class DataclassHelper:
    ids: list[int] = dataclasses.field(default_factory=list)


class RequestConfig:
    """A configuration object built the way diffusers builds them, changed in place per request."""

    @classmethod
    def from_config(cls, config: dict) -> RequestConfig:
        return cls()

    def __init__(self) -> None:
        self.ids: list[int] = []


class Box:
    def __init__(self, ids: list[int]) -> None:
        self._ids = ids

    def ids(self) -> list[int]:
        return self._ids


MODULE_REQUESTS: dict[str, list[int]] = {}
CURRENT_IDS: contextvars.ContextVar[list[int]] = contextvars.ContextVar("current_ids")


@dataclasses.dataclass(frozen=True)
class Hidden:
    """One place an adapter keeps a request's ids: made at ``__init__``, stashed per request, read by the encode."""

    setup: Callable[[Any], None]
    stash: Callable[[Any, list[int]], None]
    read: Callable[[Any], list[int]]


def _nothing(pipeline: Any) -> None:
    return None


def _on(name: str, make: Callable[[], Any], stash: Callable[[Any, list[int]], None], read: Callable[[Any], list[int]]):
    """A helper object made at ``__init__`` as ``pipeline.<name>``, changed in place per request."""
    return Hidden(
        lambda pipeline: setattr(pipeline, name, make()),
        lambda pipeline, ids: stash(getattr(pipeline, name), ids),
        lambda pipeline: read(getattr(pipeline, name)),
    )


def _set_config_ids(config: Any, ids: list[int]) -> None:
    config.pending_ids = ids


def _transformers_config() -> Any:
    from transformers import PretrainedConfig

    return PretrainedConfig()


HIDDEN: dict[str, Hidden] = {
    # On a component: the text encoder itself, a tokenizer, a processor's patched method.
    "text encoder attribute": Hidden(
        _nothing,
        lambda p, ids: setattr(p.text_encoder, "pending_ids", ids),
        lambda p: p.text_encoder.pending_ids,
    ),
    "pretokenized tokenizer": _on(
        "tokenizer", PretokenizedTokenizer, PretokenizedTokenizer.hand_back, lambda t: t("[pretokenized]")["input_ids"]
    ),
    "processor partial": _on(
        "processor",
        Processor,
        lambda processor, ids: setattr(processor, "request_ids", functools.partial(_given, ids)),
        lambda processor: processor.request_ids(),
    ),
    # A helper object or container made at __init__ and changed per request.
    "plain helper": _on("helper", PlainHelper, lambda h, ids: setattr(h, "ids", ids), lambda h: h.ids),
    "SimpleNamespace": _on("helper", types.SimpleNamespace, lambda h, ids: setattr(h, "ids", ids), lambda h: h.ids),
    "dataclass": _on("helper", DataclassHelper, lambda h, ids: setattr(h, "ids", ids), lambda h: h.ids),
    "OrderedDict": _on("helper", collections.OrderedDict, lambda h, ids: h.__setitem__("ids", ids), lambda h: h["ids"]),
    "defaultdict": _on(
        "helper", lambda: collections.defaultdict(list), lambda h, ids: h.__setitem__("ids", ids), lambda h: h["ids"]
    ),
    "deque": _on("helper", collections.deque, lambda h, ids: (h.clear(), h.extend(ids)), list),
    "threading.local": _on("helper", threading.local, lambda h, ids: setattr(h, "ids", ids), lambda h: h.ids),
    # A configuration object changed in place.
    "PretrainedConfig": _on("request_config", _transformers_config, _set_config_ids, lambda c: c.pending_ids),
    "from_config class": _on("request_config", RequestConfig, lambda c, ids: setattr(c, "ids", ids), lambda c: c.ids),
    "text encoder config": Hidden(
        _nothing,
        lambda p, ids: _set_config_ids(p.text_encoder.config, ids),
        lambda p: p.text_encoder.config.pending_ids,
    ),
    # Outside the pipeline.
    "module-level dict": Hidden(
        _nothing, lambda p, ids: MODULE_REQUESTS.__setitem__("ids", ids), lambda p: MODULE_REQUESTS["ids"]
    ),
    "ContextVar": Hidden(_nothing, lambda p, ids: CURRENT_IDS.set(ids), lambda p: CURRENT_IDS.get()),
    # A per-request callable on the pipeline.
    "lambda": Hidden(_nothing, lambda p, ids: setattr(p, "next_ids", lambda: ids), lambda p: p.next_ids()),
    "bound method": Hidden(_nothing, lambda p, ids: setattr(p, "next_ids", Box(ids).ids), lambda p: p.next_ids()),
    # Read around attribute access.
    "__dict__": Hidden(_nothing, lambda p, ids: p.__dict__.__setitem__("_ids", ids), lambda p: p.__dict__["_ids"]),
    "vars()": Hidden(_nothing, lambda p, ids: vars(p).__setitem__("_ids", ids), lambda p: vars(p)["_ids"]),
    "object.__getattribute__": Hidden(
        _nothing,
        lambda p, ids: object.__setattr__(p, "_ids", ids),
        lambda p: object.__getattribute__(p, "_ids"),
    ),
    "class attribute": Hidden(
        _nothing, lambda p, ids: setattr(type(p), "pending_ids", ids), lambda p: type(p).pending_ids
    ),
}


def run_encoder(pipeline: HiddenIdsPipeline, ids: list[int]) -> torch.Tensor:
    """Run the pipeline's text encoder on ``ids`` (a function, not a method: the encode is the method calling it)."""
    input_ids, mask = padded(ids)
    return pipeline.text_encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state


class HiddenIdsPipeline(CountsEncoderRuns, torch.nn.Module):
    """Encodes the ids ``read_ids`` finds, whatever the prompt text; ``forward`` runs the encode found by
    watching (``_embed_request``) and then a stand-in DiT, as a rollout adapter's forward does. ``encoder_runs``
    counts the text encoder's real forwards (a hook on the encoder: a call the cache answers runs none)."""

    hidden: Hidden

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.dit = torch.nn.Linear(4, 4)
        self.count_encoder_calls(encoder)
        self.hidden.setup(self)

    def read_ids(self) -> list[int]:
        return self.hidden.read(self)

    @torch.inference_mode()
    def encode_prompt(self, prompt: str = "[pretokenized]", max_sequence_length: int = LENGTH) -> torch.Tensor:
        return run_encoder(self, self.read_ids())

    @torch.inference_mode()
    def _embed_request(self, prompt: str) -> torch.Tensor:
        return run_encoder(self, self.read_ids())

    @torch.inference_mode()
    def forward(self, prompt: str = "[pretokenized]") -> torch.Tensor:
        embeds = self._embed_request(prompt)
        self.dit(torch.zeros(4))
        return embeds


class FoundByWatching(HiddenIdsPipeline):
    """The same pipeline without an ``encode_prompt``: its encode is found by watching its text encoder."""

    encode_prompt = None  # type: ignore[assignment]


def pipeline_for(name: str, found: bool, encoder: torch.nn.Module) -> HiddenIdsPipeline:
    """A fresh class per case, so a class attribute set per request stays in its own case."""
    base = FoundByWatching if found else HiddenIdsPipeline
    kind = type(f"{base.__name__}_{len(name)}", (base,), {"hidden": HIDDEN[name]})
    return kind(encoder)


def run_sequence(pipeline: HiddenIdsPipeline, reference: torch.nn.Module, found: bool, sequence: str = SEQUENCE) -> int:
    """Send ``sequence``'s prompts, each stashed where the pipeline keeps them; return how many were served wrong."""
    wrong = 0
    for name in sequence:
        pipeline.hidden.stash(pipeline, PROMPTS[name])
        served = pipeline("[pretokenized]") if found else pipeline.encode_prompt("[pretokenized]")
        wrong += not torch.equal(served, embed(reference, PROMPTS[name]))
    return wrong


@pytest.mark.parametrize("found", [False, True], ids=["encode_prompt", "found by watching"])
@pytest.mark.parametrize("name", list(HIDDEN))
def test_no_wrong_embedding_wherever_the_ids_are_kept(encoder, reference, name: str, found: bool) -> None:
    pipeline = pipeline_for(name, found, encoder)
    cache = install_prompt_embed_cache(pipeline)
    assert run_sequence(pipeline, reference, found) == 0
    stats = cache.stats()
    method = "_embed_request" if found else "encode_prompt"
    assert stats["encode_methods"][method]["state"] == "cached", stats["encode_methods"]
    # Each distinct prompt encoded once (the bound the old design had, which let a method found by watching run
    # twice uncached), the repeats answered from the cache: real forwards of the encoder, counted by its hook.
    assert pipeline.encoder_runs <= len(set(SEQUENCE)) + (2 if found else 0)
    assert stats["hits"] >= 2


def test_a_served_tensor_the_caller_changes_in_place_is_never_served_again(encoder, reference) -> None:
    """vLLM-Omni runs forwards under ``torch.inference_mode()``, whose tensors keep no version counter. The entry is
    what the encoder computed, and every call is handed fresh copies of it: a write into one reaches no entry (none
    is found changed, none dropped), and the repeats are still answered."""
    pipeline = pipeline_for("ContextVar", False, encoder)
    cache = install_prompt_embed_cache(pipeline)
    wrong = 0
    with torch.inference_mode():
        for name in SEQUENCE:
            HIDDEN["ContextVar"].stash(pipeline, PROMPTS[name])
            served = pipeline.encode_prompt("[pretokenized]")
            wrong += not torch.equal(served, embed(reference, PROMPTS[name]))
            served.mul_(2)  # the caller scales the embedding it was handed, in place
    assert wrong == 0
    stats = cache.stats()
    assert stats["changed_entries"] == 0 and stats["hits"] >= 2
    assert pipeline.encoder_runs <= len(set(SEQUENCE))


# --- What the encode does besides its encoder call runs for real, on every call ---------------------------------


def test_a_count_read_before_the_encoder_and_used_after_it_counts_every_call_as_uncached(encoder, reference) -> None:
    """Instrumentation whose value shapes the output (read again after the encoder) is no instrumentation: the encode
    runs for real on every call, so its count, and the output it scales, are the uncached twin's."""

    class ScalesByItsCount(HiddenIdsPipeline):
        hidden = HIDDEN["ContextVar"]

        @torch.inference_mode()
        def encode_prompt(self, prompt: str = "[pretokenized]", max_sequence_length: int = LENGTH) -> torch.Tensor:
            self.calls = getattr(self, "calls", 0) + 1
            return run_encoder(self, self.read_ids()) * self.calls

    pipeline, twin = ScalesByItsCount(encoder), ScalesByItsCount(reference)
    cache = install_prompt_embed_cache(pipeline)
    wrong = 0
    for name in SEQUENCE:
        for each in (pipeline, twin):
            each.hidden.stash(each, PROMPTS[name])
        wrong += not torch.equal(pipeline.encode_prompt(), twin.encode_prompt())
    assert wrong == 0
    assert pipeline.calls == twin.calls == len(SEQUENCE)
    assert cache.stats()["encode_methods"]["encode_prompt"]["state"] == "cached"
    assert pipeline.encoder_runs <= len(set(SEQUENCE)) and cache.stats()["hits"] >= 2


def test_a_stash_consumed_by_an_encode_no_encoder_of_which_is_seen_serves_nothing_wrong(reference) -> None:
    """No token table the cache recognises (a one-hot product, no ``nn.Embedding``, no ``F.embedding``): what the
    encode reads and then clears decides its output, and every call must still be its own prompt's."""

    class OneHotEncoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(1024, 8, generator=torch.Generator().manual_seed(1)))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.one_hot(ids, 1024).to(self.weight.dtype) @ self.weight

    class ConsumesAStash(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.text_encoder = OneHotEncoder()

        @torch.inference_mode()
        def encode_prompt(self, prompt: str = "[pretokenized]") -> torch.Tensor:
            ids, self._pending = self._pending, None
            return self.text_encoder(padded(ids)[0])

    pipeline, twin = ConsumesAStash(), ConsumesAStash()
    install_prompt_embed_cache(pipeline)
    wrong = 0
    for name in SEQUENCE:
        pipeline._pending = twin._pending = PROMPTS[name]
        wrong += not torch.equal(pipeline.encode_prompt(), twin.encode_prompt())
    assert wrong == 0


def test_a_served_tensor_the_caller_changes_in_place_reaches_no_entry_on_the_host_tier(encoder, reference) -> None:
    """A's hit is written into before B's entry pushes A's to host memory: what comes back from there is A's."""
    pipeline = pipeline_for("ContextVar", False, encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=1, settings=PromptEmbedCacheSettings(host_bytes=2**24))
    wrong = 0
    with torch.inference_mode():
        for name in "AABA":
            HIDDEN["ContextVar"].stash(pipeline, PROMPTS[name])
            served = pipeline.encode_prompt("[pretokenized]")
            wrong += not torch.equal(served, embed(reference, PROMPTS[name]))
            served.add_(1)  # A's hit is written into before B's entry pushes it to host memory
    assert wrong == 0
    stats = cache.stats()
    assert stats["changed_entries"] == 0 and stats["host_hits"] >= 1, stats


def test_an_encode_that_catches_everything_around_its_encoder_is_served(encoder, reference) -> None:
    """An adapter that catches everything around its encoder (``except BaseException``) runs as written: nothing the
    cache does raises into it, and its repeats are answered from the cache."""

    class CatchesEverything(HiddenIdsPipeline):
        hidden = HIDDEN["ContextVar"]

        @torch.inference_mode()
        def encode_prompt(self, prompt: str = "[pretokenized]", max_sequence_length: int = LENGTH) -> torch.Tensor:
            try:
                return run_encoder(self, self.read_ids())
            except BaseException:
                return torch.zeros(1, LENGTH, 64)

    pipeline = CatchesEverything(encoder)
    cache = install_prompt_embed_cache(pipeline)
    assert run_sequence(pipeline, reference, False) == 0
    assert cache.stats()["hits"] >= 2
    assert pipeline.encoder_runs <= len(set(SEQUENCE))


# --- Threads ------------------------------------------------------------------------------------------------------


class HeldAdapter(CountsEncoderRuns, torch.nn.Module):
    """A token-ID adapter whose encode method no code of ours names (it is found by watching the encoder);
    ``hold`` runs inside each encode, after the encoder call."""

    def __init__(self, encoder: torch.nn.Module, hold: Callable[[], None]) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.dit = torch.nn.Linear(4, 4)
        self.hold = hold
        self.count_encoder_calls(encoder)

    @torch.inference_mode()
    def _embed_ids(self, token_ids: list[int]) -> torch.Tensor:
        hidden = self.text_encoder(input_ids=padded(token_ids)[0]).last_hidden_state
        self.hold()
        return hidden

    @torch.inference_mode()
    def forward(self, token_ids: list[int]) -> torch.Tensor:
        return self.dit(self._embed_ids(token_ids)[..., :4])


def _ids(seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1000, (5 + seed % 7,), generator=generator).tolist()


def test_two_threads_in_a_found_methods_first_calls_are_each_served_right_and_counted_once(encoder, reference) -> None:
    """Two threads call a method found by watching the encoder from its first calls on; one is held inside its first
    encode (after its encoder call) until the other has missed and then hit. Every call returns its own prompt's
    uncached encode and is counted once, under the method's name; each prompt is encoded once."""
    rounds = 6
    prompts = [_ids(seed) for seed in range(4)]
    with torch.inference_mode():
        expected = [reference(input_ids=padded(prompt)[0]).last_hidden_state for prompt in prompts]
    held_inside = threading.Event()  # thread B is inside its first encode
    released = threading.Event()  # thread A has missed and hit meanwhile
    thread_b: list[threading.Thread] = []

    def hold() -> None:
        if thread_b and threading.current_thread() is thread_b[0] and not held_inside.is_set():
            held_inside.set()
            released.wait(20)

    pipeline = HeldAdapter(encoder, hold)
    cache = install_prompt_embed_cache(pipeline, max_size=64)
    pipeline(_ids(99))  # the encoder runs outside every wrapped method: _embed_ids is found and wrapped
    assert cache.stats()["encode_methods"]["_embed_ids"]["state"] == "cached"
    counted = cache.hits + cache.misses + cache.bypassed
    barrier = threading.Barrier(2)
    calls, wrong = [0, 0], []

    def call(index: int, prompt: int) -> None:
        got = pipeline._embed_ids(list(prompts[prompt]))
        calls[index] += 1
        if not torch.equal(got, expected[prompt]):
            wrong.append((index, prompt))

    def first(index: int) -> None:  # A: a miss and a hit while B is held inside its first encode
        barrier.wait(20)
        assert held_inside.wait(20), "thread B never reached its first encode"
        call(index, 0)
        call(index, 0)
        released.set()

    def second(index: int) -> None:  # B: its first call, held inside its encode until A is past its own
        barrier.wait(20)
        call(index, 1)

    def repeat(index: int, start: threading.Barrier) -> None:
        for round_ in range(rounds):
            start.wait(20)
            call(index, (index + round_) % len(prompts))

    _run_in_two_threads(first, second, thread_b)
    start = threading.Barrier(2)
    _run_in_two_threads(lambda index: repeat(index, start), lambda index: repeat(index, start), [])
    assert released.is_set() and held_inside.is_set()
    assert wrong == []
    stats = cache.stats()
    assert stats["hits"] + stats["misses"] + stats["bypassed"] - counted == sum(calls) == 3 + 2 * rounds
    assert stats["bypassed"] == 0
    method = stats["methods"]["_embed_ids"]
    assert method["hits"] + method["misses"] == sum(calls) + 1  # the call that found it too
    assert pipeline.encoder_runs <= 1 + len(prompts)  # _ids(99), then each prompt once


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


# --- EncoderCalls.refresh: a replaced text encoder is intercepted again ----------------------------------------


def _forwards(module: torch.nn.Module) -> list[int]:
    """A list that grows by one on each real forward of ``module`` (a call the cache answers runs none)."""
    ran: list[int] = []
    module.register_forward_hook(lambda *_: ran.append(1))
    return ran


def test_a_replaced_text_encoder_of_a_pipeline_that_is_no_torch_module_is_intercepted_again(encoder) -> None:
    """A pipeline need not be a torch module; its children are then its attributes. ``refresh`` tells a replaced
    text encoder from what those attributes hold, intercepts the new one's calls and drops the old one's entries:
    the new encoder's repeat is answered, and nothing it is served is the old encoder's."""
    ids = padded([1, 2])[0]
    pipeline = types.SimpleNamespace(text_encoder=encoder, steps=1)
    store = PromptEmbedCache()
    calls = EncoderCalls(pipeline, store, "test")
    try:
        for seed in (0, 1):  # the encoder it was made with (seed 0), then another one's weights
            if seed:
                pipeline.text_encoder, pipeline.steps = build_qwen2_encoder(seed=seed), 2
                calls.refresh()
                assert len(store) == 0  # the old encoder's entries are dropped
            with torch.inference_mode():
                expected = build_qwen2_encoder(seed=seed)(input_ids=ids).last_hidden_state
                forwards = _forwards(pipeline.text_encoder)
                served = [pipeline.text_encoder(input_ids=ids).last_hidden_state for _ in range(2)]
            assert all(torch.equal(each, expected) for each in served)
            assert len(forwards) == 1  # the repeat answered: the encoder's calls are intercepted
    finally:
        calls.remove()


def test_refresh_reads_a_pipeline_another_thread_adds_attributes_to(encoder) -> None:
    """A pipeline that is no torch module holds its children among all its attributes, which another thread's call
    may add to at any time (a diffusers pipeline sets ``self._guidance_scale`` and the like as it runs). ``refresh``,
    on every call of a wrapped method, must not raise out of the user's call: each look is of a copy made at once.
    (Forced thread switches every microsecond: walking the live attributes raised in about 4 % of the looks.)"""
    import sys

    pipeline = types.SimpleNamespace(text_encoder=encoder, **{f"setting_{i}": i for i in range(40)})
    calls = EncoderCalls(pipeline, PromptEmbedCache(), "test")
    stop = threading.Event()

    def adds_and_removes_attributes() -> None:
        while not stop.is_set():
            for i in range(50):
                setattr(pipeline, f"_during_call_{i}", i)
            for i in range(50):
                delattr(pipeline, f"_during_call_{i}")

    interval = sys.getswitchinterval()
    other = threading.Thread(target=adds_and_removes_attributes)
    raised = []
    sys.setswitchinterval(1e-6)
    other.start()
    try:
        for _ in range(5000):
            try:
                calls.refresh()
                assert list(child_modules(pipeline)) == ["text_encoder"]
            except RuntimeError as error:
                raised.append(str(error))
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(interval)
        calls.remove()
    assert raised == []


def test_refresh_looks_for_encoders_again_only_when_a_child_module_is_replaced(encoder) -> None:
    """Each call of a wrapped method asks for a refresh; scanning every module of every child each time would cost
    a 7B encoder's worth of module walks per call. It rescans when a child is replaced, and the text encoder's calls
    are still intercepted then."""
    pipeline = pipeline_for("ContextVar", False, encoder)
    calls = EncoderCalls(pipeline, PromptEmbedCache(), "test")
    walks = []
    original = torch.nn.Module.modules

    def counted_modules(module):
        walks.append(module)
        return original(module)

    torch.nn.Module.modules = counted_modules
    try:
        for _ in range(3):
            calls.refresh()
        assert walks == []  # nothing replaced since it was made
        pipeline.dit = torch.nn.Linear(4, 4)  # a child replaced, not a text encoder
        for _ in range(3):
            calls.refresh()
        assert len([module for module in walks if module is pipeline.dit]) == 1  # looked at once, not per call
    finally:
        torch.nn.Module.modules = original
    try:
        for _ in range(2):
            run_encoder(pipeline, [1, 2])
        assert pipeline.encoder_runs == 1  # the repeat answered: still intercepted
    finally:
        calls.remove()
