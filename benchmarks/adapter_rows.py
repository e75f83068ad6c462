"""Rows the text encoder runs for the adapters users run, through the real AsyncOmni on CPU.

    python benchmarks/adapter_rows.py            # prints a Markdown table (about 5 minutes here)

The rollout of the e2e tests: 2 prompts x 4 siblings, CFG with one shared negative prompt (16 rows
reach encode_prompt, 3 are distinct), 64x64, 2 steps, fp32 tiny Qwen-Image. Pipelines: the
stand-ins of ``vllm_omni_prompt_cache.tiny.verl_omni_adapters`` (verl-omni's Qwen-Image adapter
with tensor ids, with list ids, and an adapter nobody registered). For each: the rows the text
encoder ran with vLLM-Omni's own cache and with ours, how many of ours the first-use check's
uncached call encoded, and how far the final latents are from the same pipeline uncached at
``max_num_seqs`` 1 (batched denoising differs from one request at a time by itself).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from vllm_omni_prompt_cache.cpu_platform.entry_points import opt_in_where_no_gpu

opt_in_where_no_gpu()  # before vLLM is imported, as the demo does
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from engine_support import tiny_spec  # noqa: E402

from vllm_omni_prompt_cache.demo.rollout import run_mode  # noqa: E402
from vllm_omni_prompt_cache.tiny.verl_omni_adapters import (  # noqa: E402
    LIST_IDS_PIPELINE,
    TEAM_PIPELINE,
    VERL_OMNI_PIPELINE,
)

PIPELINES = {
    "verl-omni Qwen-Image, tensor ids": VERL_OMNI_PIPELINE,
    "verl-omni Qwen-Image, list ids": LIST_IDS_PIPELINE,
    "unregistered adapter": TEAM_PIPELINE,
}
CONFIGS = ((1, False), (4, False), (8, False), (4, True))


def rollout(pipeline: str, mode: str, max_num_seqs: int, step_execution: bool):
    spec = tiny_spec(max_num_seqs=max_num_seqs, step_execution=step_execution)
    engine = {"custom_pipeline_args": {"pipeline_class": pipeline}, "request_batch_max_wait_ms": 10}
    return asyncio.run(run_mode(spec, mode, cache_size=32, engine_overrides=engine))


def main() -> None:
    print(
        "| pipeline | max_num_seqs | rows encoded: vLLM-Omni 0.30 cache | rows encoded: ours "
        "| of them, the first-use check's | checks | largest check gap | final latents vs uncached, max abs |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, pipeline in PIPELINES.items():
        reference = rollout(pipeline, "off", 1, False).latents
        for max_num_seqs, step_execution in CONFIGS:
            stock = rollout(pipeline, "stock", max_num_seqs, step_execution)
            ours = rollout(pipeline, "ours", max_num_seqs, step_execution)
            gap = max(float((ours.latents[i] - latents).abs().max()) for i, latents in reference.items())
            stats = ours.stats
            config = f"{max_num_seqs}{', step execution' if step_execution else ''}"
            print(
                f"| {label} | {config} | {stock.encoder_rows} | {ours.encoder_rows} | {stats.layout_check_rows} "
                f"| {stats.layout_checks} | {stats.layout_check_max_gap:.1e} | {gap:.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
