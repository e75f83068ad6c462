"""Time one engine start-up on the demo's model built in a given dtype; prints one line.

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/engine_start.py bfloat16
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/engine_start.py float32

``AsyncOmni(...)`` returns once vLLM-Omni's warm-up request (512x512, 2 steps) has run, so this is
what every engine of the demo and of the tests pays before its first request. The two variables
cap torch's kernels to AVX2: that is how a CPU without bf16 units is timed on one that has them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

from vllm_omni_prompt_cache.cpu_platform.entry_points import opt_in_where_no_gpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dtype", choices=("float32", "bfloat16"), help="dtype of the demo model's weights")
    args = parser.parse_args()
    opt_in_where_no_gpu()  # before vLLM is imported

    from vllm_omni_prompt_cache.demo.command import DEMO_MODEL
    from vllm_omni_prompt_cache.demo.machine import cpu_summary
    from vllm_omni_prompt_cache.demo.rollout import RolloutSpec, engine_kwargs
    from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image
    from vllm_omni_prompt_cache.vllm_omni.engine_client import open_engine

    model_dir = ensure_tiny_qwen_image(dataclasses.replace(DEMO_MODEL, dtype=args.dtype))
    spec = RolloutSpec(model_dir=model_dir, prompts=("a red fox",), group_size=1)

    async def start() -> float:
        started = time.perf_counter()
        async with open_engine(engine_kwargs(spec, "ours", 16, None)):
            return time.perf_counter() - started

    seconds = asyncio.run(start())
    print(f"{args.dtype}: engine ready in {seconds:.1f} s ({cpu_summary()})", flush=True)


if __name__ == "__main__":
    main()
