"""A proof run leaves nothing behind.

A hit's proof runs the method's whole code with each text-encoder call answered by a stand-in
(``encoder_gate.py``, ``stand_ins.py``), and a miss runs it once more so (the reference run). What that code
writes after the encoder call would carry stand-in data. Each place such a write can land is tried here, for
``encode_prompt`` and for a method found by watching, with the A, A, A, B, A, C, B sequence and an uncached twin:

* an attribute of the pipeline: put back, then the entry's recorded write replayed (the method stays cached);
* an attribute of a component (the text encoder), a helper object made at ``__init__`` (a tensor computed from the
  encoder's output, or that output itself), a list the caller passed in, a module-level dict: the cache cannot put
  them back, so the method is not cached, and the real encode writes them over.

After every call, the place holds what the twin's holds, and every served value equals the twin's.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.proof.verdicts import LEFT_BEHIND
from vllm_omni_prompt_cache.tiny.text_encoder import build_qwen2_encoder

PROMPTS = {"A": [5, 17, 29, 3], "B": [88, 41, 7, 7, 90, 12], "C": [600, 2]}
SEQUENCE = "AAABACB"
GLOBAL_PLACE: dict[int, torch.Tensor] = {}


class KeepsItsOutput(torch.nn.Module):
    """A token-ID encode (mirrors no adapter) that keeps a projection of the encoder's output somewhere after the
    encoder call: ``place`` says where. The ids are an argument, so keys differ per prompt."""

    def __init__(self, encoder: torch.nn.Module, place: str) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.dit = torch.nn.Linear(4, 4)
        self.helper = types.SimpleNamespace(last=None)
        self.place = place

    def _keep(self, kept: torch.Tensor, hidden: torch.Tensor, outputs: list | None) -> None:
        if self.place == "pipeline":
            self.last_pooled = kept
        elif self.place == "component":
            self.text_encoder.last_pooled = kept
        elif self.place == "helper":
            self.helper.last = kept
        elif self.place == "raw output in a helper":  # the encoder's output itself, not a tensor computed from it
            self.helper.last = hidden
        elif self.place == "argument":
            assert outputs is not None
            outputs.append(hidden)
        else:
            GLOBAL_PLACE[id(self)] = kept

    def kept(self) -> torch.Tensor | None:
        return {
            "pipeline": lambda: getattr(self, "last_pooled", None),
            "component": lambda: getattr(self.text_encoder, "last_pooled", None),
            "helper": lambda: self.helper.last,
            "raw output in a helper": lambda: self.helper.last,
            "argument": lambda: None,  # compared through the caller's list
            "global": lambda: GLOBAL_PLACE.get(id(self)),
        }[self.place]()

    def _encode(self, prompt_ids: torch.Tensor, outputs: list | None) -> torch.Tensor:
        hidden = self.text_encoder(input_ids=prompt_ids).last_hidden_state
        self._keep(hidden.mean(dim=1), hidden, outputs)  # a tensor computed from the encoder's output, or itself
        return hidden * 1

    @torch.inference_mode()
    def encode_prompt(self, prompt_ids: torch.Tensor, outputs: list | None = None) -> torch.Tensor:
        return self._encode(prompt_ids, outputs)

    @torch.inference_mode()
    def embed_request(self, prompt_ids: torch.Tensor, outputs: list | None = None) -> torch.Tensor:
        return self._encode(prompt_ids, outputs)

    @torch.inference_mode()
    def forward(self, prompt_ids: torch.Tensor, outputs: list | None = None) -> torch.Tensor:
        embeds = self.embed_request(prompt_ids, outputs)
        self.dit(torch.zeros(4))
        return embeds


def _serve(pipeline: KeepsItsOutput, found: bool) -> Callable[..., torch.Tensor]:
    return pipeline if found else pipeline.encode_prompt


def _equal(left: Any, right: Any) -> bool:
    return (left is None and right is None) or (left is not None and right is not None and torch.equal(left, right))


@pytest.fixture(scope="module")
def encoder() -> torch.nn.Module:
    return build_qwen2_encoder()


@pytest.mark.parametrize("found", [False, True], ids=["encode_prompt", "found by watching"])
@pytest.mark.parametrize("place", ["pipeline", "component", "helper", "raw output in a helper", "argument", "global"])
def test_what_a_proof_run_writes_after_the_encoder_is_not_left_behind(encoder, place: str, found: bool) -> None:
    pipeline, twin = KeepsItsOutput(encoder, place), KeepsItsOutput(build_qwen2_encoder(), place)
    if found:
        pipeline.encode_prompt = None  # type: ignore[assignment]
    cache = install_prompt_embed_cache(pipeline)
    wrong = left = 0
    for name in SEQUENCE:
        ids = torch.tensor([PROMPTS[name]])
        outputs: list = []
        twin_outputs: list = []
        wrong += not torch.equal(_serve(pipeline, found)(ids, outputs), twin.encode_prompt(ids, twin_outputs))
        left += not _equal(pipeline.kept(), twin.kept())
        left += len(outputs) != len(twin_outputs) or not all(map(torch.equal, outputs, twin_outputs))
    assert wrong == 0
    assert left == 0
    (described,) = cache.stats()["encode_methods"].values()  # encode_prompt, or the method found by watching
    if place == "pipeline":
        assert described["state"] == "cached" and cache.stats()["proven_hits"] >= 2
    elif place == "argument" and found:  # a method found by watching is refused at its first use for it
        assert described["refusal"] == "it changes its arguments in place, which a hit could not repeat"
    else:
        assert described["refusal"] == LEFT_BEHIND


def test_the_guard_follows_writes_into_a_real_tensor_and_not_reads_of_it() -> None:
    """A real tensor indexed with stand-in data stays real (``__getitem__`` reads it); one a stand-in is written into,
    by an in-place method, item assignment or an augmented assignment, carries stand-in data."""
    from vllm_omni_prompt_cache.proof.stand_ins import ProofGuard

    stand_in = torch.tensor([0, 2])
    read, added, assigned, augmented = (torch.arange(4.0) for _ in range(4))
    guard = ProofGuard()
    guard.plant(stand_in)
    with guard:
        picked = read[stand_in]
        added.add_(stand_in.float().sum())
        assigned[stand_in] = 7.0
        augmented += stand_in.float().sum()
    assert picked in guard.tainted  # computed from a stand-in
    assert read not in guard.tainted
    assert all(tensor in guard.tainted for tensor in (added, assigned, augmented))


class ScalesItsOutputInPlace(torch.nn.Module):
    """A token-ID encode (mirrors no adapter) that post-processes the encoder's output in place, as code that masks
    or scales hidden states without a copy does: every proof run writes into its stand-in."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder

    @torch.inference_mode()
    def encode_prompt(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.text_encoder(input_ids=prompt_ids).last_hidden_state
        hidden.mul_(2).add_(1)
        return hidden[:, 1:].clone()  # a tensor of its own, not a view of the output written into


def test_a_run_that_writes_into_its_stand_in_leaves_the_next_run_fresh_numbers(encoder) -> None:
    """Every proof run writes into its stand-in in place; each run gets copies of the numbers its pipeline keeps
    (``stand_ins.StandIns``), so the next starts from the numbers the record was made with: every repeat is proven,
    none encoded again."""
    pipeline, twin = ScalesItsOutputInPlace(encoder), ScalesItsOutputInPlace(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline)
    ids = torch.tensor([PROMPTS["A"]])
    for _ in range(4):
        assert torch.equal(pipeline.encode_prompt(ids), twin.encode_prompt(ids))
    stats = cache.stats()
    assert (stats["misses"], stats["proven_hits"]) == (1, 3), stats


def test_stand_ins_are_copies_of_numbers_made_once_per_pipeline(monkeypatch) -> None:
    """A pipeline's gate keeps each stand-in's numbers (``StandIns``) and hands every run copies: equal values in
    storage of its own, so no write a run makes, tracked or not, reaches what a later run starts from."""
    from vllm_omni_prompt_cache.proof import stand_ins
    from vllm_omni_prompt_cache.proof.encoder_gate import EncoderGate
    from vllm_omni_prompt_cache.proof.stand_ins import StandIns, stand_in, structure_of

    gate = EncoderGate(types.SimpleNamespace())  # a pipeline with no child modules
    with gate.run() as gate_run:
        assert gate_run.stand_ins is gate.stand_ins  # one pipeline's runs share its numbers

    structure = structure_of((torch.zeros(2, 3), [torch.zeros(4, 5000, dtype=torch.bfloat16)]))
    kept = StandIns()
    made = []
    real_tensor = stand_ins._tensor
    monkeypatch.setattr(stand_ins, "_tensor", lambda *spelled: made.append(spelled) or real_tensor(*spelled))
    first, second = kept.make(structure, "0", None), kept.make(structure, "0", None)
    assert len(made) == 2  # the two tensors' numbers, made once
    assert torch.equal(first[0], stand_in(structure, "0")[0]) and torch.equal(first[1][0], second[1][0])
    assert first[0].data_ptr() != second[0].data_ptr() and first[1][0].data_ptr() != second[1][0].data_ptr()
    assert not torch.equal(first[0], kept.make(structure, "1", None)[0])  # another call index, other numbers
    pristine = second[0].clone()
    first[0].data.mul_(3)  # through .data: no version counter moves
    first[1][0].data.zero_()
    third = kept.make(structure, "0", None)
    assert torch.equal(third[0], pristine) and torch.equal(third[1][0], second[1][0])


#: Read by :class:`ScalesThroughData` after its encoder call: state no key and no trace holds.
SCALE = [2.0]


class ScalesThroughData(torch.nn.Module):
    """A token-ID encode (mirrors no adapter) that scales the encoder's output in place by a module-level number,
    through ``.data`` or a NumPy view: writes torch's version counter does not see."""

    def __init__(self, encoder: torch.nn.Module, through: str) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.through = through

    @torch.inference_mode()
    def encode_prompt(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.text_encoder(input_ids=prompt_ids).last_hidden_state
        if self.through == "data":
            hidden.data.mul_(SCALE[0])
        else:
            with torch.inference_mode(False):
                hidden.numpy()[...] *= SCALE[0]
        return hidden.clone()


@pytest.mark.parametrize("through", ["data", "numpy"])
def test_a_write_into_a_stand_in_torch_does_not_count_reaches_no_later_run(encoder, through: str) -> None:
    """The reference run of a miss writes into its stand-in by a module-level scale (2); the repeats run with another
    scale (1). Had the next run started from the written numbers, 2 x stand-in x 1 would equal the record and the
    miss's embedding be served: every repeat must equal the uncached twin."""
    pipeline, twin = ScalesThroughData(encoder, through), ScalesThroughData(build_qwen2_encoder(), through)
    install_prompt_embed_cache(pipeline)
    ids = torch.tensor([PROMPTS["A"]])
    wrong = 0
    try:
        for scale in (2.0, 1.0, 1.0):
            SCALE[0] = scale
            wrong += not torch.equal(pipeline.encode_prompt(ids), twin.encode_prompt(ids))
    finally:
        SCALE[0] = 2.0
    assert wrong == 0


def test_the_guard_takes_a_torch_function_it_cannot_hash() -> None:
    """The guard looks each torch function up once (by hash); a callable without a hash, handed to torch's override
    machinery as code with its own ``__torch_function__`` handling does, is looked at every time instead."""
    from torch.overrides import handle_torch_function

    from vllm_omni_prompt_cache.proof.stand_ins import ProofGuard

    class Doubled:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
            return tensor * 2

    stand_in = torch.ones(3)
    guard = ProofGuard()
    guard.plant(stand_in)
    with guard:
        doubled = handle_torch_function(Doubled(), (stand_in,), stand_in)
    assert torch.equal(doubled, torch.full((3,), 2.0)) and doubled in guard.tainted


def test_the_guard_keeps_no_tensor_a_torch_function_is_bound_to_alive() -> None:
    """A tensor's bound method (``y.add``) or a closure handed to the guard is looked at, not kept by it."""
    import gc
    import weakref

    from torch.overrides import handle_torch_function

    from vllm_omni_prompt_cache.proof.stand_ins import ProofGuard

    def adding(held: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda tensor: tensor + held  # a closure over a tensor

    stand_in, bound_to, closure = torch.ones(3), torch.full((3,), 5.0), adding(torch.zeros(3))
    gone = [weakref.ref(bound_to), weakref.ref(closure.__closure__[0].cell_contents)]
    guard = ProofGuard()
    guard.plant(stand_in)
    with guard:
        handle_torch_function(bound_to.add, (stand_in,), stand_in)
        handle_torch_function(closure, (stand_in,), stand_in)
    del bound_to, closure
    gc.collect()
    assert [ref() for ref in gone] == [None, None]
