"""Where the text encoder goes during a rollout, through the real ``AsyncOmni`` engine, as tables.

    python benchmarks/offload.py   # prints the tables and writes them to benchmarks/results/offload.md

The demo model (tiny Qwen-Image, random weights) behind the FlowGRPO-shaped token-ID pipeline,
8 prompts x 16 siblings with a shared negative prompt (CFG), 64x64, 2 steps, one request per
forward, each configuration on its own engine:

1. **vLLM-Omni's module offload** (``enable_cpu_offload=True``: the encoder and the DiT swap around
   every forward) with no cache, vLLM-Omni's cache, ours, and ours on a directory
   ``precompute`` filled first: encoder placements and evictions, DiT evictions, bytes the swaps
   copy, placements the cache avoided, rows encoded, latents against no cache.
2. **The encoder placed only for a miss** (``prompt_embed_cache_encoder_on_miss``, no vLLM-Omni
   offload): ours without and with it, and with it on the precomputed directory: placements, the
   encoder's bytes on the device between requests, latents against ours without it.

On the CPU platform the offload hooks' device is the host: nothing is copied, and the counts are
the moves a GPU would make (the same hooks decide them). On a CUDA machine the script runs on the
GPU (the CPU platform stays off) and adds the rollout's wall time and the worker's CUDA memory:
``benchmarks/gpu_check.sh`` runs it there.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from vllm_omni_prompt_cache.demo.command import DEMO_MODEL
from vllm_omni_prompt_cache.demo.machine import cpu_summary

PROMPTS, SIBLINGS = 8, 16
RESULTS = Path(__file__).parent / "results" / "offload.md"
_said: list[str] = []


def say(text: str = "") -> None:
    """Print a line and keep it for :data:`RESULTS` (the in-process worker prefixes what this process prints)."""
    print(text, flush=True)
    _said.append(text)


def table(header: list[str], lines: list[list[Any]]) -> str:
    rows_text = ["| " + " | ".join(str(cell) for cell in line) + " |" for line in lines]
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *rows_text])


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def compared(latents: dict[int, torch.Tensor], reference: dict[int, torch.Tensor]) -> str:
    same = latents.keys() == reference.keys() and all(torch.equal(latents[i], reference[i]) for i in reference)
    return "bit-identical" if same else "DIFFER"


def main() -> None:
    from vllm_omni_prompt_cache.cpu_platform.entry_points import opt_in_where_no_gpu

    on_cpu = opt_in_where_no_gpu()  # before vLLM is imported
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm_omni_prompt_cache.demo.offload import (
        CONFIGURATIONS,
        MODULE_OFFLOAD,
        offload_rollout,
        run_configurations,
    )
    from vllm_omni_prompt_cache.demo.rollout import DEFAULT_PROMPTS, RolloutSpec
    from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image

    where = (
        f"CPU: {cpu_summary()}" if on_cpu else f"GPU: {torch.cuda.get_device_name()}, CPU: {cpu_summary()}"
    ) + f", torch {torch.__version__}, {torch.get_num_threads()} threads"
    say(where + "\n")
    spec = RolloutSpec(
        model_dir=ensure_tiny_qwen_image(DEMO_MODEL), prompts=DEFAULT_PROMPTS[:PROMPTS], group_size=SIBLINGS
    )
    requests = len(spec.requests())
    with tempfile.TemporaryDirectory() as scratch:
        directory = str(Path(scratch) / "embeddings")
        offloaded = run_configurations(spec, CONFIGURATIONS, directory, offload=MODULE_OFFLOAD)
        plain = asyncio.run(offload_rollout(spec, "ours"))
        on_miss = asyncio.run(offload_rollout(spec, "ours", encoder_on_miss=True))
        # The directory the precomputed configuration above was run on (filled before it).
        on_miss_dir = asyncio.run(offload_rollout(spec, "ours", encoder_on_miss=True, directory=directory))

    reference = offloaded["off"]
    encoder_mib = mib(reference.encoder_bytes)
    say(
        f"### vLLM-Omni's module offload (enable_cpu_offload=True): {PROMPTS} prompts x {SIBLINGS} siblings "
        f"= {requests} requests, text encoder {encoder_mib} MiB\n"
    )
    header = [
        "cache",
        "encoder placements",
        "encoder evictions",
        "DiT evictions",
        "MiB moved",
        "placements avoided",
        "MiB not moved",
        "rows encoded",
        "placements at start-up",
        "latents vs no cache",
    ]
    if not on_cpu:
        header += ["rollout s", "peak GiB"]
    lines = []
    for name, result in offloaded.items():
        moves = result.moves
        line = [
            {"off": "none", "stock": "vLLM-Omni's", "ours": "ours"}.get(name, name),
            moves["encoder_placements"],
            moves["encoder_evictions"],
            moves["dit_evictions"],
            mib(moves["bytes_moved"]),
            moves["placements_avoided"],
            mib(moves["bytes_not_moved"]),
            result.rows_encoded,
            result.startup_moves.get("encoder_placements", 0),
            compared(result.latents, reference.latents),
        ]
        if not on_cpu:
            line += [f"{result.seconds:.2f}", f"{(result.device_peak or 0) / 2**30:.2f}"]
        lines.append(line)
    say(table(header, lines))

    say(
        f"\n### The encoder placed only for a miss (prompt_embed_cache_encoder_on_miss, no vLLM-Omni offload): "
        f"{requests} requests\n"
    )
    header = [
        "cache",
        "encoder placements",
        "rows encoded",
        "encoder MiB on the device between requests",
        "placements at start-up",
        "latents vs ours without it",
    ]
    if not on_cpu:
        header += ["rollout s", "CUDA GiB allocated between requests", "peak GiB", "free GiB between requests"]
    lines = []
    for name, result in (
        ("ours", plain),
        ("ours, encoder on a miss", on_miss),
        ("ours, encoder on a miss, precomputed directory", on_miss_dir),
    ):
        on_device = result.encoder_bytes if result.encoder_device_bytes is None else result.encoder_device_bytes
        line = [
            name,
            result.moves.get("encoder_placements", 0),
            result.rows_encoded,
            mib(on_device),
            result.startup_moves.get("encoder_placements", 0),
            compared(result.latents, plain.latents),
        ]
        if not on_cpu:
            line += [
                f"{result.seconds:.2f}",
                f"{(result.device_allocated or 0) / 2**30:.2f}",
                f"{(result.device_peak or 0) / 2**30:.2f}",
                f"{(result.device_free or 0) / 2**30:.2f}",
            ]
        lines.append(line)
    say(table(header, lines))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(_said) + "\n")


if __name__ == "__main__":
    main()
