"""Hits exact by construction: whatever an encode does around its text encoder, a cached run equals an uncached one.

Each case is an encode that does something the proof of a whole skipped encode could not account for (issue 66):
files what it computed where later code reads it, draws from a random generator torch's own list does not cover,
branches on the encoder's real values, returns its result in a container with slots, changes what it returned
earlier, or hands the caller a tensor it then writes into through ``.data`` or a NumPy view. The request's ids are
stashed on the pipeline, so every call has equal arguments, and the sequence A, A, A, B, A, C, B repeats A truly
before anything changes. Through the public ``install_prompt_embed_cache`` with default settings, as
``encode_prompt`` and as a method found by watching (``_embed_request``, called from ``forward``), every call must
equal what an uncached twin (another pipeline around the same encoder, the same state and seeds) returns, so must
what later code reads from the pipeline and its helpers, and so must the next draw of Python's, NumPy's and torch's
global generators after every call. The encoder runs once per distinct prompt (counted by a hook on its forward).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Callable
from typing import Any, NamedTuple

import attrs
import msgspec
import numpy as np
import pytest
import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns
from vllm_omni_prompt_cache.tiny.text_encoder import build_qwen2_encoder

LENGTH = 12
SEQUENCE = "AAABACB"
PROMPTS = {"A": [5, 17, 29, 3], "B": [88, 41, 7, 7, 90, 12], "C": [600, 2]}
#: A per-request setting the code after the encoder reads from a helper (a norm limit, a length budget): the same for
#: the first repeats of A, another for its fourth call. Real hidden states have norms of about 8 per token.
LIMITS = [7.5, 7.5, 7.5, 7.5, 30.0, 7.5, 7.5]


@dataclasses.dataclass(slots=True)
class SlotsEmbeds:
    embeds: torch.Tensor
    length: int


@attrs.define
class AttrsEmbeds:
    embeds: torch.Tensor
    length: int


class StructEmbeds(msgspec.Struct):
    embeds: Any
    length: int


class Helper:
    """A helper object the pipeline made at ``__init__`` (a length tracker, a scheduler's companion)."""

    def __init__(self) -> None:
        self.last_embeds: Any = None
        self.by_request: dict[int, Any] = {}
        self.lengths: list[int] = []
        self.norm: float = 0.0
        self.limit: float = 0.0
        self.rng = np.random.default_rng(7)


class Pipeline(CountsEncoderRuns, torch.nn.Module):
    """Encodes the ids stashed in ``pending_ids`` whatever the prompt; ``after`` is what the encode does next."""

    def __init__(self, encoder: torch.nn.Module, after: Callable[[Pipeline, torch.Tensor, list[int]], Any]) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.dit = torch.nn.Linear(4, 4)
        self.helper = Helper()
        self.after = after
        self.pending_ids: list[int] = []
        self.generator = np.random.default_rng(11)
        self.count_encoder_calls(encoder)

    @torch.inference_mode()
    def encode_prompt(self, prompt: str = "[pretokenized]") -> Any:
        return encode_stashed(self)

    @torch.inference_mode()
    def _embed_request(self, prompt: str) -> Any:
        return encode_stashed(self)

    @torch.inference_mode()
    def forward(self, prompt: str = "[pretokenized]") -> Any:
        embeds = self._embed_request(prompt)
        self.dit(torch.zeros(4))
        return embeds


def encode_stashed(p: Pipeline) -> Any:
    """Encode the stashed ids, then do what the case does (a function: the encode is the method that calls it)."""
    ids = p.pending_ids
    input_ids = torch.zeros(1, LENGTH, dtype=torch.int64)
    input_ids[0, : len(ids)] = torch.tensor(ids)
    hidden = p.text_encoder(input_ids=input_ids, attention_mask=(input_ids != 0).long()).last_hidden_state
    return p.after(p, hidden, ids)


class FoundByWatching(Pipeline):
    encode_prompt = None  # type: ignore[assignment]


# --- What each encode does after its encoder call ----------------------------------------------------------------


def files_length(p: Pipeline, hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
    p._rl_prompt_len = len(ids)  # read by the rollout's reward code
    return hidden[:, : len(ids)]


def files_by_request(p: Pipeline, hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
    p.helper.by_request[len(p.helper.lengths)] = hidden  # the helper keeps the very tensor it returns
    p.helper.lengths.append(len(ids))
    return hidden


def keeps_plain_copies(p: Pipeline, hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
    p.helper.norm = float(hidden.norm())
    p.helper.last_embeds = (hidden[0, 0].tolist(), hidden.numpy().copy())
    return hidden


def numpy_global_noise(p: Pipeline, hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return hidden + torch.from_numpy(np.random.standard_normal(hidden.shape).astype(np.float32))


def pipeline_rng_noise(p: Pipeline, hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return hidden * float(p.generator.uniform(0.9, 1.1))


def helper_rng_noise(p: Pipeline, hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return hidden + float(p.helper.rng.normal())


def python_random_dropout(p: Pipeline, hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
    keep = [random.random() > 0.3 for _ in range(hidden.shape[1])]
    return hidden * torch.tensor(keep, dtype=hidden.dtype)[None, :, None]


def gamma_family(p: Pipeline, hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
    scale = torch.distributions.Beta(2.0, 3.0).sample()
    scale = scale * torch.distributions.Gamma(2.0, 1.0).sample()
    weights = torch.distributions.Dirichlet(torch.ones(hidden.shape[1])).sample()
    return hidden * scale * weights[None, :, None]


def norm_guard(p: Pipeline, hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
    # A per-request norm guard: the real embeddings cross a limit of 7.5, and not one of 30.
    norms = hidden.norm(dim=-1, keepdim=True)
    return torch.where(norms > p.helper.limit, hidden * (p.helper.limit / norms), hidden)


def clamp_on_values(p: Pipeline, hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
    if float(hidden.abs().amax()) > p.helper.limit / 10:  # the real values cross 0.75, not 3
        return hidden.clamp(-p.helper.limit / 10, p.helper.limit / 10)
    return hidden


def slots_dataclass(p: Pipeline, hidden: torch.Tensor, ids: list[int]) -> Any:
    return SlotsEmbeds(hidden, int(p.helper.limit))


def attrs_class(p: Pipeline, hidden: torch.Tensor, ids: list[int]) -> Any:
    return AttrsEmbeds(hidden, int(p.helper.limit))


def msgspec_struct(p: Pipeline, hidden: torch.Tensor, ids: list[int]) -> Any:
    return StructEmbeds(hidden, int(p.helper.limit))


def changes_earlier_result(p: Pipeline, hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
    # Normalises, in place, what it returned for the previous request (a running buffer of embeddings).
    previous = p.helper.last_embeds
    if isinstance(previous, torch.Tensor):
        previous.mul_(0.5)
    p.helper.last_embeds = hidden
    return hidden


class Case(NamedTuple):
    after: Callable[[Pipeline, torch.Tensor, list[int]], Any]
    caller_writes: Callable[[Any], None] | None = None  # what the caller does to what it was handed


def write_through_data(served: Any) -> None:
    with torch.inference_mode():  # as vLLM-Omni's forward runs
        served.data.add_(1.0)


def write_through_numpy(served: Any) -> None:
    served.numpy()[...] = 0.0  # no version counter moves


CASES: dict[str, Case] = {
    "writes: the prompt's length on the pipeline": Case(files_length),
    "writes: embeddings by request id and a list of lengths": Case(files_by_request),
    "writes: a float, .tolist() and a NumPy copy on a helper": Case(keeps_plain_copies),
    "randomness: NumPy's global generator": Case(numpy_global_noise),
    "randomness: a default_rng on the pipeline": Case(pipeline_rng_noise),
    "randomness: a default_rng on a helper": Case(helper_rng_noise),
    "randomness: Python's random": Case(python_random_dropout),
    "randomness: Beta, Gamma and Dirichlet samplers": Case(gamma_family),
    "branch: a per-request norm guard": Case(norm_guard),
    "branch: a clamp chosen by the first value": Case(clamp_on_values),
    "container: dataclass with slots": Case(slots_dataclass),
    "container: attrs class": Case(attrs_class),
    "container: msgspec Struct": Case(msgspec_struct),
    "an encode that changes what it returned earlier": Case(changes_earlier_result),
    "the caller writes into the served tensor through .data": Case(lambda p, h, ids: h, write_through_data),
    "the caller writes into the served tensor through a NumPy view": Case(lambda p, h, ids: h, write_through_numpy),
}


def plain(value: Any) -> Any:
    """Return ``value`` as comparable data: tensors as lists, NumPy arrays as lists, objects by their fields."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.tolist())
    if isinstance(value, np.ndarray):
        return ("ndarray", value.tolist())
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, (SlotsEmbeds, AttrsEmbeds, StructEmbeds)):
        return (type(value).__name__, plain(value.embeds), value.length)
    return value


def later_reads(p: Pipeline) -> Any:
    """What code after the encode reads from the pipeline and its helper."""
    helper = p.helper
    return plain(
        {
            "length": getattr(p, "_rl_prompt_len", None),
            "by_request": helper.by_request,
            "lengths": helper.lengths,
            "norm": helper.norm,
            "last": helper.last_embeds,
        }
    )


def streams() -> tuple[float, float, float]:
    """The next draw of each global generator, drawn from copies of their states (nothing moves)."""
    python = random.Random()
    python.setstate(random.getstate())
    numpy_state = np.random.get_state()
    numpy_next = float(np.random.standard_normal())
    np.random.set_state(numpy_state)
    with torch.random.fork_rng(devices=[]):
        torch_next = float(torch.randn(()))
    return python.random(), numpy_next, torch_next


def run(p: Pipeline, found: bool, case: Case) -> list[tuple[Any, Any, Any]]:
    """Send SEQUENCE from fixed seeds; return, per call, (what it returned, what later code reads, the streams)."""
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    seen = []
    for name, limit in zip(SEQUENCE, LIMITS, strict=True):
        p.pending_ids, p.helper.limit = PROMPTS[name], limit
        served = p("[pretokenized]") if found else p.encode_prompt("[pretokenized]")
        returned = plain(served)
        if case.caller_writes is not None:
            case.caller_writes(served)
        seen.append((returned, later_reads(p), streams()))
    return seen


@pytest.mark.parametrize("found", [False, True], ids=["encode_prompt", "found by watching"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_cached_run_equals_an_uncached_one(name: str, found: bool) -> None:
    case = CASES[name]
    encoder = build_qwen2_encoder(seed=2)
    kind = FoundByWatching if found else Pipeline
    # The twin's encoder is a copy: a cached module's calls are served from wherever they come.
    cached, twin = kind(encoder, case.after), kind(copy.deepcopy(encoder), case.after)
    cache = install_prompt_embed_cache(cached)
    served = run(cached, found, case)
    uncached = run(twin, found, case)
    differences = [
        (call, part)
        for call, (mine, theirs) in enumerate(zip(served, uncached, strict=True))
        for part, label in enumerate(("result", "later reads", "random streams"))
        if mine[part] != theirs[part]
    ]
    assert differences == [], [
        (SEQUENCE[call], ("result", "later reads", "random streams")[part]) for call, part in differences
    ]
    stats = cache.stats()
    # Each distinct prompt reached the encoder once (the twin's: every call); the rest were answered.
    assert cached.encoder_runs == len(set(SEQUENCE)), stats
    assert twin.encoder_runs == len(SEQUENCE)
    method = "_embed_request" if found else "encode_prompt"
    assert stats["methods"][method]["hits"] >= len(SEQUENCE) - len(set(SEQUENCE)) - (1 if found else 0), stats
