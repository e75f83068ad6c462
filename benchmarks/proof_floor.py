"""How much of a proven hit is the method's own code: a hit, a miss and the method's body alone, on the tiny engine.

    python benchmarks/proof_floor.py [--calls 300] [--write FILE]

A proof re-runs the wrapped method with its text-encoder calls answered, so no proof can cost less than the
method's own code around its encoder. On the token-ID Qwen-Image pipeline inside a real ``AsyncOmni`` engine (the
tests' tiny checkpoint, on the CPU platform) this times, as medians in one process: a proven hit, a miss, the same
call with no cache (the class's own ``encode_prompt``), and that call with the text encoder's forward answered by
a ready output (its own first output: the method's body alone, what a proof cannot avoid), that body under a
torch function mode that does nothing (one Python frame per torch call), and under what every proof run is
watched by: the guard (a torch function mode: draws, stand-in data left behind) and the
trace of the instance (writes after the encoder undone).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from pathlib import Path
from typing import Any


def _median_us(call: Any, calls: int) -> float:
    times = []
    for index in range(calls):
        started = time.perf_counter()
        call(index)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def measure(calls: int) -> dict[str, float]:
    from vllm_omni_prompt_cache.cpu_platform.entry_points import opt_in_where_no_gpu

    opt_in_where_no_gpu()  # before vLLM is imported
    import torch
    from torch.overrides import TorchFunctionMode

    from vllm_omni_prompt_cache.demo.rollout import RolloutSpec, engine_kwargs
    from vllm_omni_prompt_cache.keys.reads import traced
    from vllm_omni_prompt_cache.proof.stand_ins import ProofGuard
    from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image, load_tokenizer, prompt_token_ids
    from vllm_omni_prompt_cache.tiny.token_id_pipeline import TokenIdQwenImagePipeline
    from vllm_omni_prompt_cache.vllm_omni.engine_client import open_engine

    spec = RolloutSpec(model_dir=ensure_tiny_qwen_image(), prompts=("a red fox",), group_size=1)
    tokenizer = load_tokenizer(spec.model_dir)

    def ids_of(text: str) -> torch.Tensor:
        return torch.tensor([prompt_token_ids(tokenizer, text)])

    async def run() -> dict[str, float]:
        async with open_engine(engine_kwargs(spec, "ours", 4096, None)):
            # The engine runs in this process (one stage, inline): its pipeline is an object here.
            (pipeline,) = [obj for obj in gc.get_objects() if isinstance(obj, TokenIdQwenImagePipeline)]
            seen = ids_of("fox lighthouse snow sea storm dawn hill river")

            def cached(ids: torch.Tensor) -> Any:
                return pipeline.encode_prompt(ids, ids != 0)

            def uncached(ids: torch.Tensor) -> Any:
                return type(pipeline).encode_prompt(pipeline, ids, ids != 0)

            cached(seen.clone())
            with torch.inference_mode():
                for _ in range(30):
                    cached(seen.clone())
                hit = _median_us(lambda _: cached(seen.clone()), calls)
                miss = _median_us(lambda index: cached(ids_of(f"city night {index} storm")), max(calls // 4, 20))
                bare = _median_us(lambda _: uncached(seen.clone()), max(calls // 2, 20))
                encoder, ready = pipeline.text_encoder, []
                real_forward = encoder.forward

                def answered(*args: Any, **kwargs: Any) -> Any:
                    if not ready:
                        ready.append(real_forward(*args, **kwargs))
                    return ready[0]

                class Bare(TorchFunctionMode):  # what a function mode costs before it does anything
                    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
                        return func(*args, **(kwargs or {}))

                def bare_mode(_: int) -> None:
                    with Bare():
                        uncached(seen.clone())

                def watched(_: int) -> None:
                    guard = ProofGuard()
                    guard.plant(ready[0])
                    with guard, traced(pipeline):
                        uncached(seen.clone())

                encoder.forward = answered
                try:
                    body = _median_us(lambda _: uncached(seen.clone()), calls)
                    body_bare_mode = _median_us(bare_mode, calls)
                    body_watched = _median_us(watched, calls)
                finally:
                    del encoder.forward
            return {
                "hit_us": hit,
                "miss_us": miss,
                "uncached_us": bare,
                "body_us": body,
                "bare_mode_us": body_bare_mode,
                "watched_us": body_watched,
            }

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="hits timed (default: %(default)s)")
    parser.add_argument("--write", type=Path, help="also write the table to this file")
    arguments = parser.parse_args()
    if arguments.calls < 1:
        parser.error(f"--calls must be a whole number >= 1, got {arguments.calls}")
    from vllm_omni_prompt_cache.demo.machine import cpu_summary

    found = measure(arguments.calls)
    miss = found["miss_us"]
    rows = [
        ("proven hit", found["hit_us"]),
        ("miss", miss),
        ("the call with no cache", found["uncached_us"]),
        ("the method's body, its encoder answered by a ready output (no cache, no proof)", found["body_us"]),
        ("that body under a torch function mode that does nothing", found["bare_mode_us"]),
        ("that body under the proof's guard (output planted as stand-in data) and the trace", found["watched_us"]),
    ]
    lines = [
        f"Tiny Qwen-Image engine, token-ID encode_prompt, medians of one process. CPU: {cpu_summary()}.",
        "",
        "| call | median | share of the miss |",
        "|---|---:|---:|",
        *(f"| {name} | {value:.0f} us | {100 * value / miss:.1f} % |" for name, value in rows),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if arguments.write:
        arguments.write.write_text(text)


if __name__ == "__main__":
    main()
