"""What a coverage case is, and how one is judged against the pipeline's own uncached calls.

A :class:`Case` builds a vLLM-Omni pipeline object whose real encode method (``encode_prompt``, or
the one its forward calls instead) runs on a tiny random-weight text stack, and says how that
pipeline's forward calls it. :func:`judge` runs the same calls on two fresh builds, one cached and
one not, and reads the counts and the row layout of that method alone:

1. prompt A, twice: the second call must be a hit (its text-encoder calls answered), equal to the uncached call;
2. prompts [A, B]: the first batched call (its encoder's rows are compared with the batch here, served uncached);
3. prompts [B, A]: its encoder calls' rows served from the cache when the rows were shown independent, compared
   with the uncached [B, A] call (the gap is the largest per-row relative difference, as the row check measures
   it).

Nothing is mocked: when a step cannot run, the verdict says why.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.calls.methods import ENCODE_PROMPT, class_path
from vllm_omni_prompt_cache.rows.encoder_rows import compare_outputs
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings

COVERED = "covered"
COVERED_WITHOUT_ROWS = "covered without rows"
NOT_COVERED = "not covered"
NOT_BUILT = "not built"
#: Every verdict, in the order the summary counts them.
VERDICTS = (COVERED, COVERED_WITHOUT_ROWS, NOT_COVERED, NOT_BUILT)


@dataclasses.dataclass(frozen=True)
class Case:
    """One pipeline class, built tiny, and how its forward calls its encode method."""

    pipeline: str  # the vLLM-Omni class name, as its registry names it
    build: Callable[[], Any]  # a fresh pipeline with the same (seeded) weights every time
    encode: Callable[[Any, Sequence[Any]], Any]  # pipeline.<method>(...) for these prompts, as forward calls it
    prompts: tuple[Any, Any]  # two distinct prompts, in the form ``encode`` takes
    inputs: str = "text"  # what the prompts are: "text", "token ids", "text + image", ...
    note: str = ""  # anything the table should say about how the case was built
    method: str = ENCODE_PROMPT  # the wrapped method ``encode`` drives: its counts and layout are judged


@dataclasses.dataclass(frozen=True)
class NotBuilt:
    """A pipeline class the matrix lists without running it, and why."""

    pipeline: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Verdict:
    pipeline: str
    verdict: str  # one of VERDICTS
    inputs: str = ""
    whole_call_hit: bool = False
    rows: bool = False
    gap: float | None = None  # the largest relative difference from the uncached calls (0.0: bit-identical)
    reason: str = ""  # why rows, or anything, are missing
    note: str = ""
    method: str = ENCODE_PROMPT  # the encode method judged


def judge(case: Case) -> Verdict:
    """Run ``case``'s calls cached and uncached; return what the cache did and how close it was.

    Under ``torch.no_grad()``, as vLLM-Omni's runner calls a pipeline's forward.
    """
    with torch.no_grad():
        return _judge(case)


def _judge(case: Case) -> Verdict:
    first, second = case.prompts
    verdict = functools.partial(Verdict, case.pipeline, inputs=case.inputs, method=case.method)
    try:
        reference = case.build()
        expected = {
            "A": case.encode(reference, [first]),
            "AB": case.encode(reference, [first, second]),
            "BA": case.encode(reference, [second, first]),
        }
        pipeline = case.build()
        # A method other than encode_prompt is declared: in an engine it is found by watching the encoders
        # while forward runs, which the matrix does not run.
        declared = None if case.method == ENCODE_PROMPT else {class_path(type(pipeline)): (case.method,)}
        cache = install_prompt_embed_cache(pipeline, max_size=64, settings=PromptEmbedCacheSettings(methods=declared))
    except Exception as error:  # a builder that no longer fits vLLM-Omni: the table says so
        return verdict(NOT_COVERED, reason=_failure("building or the uncached calls", error))
    if cache is None:
        return verdict(NOT_COVERED, reason="install_prompt_embed_cache installed nothing")
    if case.method not in pipeline._prompt_embed_cache_installation.methods:
        return verdict(NOT_COVERED, reason=f"the cache does not wrap {case.method}", note=case.note)
    try:
        served = [case.encode(pipeline, [first]), case.encode(pipeline, [first])]
        after_single = _method_counts(cache, case.method)
        served_batch = case.encode(pipeline, [first, second])
        before_rows = _method_counts(cache, case.method)
        served_rows = case.encode(pipeline, [second, first])
        after_rows = _method_counts(cache, case.method)
    except Exception as error:  # the cached path must never fail where the uncached one worked
        return verdict(NOT_COVERED, reason=_failure("a cached call", error))

    bypassed = dict(after_rows["bypass_reasons"])
    if bypassed:
        return verdict(NOT_COVERED, reason=f"bypassed: {', '.join(bypassed)}", note=case.note)
    gaps = []
    for got, want, what in (
        (served[0], expected["A"], "A"),
        (served[1], expected["A"], "A (hit)"),
        (served_batch, expected["AB"], "[A, B]"),
        (served_rows, expected["BA"], "[B, A]"),
    ):
        why, gap = compare_outputs(got, want)
        if why is not None:
            return verdict(NOT_COVERED, reason=f"{what} differs from uncached: {why}", note=case.note)
        gaps.append(gap)
    whole_hit = after_single["hits"] >= 1
    encoded_again = after_rows["rows_encoded"] - before_rows["rows_encoded"]
    rows_served = encoded_again == 0 and after_rows["row_hits"] >= before_rows["row_hits"] + 2
    gap = max(gaps)
    if whole_hit and rows_served:
        return verdict(COVERED, whole_call_hit=True, rows=True, gap=gap, note=case.note)
    return verdict(
        COVERED_WITHOUT_ROWS if whole_hit else NOT_COVERED,
        whole_call_hit=whole_hit,
        gap=gap if whole_hit else None,
        reason=_why_no_rows(after_rows) if whole_hit else "the repeated call was not a hit",
        note=case.note,
    )


def _method_counts(cache: Any, method: str) -> dict[str, Any]:
    """Return ``method``'s counts now, as ``cache.stats()["methods"][method]`` holds them (zeros before a call)."""
    counts = cache.snapshot().methods.get(method, {})
    return {
        "hits": 0,
        "rows_encoded": 0,
        "row_hits": 0,
        "layout_mismatches": 0,
        "bypass_reasons": {},
        "whole_call_reasons": {},
        **counts,
    }


