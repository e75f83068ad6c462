"""Proven hits: no wrong embedding, wherever an adapter keeps a request's token ids.

Each case is a pipeline with a real (tiny, random-weight) transformers text encoder whose encode takes
the same arguments for every prompt and finds the request's ids somewhere else: on a component, in a
helper object made at ``__init__``, in a config changed in place, outside the pipeline, behind a
callable, or around attribute access. The request sequence A, A, A, B, A, C, B repeats A truly before
anything changes, so a cache that trusts its key alone serves A's embedding for B. With default
settings, through the public ``install_prompt_embed_cache``, every call must equal the uncached encode
of its own ids, both when the encode is ``encode_prompt`` and when it is a method found by watching the
encoder (``_embed_request`` below, called from ``forward``). A hit is proven by what reaches the text
encoder (``encoder_gate.py``), so each distinct prompt is still encoded once.
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
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
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


@pytest.fixture(scope="module")
def encoder() -> torch.nn.Module:
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
    hidden = pipeline.text_encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state
    pipeline.encoder_runs += 1  # once the encoder ran: a hit runs the encode up to its encoder call only
    return hidden


class HiddenIdsPipeline(CountsEncoderRuns, torch.nn.Module):
    """Encodes the ids ``read_ids`` finds, whatever the prompt text; ``forward`` runs the encode found by
    watching (``_embed_request``) and then a stand-in DiT, as a rollout adapter's forward does."""

    hidden: Hidden

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.dit = torch.nn.Linear(4, 4)
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


def run_sequence(pipeline: HiddenIdsPipeline, encoder: torch.nn.Module, found: bool, sequence: str = SEQUENCE) -> int:
    """Send ``sequence``'s prompts, each stashed where the pipeline keeps them; return how many were served wrong."""
    wrong = 0
    for name in sequence:
        pipeline.hidden.stash(pipeline, PROMPTS[name])
        served = pipeline("[pretokenized]") if found else pipeline.encode_prompt("[pretokenized]")
        wrong += not torch.equal(served, embed(encoder, PROMPTS[name]))
    return wrong


@pytest.mark.parametrize("found", [False, True], ids=["encode_prompt", "found by watching"])
@pytest.mark.parametrize("name", list(HIDDEN))
def test_no_wrong_embedding_wherever_the_ids_are_kept(encoder, name: str, found: bool) -> None:
    pipeline = pipeline_for(name, found, encoder)
    cache = install_prompt_embed_cache(pipeline)
    assert run_sequence(pipeline, encoder, found) == 0
    stats = cache.stats()
    method = "_embed_request" if found else "encode_prompt"
    assert stats["encode_methods"][method]["state"] == "cached", stats["encode_methods"]
    # Each distinct prompt encoded once (a method found by watching: its first two calls reveal and observe it,
    # uncached), the others served proven.
    assert pipeline.encoder_runs <= len(set(SEQUENCE)) + (2 if found else 0)
    assert stats["proven_hits"] >= 2


def test_a_served_tensor_the_caller_changes_in_place_is_never_served_again(encoder) -> None:
    """vLLM-Omni runs forwards under ``torch.inference_mode()``, whose tensors keep no version counter: the cache
    keeps normal copies, whose counter a write inside inference mode still moves, and drops a changed entry."""
    pipeline = pipeline_for("ContextVar", False, encoder)
    cache = install_prompt_embed_cache(pipeline)
    wrong = 0
    with torch.inference_mode():
        for name in SEQUENCE:
            HIDDEN["ContextVar"].stash(pipeline, PROMPTS[name])
            served = pipeline.encode_prompt("[pretokenized]")
            wrong += not torch.equal(served, embed(encoder, PROMPTS[name]))
            served.mul_(2)  # the caller scales the embedding it was handed, in place
    assert wrong == 0
    stats = cache.stats()
    assert stats["changed_entries"] >= 2 and stats["hits"] >= 2


# --- Where a proof must not be taken at its word ------------------------------------------------------------


def test_a_count_read_before_the_encoder_and_used_after_it_keeps_the_method_uncached(encoder) -> None:
    """Instrumentation whose value shapes the output (read again after the encoder) is no instrumentation."""

    class ScalesByItsCount(HiddenIdsPipeline):
        hidden = HIDDEN["ContextVar"]

        @torch.inference_mode()
        def encode_prompt(self, prompt: str = "[pretokenized]", max_sequence_length: int = LENGTH) -> torch.Tensor:
            self.calls = getattr(self, "calls", 0) + 1
            return run_encoder(self, self.read_ids()) * self.calls

    pipeline, reference = ScalesByItsCount(encoder), ScalesByItsCount(encoder)
    cache = install_prompt_embed_cache(pipeline)
    wrong = 0
    for name in SEQUENCE:
        for each in (pipeline, reference):
            each.hidden.stash(each, PROMPTS[name])
        wrong += not torch.equal(pipeline.encode_prompt(), reference.encode_prompt())
    assert wrong == 0
    assert cache.stats()["encode_methods"]["encode_prompt"]["refusal"] == (
        "changes self.calls, read before its text encoder and again after: a hit could not repeat it"
    )


