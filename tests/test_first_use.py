"""A method's first use and every later encode, read the same way; what a call decides comes back as a value.

:class:`~vllm_omni_prompt_cache.proof.first_use.FirstUse` runs each encode a call makes outside a hit through one
encode step and one judgement, and hands what the call decided about the method (refused, not an encode,
confirmed) back to the front as a :class:`~vllm_omni_prompt_cache.proof.verdicts.Verdict`, which the front acts on.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.calls.installation import INSTALLATION_ATTRIBUTE
from vllm_omni_prompt_cache.proof import first_use
from vllm_omni_prompt_cache.proof.verdicts import NotRun, Verdict
from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns
from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder

LENGTH = 12


@pytest.fixture(scope="module")
def encoder() -> torch.nn.Module:
    return build_qwen2_encoder()


def _padded(ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids[:LENGTH] + [0] * (LENGTH - len(ids[:LENGTH]))], dtype=torch.long)


class FoundAdapter(CountsEncoderRuns, torch.nn.Module):
    """A minimal pipeline whose encode method no code of ours names: found by watching the encoder, then
    learned on its first call, so that a first use can be looked at alone. It mirrors no adapter (verl-omni's
    LTX-2 adapter, whose helper is also found by watching, is mirrored in ``tiny/ltx2_adapter.py`` and run in
    ``tests/test_ltx2_e2e.py``). ``in_place`` makes it pad the list of token ids it was given."""

    def __init__(self, encoder: torch.nn.Module, *, in_place: bool = False, also_runs_dit: bool = False) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.dit = torch.nn.Linear(4, 4)
        self.in_place, self.also_runs_dit = in_place, also_runs_dit

    @torch.inference_mode()
    def _embed_ids(self, token_ids: list[int]) -> torch.Tensor:
        hidden = self.text_encoder(input_ids=_padded(token_ids)).last_hidden_state
        self.encoder_rows += 1
        if self.in_place:
            token_ids.append(0)  # a caller's list changed: a hit could not repeat it
        if self.also_runs_dit:
            self.dit(torch.zeros(4))
        return hidden

    @torch.inference_mode()
    def forward(self, token_ids: list[int]) -> torch.Tensor:
        return self.dit(self._embed_ids(token_ids)[0, :, :4]).sum()


def _first_use_steps(call: Callable[[], object]) -> Counter[str]:
    """Return how often each function of first_use.py ran during ``call``."""
    here = Path(first_use.__file__)
    ran: Counter[str] = Counter()

    def profile(frame, event, arg) -> None:
        if event == "call" and Path(frame.f_code.co_filename) == here:
            ran[frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return ran


def test_a_first_use_and_a_miss_run_the_same_encode_step_and_judgement(encoder) -> None:
    adapter = FoundAdapter(encoder)
    install_prompt_embed_cache(adapter)
    adapter([5, 6, 7])  # opens the encode the watch finds, and the DiT settles it: _embed_ids is wrapped
    calls = getattr(adapter, INSTALLATION_ATTRIBUTE).methods["_embed_ids"]
    assert calls.state.learning
    first = _first_use_steps(lambda: adapter([8, 9]))  # its first use
    assert not calls.state.learning and calls.state.refusal is None

    pipeline = TokenIdTextPipeline(encoder)  # encode_prompt: served from its first call, which misses
    install_prompt_embed_cache(pipeline)
    ids = _padded([3, 4, 5])
    miss = _first_use_steps(lambda: pipeline.encode_prompt(ids, ids != 0))
    assert pipeline.encoder_runs == 1

    assert first["learn"] == 1 and miss["encode_traced"] == 1
    for step in ("_encode", "_judge"):
        assert first[step] == miss[step] == 1, (step, dict(first), dict(miss))


def test_a_refusal_is_in_the_state_at_once_and_said_by_the_front_when_it_settles(encoder, caplog) -> None:
    adapter = FoundAdapter(encoder, in_place=True)
    install_prompt_embed_cache(adapter)
    adapter([5, 6, 7])
    calls = getattr(adapter, INSTALLATION_ATTRIBUTE).methods["_embed_ids"]
    token_ids = [8, 9]
    with caplog.at_level(logging.WARNING):
        result, verdict = calls.first_use.learn((token_ids,), {}, {"token_ids": token_ids})
        why = "it changes its arguments in place, which a hit could not repeat"
        assert type(result) is torch.Tensor and verdict == Verdict(refusal=why)
        assert calls.state.refusal == why  # no encode running meanwhile is kept
        assert not any("is not cached" in record.getMessage() for record in caplog.records)
        calls.settle(verdict)
    assert [record.getMessage() for record in caplog.records if "is not cached" in record.getMessage()] == [
        f"Prompt-embed cache: {type(adapter).__qualname__}._embed_ids is not cached: {why}."
    ]
    # A second refusal decides nothing: the first reason stands, and is said once.
    assert calls.first_use.refusal("another reason") == Verdict()


def test_a_candidate_that_is_not_an_encode_stays_wrapped_until_the_front_settles(encoder) -> None:
    adapter = FoundAdapter(encoder, also_runs_dit=True)
    install_prompt_embed_cache(adapter)
    adapter([5, 6, 7])
    installation = getattr(adapter, INSTALLATION_ATTRIBUTE)
    calls = installation.methods["_embed_ids"]
    result, verdict = calls.first_use.learn(([8, 9],), {}, {"token_ids": [8, 9]})
    assert type(result) is torch.Tensor and verdict == Verdict(rejection="it also runs dit")
    assert "_embed_ids" in installation.methods  # deciding unwrapped nothing
    calls.settle(verdict)
    assert "_embed_ids" not in installation.methods
    assert installation.rejected["_embed_ids"] == "it also runs dit"
    assert type(result) is not NotRun
