"""The proposed upstream module inside the real engine.

Runs a GRPO-shaped rollout (P prompts x K siblings, token-ID requests with a shared negative prompt,
CFG) through ``AsyncOmni`` on a vLLM-Omni tree that ``upstream/check.sh`` prepared, with this
package's plugin off: vLLM-Omni's own runner installs the proposed ``prompt_embed_cache.py``, and
the patched worker clears it on sleep. It runs once without the cache and once with it, counts the
text encoder's runs, compares every request's final latents, then sleeps the cached engine and
reads the cache again.

    upstream/check.sh TREE/vllm_omni
    python benchmarks/upstream_rollout.py TREE/vllm_omni [--prompts 8] [--group-size 16] [--steps 4]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROPOSED = ROOT / "upstream" / "vllm_omni" / "diffusion" / "cache" / "prompt_embed_cache.py"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def use_tree(package: Path) -> None:
    """Import vLLM-Omni from ``package`` with the plugin off; fail unless it holds the proposed module."""
    os.environ["VLLM_OMNI_PROMPT_CACHE_PLUGIN"] = "0"
    from vllm_omni_prompt_cache.cpu_platform.entry_points import opt_in_where_no_gpu

    opt_in_where_no_gpu()  # before vLLM is imported
    sys.path.insert(0, str(package.parent))
    import vllm_omni.diffusion.cache.prompt_embed_cache as module

    if Path(module.__file__).resolve() != package / "diffusion" / "cache" / "prompt_embed_cache.py":
        raise SystemExit(f"vllm_omni was imported from {module.__file__}, not from {package}")
    if _sha(Path(module.__file__)) != _sha(PROPOSED):
        raise SystemExit(f"{module.__file__} is not the proposed module: run upstream/check.sh on {package} first")


async def rollout(spec: Any, cached: bool) -> dict[str, Any]:
    from vllm_omni_prompt_cache.demo.rollout import engine_kwargs, send_rollout
    from vllm_omni_prompt_cache.vllm_omni.engine_client import open_engine, worker_value

    kwargs = engine_kwargs(spec, "ours" if cached else "off", 64, None)  # only vLLM-Omni's own kwargs
    kwargs["enable_sleep_mode"] = True
    async with open_engine(kwargs) as engine:
        before = await worker_value(engine, "text_encoder_counters")
        stats_before = await worker_value(engine, "runner_prompt_embed_cache_stats")  # after the warm-up's call
        sent = await send_rollout(engine, spec)
        after = await worker_value(engine, "text_encoder_counters")
        stats = await worker_value(engine, "runner_prompt_embed_cache_stats")
        slept = None
        if cached:
            await engine.sleep(level=1)
            slept = await worker_value(engine, "runner_prompt_embed_cache_stats")
            await engine.wake_up()
    return {
        "calls": int(after["encoder_runs"] - before["encoder_runs"]),
        "rows": int(after["encoder_rows"] - before["encoder_rows"]),
        "stats": stats,
        "counted": None if stats is None else {k: stats[k] - stats_before[k] for k in ("hits", "misses", "bypassed")},
        "after_sleep": slept,
        "latents": sent.latents,
    }


def render(spec: Any, off: dict[str, Any], on: dict[str, Any], package_label: str) -> str:
    import torch

    same = sum(torch.equal(off["latents"][index], on["latents"][index]) for index in off["latents"])
    stats, counted, slept = on["stats"], on["counted"], on["after_sleep"]
    from vllm_omni_prompt_cache.demo.machine import cpu_summary

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    lines = [
        f"{cpu_summary()}; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC at commit {commit.stdout.strip() or 'unknown'}; "
        f"vLLM-Omni tree: {package_label}.",
        "",
        f"{len(spec.prompts)} prompts x {spec.group_size} siblings = {len(spec.requests())} requests, CFG with a "
        f"shared negative prompt, {spec.steps} steps at {spec.height}x{spec.width}, max_num_seqs {spec.max_num_seqs}.",
        "",
        "| cache | encode_prompt calls | rows encoded | hits | misses | bypassed |",
        "|---|---:|---:|---:|---:|---:|",
        f"| none | {off['calls']} | {off['rows']} | - | - | - |",
        f"| proposed module | {on['calls']} | {on['rows']} | {counted['hits']} | {counted['misses']} | "
        f"{counted['bypassed']} |",
        "",
        "Counts are the rollout's own (the engine's start-up warm-up call comes before them).",
        f"Final latents identical to the uncached run: {same} of {len(off['latents'])} requests.",
        f"`engine.sleep(level=1)` took the cache from {stats['size']} entries ({stats['bytes']:,} bytes, the "
        f"warm-up's included) to {slept['size']} entries ({slept['bytes']:,} bytes).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", type=Path, help="the vllm_omni package directory upstream/check.sh prepared")
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts P (default 8)")
    parser.add_argument("--group-size", type=int, default=16, help="sibling requests per prompt K (default 16)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per request (default 4)")
    parser.add_argument("--write", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    for name in ("prompts", "group_size", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    package = args.tree.resolve()
    if not (package / "diffusion" / "cache" / "prompt_embed_cache.py").is_file():
        parser.error(f"{args.tree} is not a vllm_omni package directory")
    use_tree(package)

    from vllm_omni_prompt_cache.demo.command import DEMO_MODEL
    from vllm_omni_prompt_cache.demo.rollout import DEFAULT_PROMPTS, RolloutSpec
    from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image

    if args.prompts > len(DEFAULT_PROMPTS):
        parser.error(f"--prompts: at most {len(DEFAULT_PROMPTS)}, got {args.prompts}")
    spec = RolloutSpec(
        model_dir=ensure_tiny_qwen_image(DEMO_MODEL),
        prompts=DEFAULT_PROMPTS[: args.prompts],
        group_size=args.group_size,
        steps=args.steps,
    )
    off = asyncio.run(rollout(spec, cached=False))
    on = asyncio.run(rollout(spec, cached=True))
    import vllm_omni

    table = render(spec, off, on, f"a copy of vLLM-Omni {vllm_omni.__version__} with the proposed change")
    print(table)
    if args.write:
        args.write.write_text(table)


if __name__ == "__main__":
    main()
