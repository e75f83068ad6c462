"""How far a call travels through the package: the modules a hit passes through, and how often it enters each,
measured with ``sys.setprofile`` over one real hit.

An entry is a call whose caller is code of another of the package's modules (or the pipeline's code calling in: the
wrapped method itself, the text encoder's intercepted ``__call__``, the served output read). The numbers are kept as
they are now: a change that makes a hit travel further fails here and has to say why, or be made shorter.
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
    pipeline.encode_prompt(ids.clone(), mask.clone())  # the first hit
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


#: Measured at this change (issue 66: the encoder's calls are cached, the method runs as written): 7 modules, 10
#: entries from the package's own code. The wrapped method opens and closes a tally of its encoder calls and reads
#: what it came to (calls/encoder_calls, three times) and counts it once (counts/counters); the encoder's intercepted
#: call (encoders/intercepted) hands it to the cache (calls/encoder_calls), which reads the encoder's state
#: (encoders/intercepted), keys its inputs (keys/call_key), finds the entry (store/lookups, which compares the bytes
#: in keys/call_key) and rebuilds the output (encoders/outputs). Before it, at 93c5d4e, a hit was proven by running the
#: method again with stand-ins: 8 modules, 15 entries.
MODULES_NOW = 7
ENTRIES_NOW = 10