def test_a_stash_consumed_by_an_encode_no_encoder_of_which_is_seen_stays_keyed(encoder) -> None:
    """No nn.Embedding, so no proof: what the encode reads and then clears is keyed and replayed, not skipped."""

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

    pipeline = ConsumesAStash()
    cache = install_prompt_embed_cache(pipeline)
    wrong = 0
    for name in SEQUENCE:
        pipeline._pending = PROMPTS[name]
        with torch.inference_mode():
            expected = pipeline.text_encoder(padded(PROMPTS[name])[0])
        wrong += not torch.equal(pipeline.encode_prompt(), expected)
    assert wrong == 0
    keyed_on = cache.stats()["encode_methods"]["encode_prompt"]["keyed_on"]
    assert "self._pending (content)" in keyed_on and cache.stats()["hits"] >= 2


def test_an_entry_without_a_record_is_proven_once_the_method_records(encoder) -> None:
    """An entry no encode of this process recorded (upstream's ``put``, a file of another version) is not served
    on its key alone: the call encodes, and what it encoded is kept beside it."""
    pipeline = pipeline_for("ContextVar", False, encoder)
    cache = install_prompt_embed_cache(pipeline)
    HIDDEN["ContextVar"].stash(pipeline, PROMPTS["A"])
    pipeline.encode_prompt("[pretokenized]")
    calls = pipeline._prompt_embed_cache_installation.methods["encode_prompt"]
    key = calls.key_builder.build(("[pretokenized]",), {})
    cache.put(key, torch.zeros(1, LENGTH, 64))  # no record, and not A's embedding
    served = pipeline.encode_prompt("[pretokenized]")
    assert torch.equal(served, embed(encoder, PROMPTS["A"]))
    assert cache.stats()["unproven_reasons"] == {"the entry holds no encoder-input record": 1}


def test_an_entry_changed_in_place_is_not_moved_to_the_host_tier(encoder) -> None:
    pipeline = pipeline_for("ContextVar", False, encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=1, settings=PromptEmbedCacheSettings(host_bytes=2**24))
    wrong = 0
    with torch.inference_mode():
        for name in "AABA":
            HIDDEN["ContextVar"].stash(pipeline, PROMPTS[name])
            served = pipeline.encode_prompt("[pretokenized]")
            wrong += not torch.equal(served, embed(encoder, PROMPTS[name]))
            served.add_(1)  # A's hit is written into before B's entry pushes it to host memory
    assert wrong == 0 and cache.stats()["changed_entries"] >= 1


def test_a_proof_the_encode_swallows_is_still_a_proof(encoder) -> None:
    """An adapter that catches everything around its encoder (``except BaseException``) cannot turn a hit's
    stopped run into an entry: the proof counts, the swallowed run's result is not kept."""

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
    assert run_sequence(pipeline, encoder, False) == 0
    assert cache.stats()["proven_hits"] >= 2


def test_the_gate_hooks_a_replaced_text_encoder_of_a_pipeline_that_is_no_torch_module(encoder) -> None:
    """A pipeline need not be a torch module; its children are then its attributes. The gate tells a replaced one
    from what those attributes hold, and records the new text encoder's calls (unhooked, a run records none)."""
    from vllm_omni_prompt_cache.proof.encoder_gate import EncoderGate

    pipeline = types.SimpleNamespace(text_encoder=encoder, steps=1)
    gate = EncoderGate(pipeline)
    for replacement in (None, build_qwen2_encoder()):
        if replacement is not None:
            pipeline.text_encoder, pipeline.steps = replacement, 2
        with gate.run() as run:
            pipeline.text_encoder(input_ids=padded([1, 2])[0])
        assert type(run.record) is str and len(run.calls) == 1
    gate.remove()


def test_the_gate_reads_a_pipeline_another_thread_adds_attributes_to(encoder) -> None:
    """A pipeline that is no torch module holds its children among all its attributes, which another thread's call
    may add to at any time (a diffusers pipeline sets ``self._guidance_scale`` and the like as it runs). The gate's
    look at them, on every run, must not raise out of the user's call: each look is of a copy made at once. (Forced
    thread switches every microsecond: walking the live attributes raised in about 4 % of the looks here.)"""
    import sys

    from vllm_omni_prompt_cache.encoders.text_encoders import child_modules
    from vllm_omni_prompt_cache.proof.encoder_gate import EncoderGate

    pipeline = types.SimpleNamespace(text_encoder=encoder, **{f"setting_{i}": i for i in range(40)})
    gate = EncoderGate(pipeline)
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
                gate.refresh()
                assert list(child_modules(pipeline)) == ["text_encoder"]
            except RuntimeError as error:
                raised.append(str(error))
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(interval)
        gate.remove()
    assert raised == []


def test_the_gate_looks_for_encoders_again_only_when_a_child_module_is_replaced(encoder) -> None:
    """Each encode and each proof asks the gate to refresh; scanning every module of every child each time
    would cost a 7B encoder's worth of module walks per hit. It rescans when a child is replaced, and hooks a
    new text encoder then."""
    from vllm_omni_prompt_cache.proof.encoder_gate import EncoderGate

    pipeline = pipeline_for("ContextVar", False, encoder)
    gate = EncoderGate(pipeline)
    walks = []
    original = torch.nn.Module.modules

    def counted_modules(module):
        walks.append(module)
        return original(module)

    torch.nn.Module.modules = counted_modules
    try:
        for _ in range(3):
            gate.refresh()
        assert walks == []  # nothing replaced since the gate was made
        pipeline.dit = torch.nn.Linear(4, 4)  # a child replaced, not a text encoder
        for _ in range(3):
            gate.refresh()
        assert len([module for module in walks if module is pipeline.dit]) == 1  # looked at once, not per run
    finally:
        torch.nn.Module.modules = original
    with gate.run() as run:
        pipeline.text_encoder(input_ids=padded([1, 2])[0])
    assert type(run.record) is str
    gate.remove()