def _why_no_rows(counts: dict[str, Any]) -> str:
    if counts["layout_mismatches"]:
        return "its text encoder's rows differ when encoded alone"
    if counts["whole_call_reasons"]:
        return "calls keyed whole: " + ", ".join(counts["whole_call_reasons"])
    return "its text encoder is not called with batched token ids"


def _failure(where: str, error: BaseException) -> str:
    frame = traceback.extract_tb(error.__traceback__)[-1]
    at = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return f"{where} raised {type(error).__name__}: {str(error)[:160]} ({at})"


def seeded(seed: int) -> torch.Generator:
    """Seed torch's global generator (weights of ``from_config`` modules) and return a generator."""
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def finish_vllm_loading(module: torch.nn.Module) -> torch.nn.Module:
    """Post-process a vLLM module's weights as vLLM's loader does after loading (picks the CPU GEMM)."""
    for layer in module.modules():
        method = getattr(layer, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(layer)
    return module


@functools.cache
def one_rank_process_group() -> None:
    """Join a one-rank gloo group (once per process): vLLM's parallel layers read its size and rank.

    It stays for the life of the process, which is why the matrix runs in a process of its own.
    """
    from vllm_omni_prompt_cache.tiny.minimax_h3_encoder import one_rank_process_group as join

    join()
