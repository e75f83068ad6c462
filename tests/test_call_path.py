"""How far a call travels through the package: the modules a whole-call hit passes through, and how often
it enters each, measured with ``sys.setprofile`` over one real hit.

An entry is a call whose caller is code of another of the package's modules (or the pipeline's code
calling in: the wrapped method itself, the tracing proxy a proof runs the method with, the encoder's
pre-hook). The numbers are kept as they are now: a change that makes a hit travel further fails here
and has to say why, or be made shorter. Issue 48 asks for at most 6 modules, each entered once; the
proof run a hit makes (see docs/design.md, "Proven hits") is what still crosses most of them.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

import vllm_omni_prompt_cache
from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder

PACKAGE = Path(vllm_omni_prompt_cache.__file__).parent
#: The models the tests build are the pipeline's code here, not the package's path.
PIPELINE_CODE = PACKAGE / "tiny"


def _module(filename: str) -> str | None:
    """Return the package module (path below the package) that ``filename`` is, or None for other code."""
    path = Path(filename)
    if PACKAGE not in path.parents or PIPELINE_CODE in path.parents:
        return None
    return str(path.relative_to(PACKAGE))


def entries(call: Callable[[], object]) -> tuple[Counter[str], Counter[str]]:
    """Return, for one run of ``call``, how often each package module was entered from another package
    module, and how often from code outside the package."""
    from_package: Counter[str] = Counter()
    from_outside: Counter[str] = Counter()

    def profile(frame, event, arg) -> None:
        if event != "call":
            return
        here = _module(frame.f_code.co_filename)
        if here is None:
            return
        caller = None if frame.f_back is None else _module(frame.f_back.f_code.co_filename)
        if caller is None:
            from_outside[here] += 1
        elif caller != here:
            from_package[here] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return from_package, from_outside


def _hit_path() -> tuple[Counter[str], Counter[str]]:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    install_prompt_embed_cache(pipeline, max_size=8)
    ids = torch.randint(1, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    mask = ids != 0
    pipeline.encode_prompt(ids, mask)  # the miss
    pipeline.encode_prompt(ids.clone(), mask.clone())  # the first hit (checked once)
    runs = pipeline.encoder_runs
    measured = entries(lambda: pipeline.encode_prompt(ids.clone(), mask.clone()))
    assert pipeline.encoder_runs == runs, "the measured call was not a hit"
    return measured


def test_a_whole_call_hit_travels_no_further_than_it_does_now() -> None:
    from_package, from_outside = _hit_path()
    modules = set(from_package) | set(from_outside)
    print(
        f"whole-call hit: {len(modules)} modules; entries from the package {dict(from_package)}; "
        f"from the pipeline's code {dict(from_outside)}"
    )
    assert len(modules) <= MODULES_NOW, sorted(modules)
    assert sum(from_package.values()) <= ENTRIES_NOW, from_package


#: Measured at this change (issue 48, third step): 9 modules, 12 entries from the package's own code. The
#: wrapper now lives beside the calls it serves (method_calls, not installation), a call is read once
#: (keys.CallKeyBuilder.read: binding, pass-through check, held state, key), a store hit is counted once by
#: the caller, and a gate run hooks the encoders itself (no separate refresh). At dbc4eb8, before it, 11
#: modules and 18 entries; at 346e052, 12 and 22. One entry came back with the next change: a call notes
#: the store's ticket before its lookup (store.ticket), so that what its proof run encodes is not kept across
#: a clear() (a component replaced meanwhile): 13. Then the calls were served through the store's lookups
#: directly, the ticket read as their attribute (store.serve and store.ticket were one-line relays): 8 modules,
#: 11 entries. The target stays 6, each once: the proof run a hit makes enters keys again at the encoder (the
#: digest of its input) and reads (the trace told the encoder was reached), and keys.read and the hit's replay
#: enter them before and after it.
#: Then a hit was proven over the whole encode (issue 58): the proof runs the method to its end with each
#: encoder call answered by a stand-in, under a guard (a torch function mode), compares the result's digest and
#: puts back what the run changed after the encoder. That adds stand_ins (the guard, the stand-in, what was left
#: behind: 5 entries), keys once more (the result's digest), encoder_inputs (now encoder_gate) once more, and
#: reads for the snapshots (before the run, at the encoder) and their undo: 9 modules, 21 entries. Each is a
#: concern of its own (STYLE.md); the hit's cost is in docs/benchmarks.md.
#: Then the modules moved into folders (issue 60): the hit path enters keys/call_key, keys/reads, counts/counters,
#: encoders/text_encoders, store/lookups, proof/encoder_gate, proof/first_use, proof/stand_ins and calls/method_calls:
#: still 9 modules, 21 entries. Where a module was split, what a hit runs stayed in one of the two (a method's state
#: is read through reads.held_state, bound into MethodState; the result's digest moved to stand_ins with its caller
#: first_use's entry, the entry's record seal/unseal to call_key).
#: Then the hit was made cheaper (issue 58's cost): the stand-in is made and noted as stand-in data in one call
#: (stand_ins.StandIns.make, handed the run's guard), the result's digest is a key's concern again
#: (call_key.result_digest, beside value_identity, which it calls), the draw a guard saw is an attribute, and the
#: record's first input is read where it is: 9 modules, 17 entries.
#: Then two hops that were not the proof's own went (issue 60): a proof run's trace takes the instance's snapshot
#: before the run itself (``traced(..., proof_run=True)``: it already took the one at the encoder), and the gate tells
#: a replaced child from the live mapping the children are in (``text_encoders.modules_held_by``, read once) instead
#: of asking text_encoders for them on every run: 8 modules, 15 entries. The issue's 11 was counted before a hit was
#: proven over the whole encode; the proof's own entries (the guard made and asked what was left behind, the
#: stand-in, the trace told at the encoder and asked to undo, the result's digest) are the difference.
MODULES_NOW = 8
ENTRIES_NOW = 15
