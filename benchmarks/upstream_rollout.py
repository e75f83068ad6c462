"""One GRPO-shaped rollout through the real engine, on a vLLM-Omni tree ``upstream/check.sh`` prepared.

Sends P prompts x K siblings (token-ID requests with a shared negative prompt, CFG) through
``AsyncOmni`` with this package's plugin off, so vLLM-Omni's own runner installs the tree's
``prompt_embed_cache.py`` at whatever step of the series the tree holds. It counts the text
encoder's runs and the cache's hits, misses and bypasses, compares every request's final latents
with a saved run, and with ``--sleep`` reads the cache before and after ``engine.sleep(level=1)``.
With ``--result`` the counts are also written to a JSON file (``upstream/check/run_series.py`` reads it).

    python benchmarks/upstream_rollout.py TREE/vllm_omni --cache off --save-latents off.pt
    python benchmarks/upstream_rollout.py TREE/vllm_omni --cache on --compare-latents off.pt --sleep
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any


def use_tree(package: Path) -> None:
    """Import vLLM-Omni from ``package`` with the plugin off; fail unless the tree is the one imported."""
    os.environ["VLLM_OMNI_PROMPT_CACHE_PLUGIN"] = "0"
    from vllm_omni_prompt_cache.cpu_platform.entry_points import opt_in_where_no_gpu

    opt_in_where_no_gpu()  # before vLLM is imported
    sys.path.insert(0, str(package.parent))
    import vllm_omni.diffusion.cache.prompt_embed_cache as module

    if Path(module.__file__).resolve() != package / "diffusion" / "cache" / "prompt_embed_cache.py":
        raise SystemExit(f"vllm_omni was imported from {module.__file__}, not from {package}")
    if module.install_prompt_embed_cache.__module__ != module.__name__:
        raise SystemExit("prompt_embed_cache's names were rebound after import (a plugin?)")


async def rollout(spec: Any, cached: bool, sleep: bool) -> dict[str, Any]:
    from vllm_omni_prompt_cache.demo.rollout import engine_kwargs, send_rollout
    from vllm_omni_prompt_cache.vllm_omni.engine_client import open_engine, worker_value

    kwargs = engine_kwargs(spec, "ours" if cached else "off", 64, None)  # only vLLM-Omni's own kwargs
    kwargs["enable_sleep_mode"] = sleep
    async with open_engine(kwargs) as engine:
        before = await worker_value(engine, "text_encoder_counters")
        stats_before = await worker_value(engine, "runner_prompt_embed_cache_stats")  # after the warm-up's call
        sent = await send_rollout(engine, spec)
        after = await worker_value(engine, "text_encoder_counters")
        stats = await worker_value(engine, "runner_prompt_embed_cache_stats")
        slept = None
        if sleep:
            await engine.sleep(level=1)
            slept = await worker_value(engine, "runner_prompt_embed_cache_stats")
            await engine.wake_up()
    counted = None
    if stats is not None:
        counted = {name: stats[name] - stats_before[name] for name in ("hits", "misses", "bypassed")}
    return {
        "encodes": int(after["encoder_runs"] - before["encoder_runs"]),
        "rows": int(after["encoder_rows"] - before["encoder_rows"]),
        "cache": counted,
        "entries": None if stats is None else stats["size"],
        "entries_after_sleep": None if slept is None else slept["size"],
        "latents": sent.latents,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", type=Path, help="the vllm_omni package directory of a prepared tree")
    parser.add_argument("--cache", choices=("on", "off"), required=True, help="enable_prompt_embed_cache")
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts P (default 8)")
    parser.add_argument("--group-size", type=int, default=16, help="sibling requests per prompt K (default 16)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per request (default 4)")
    parser.add_argument("--sleep", action="store_true", help="sleep the engine (level 1) after the rollout")
    parser.add_argument("--save-latents", type=Path, help="write every request's final latents here")
    parser.add_argument("--compare-latents", type=Path, help="compare every request's latents with this file")
    parser.add_argument("--result", type=Path, help="also write the counts to this JSON file")
    args = parser.parse_args()
    for name in ("prompts", "group_size", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    package = args.tree.resolve()
    if not (package / "diffusion" / "cache" / "prompt_embed_cache.py").is_file():
        parser.error(f"{args.tree} is not a vllm_omni package directory")
    use_tree(package)

    import torch

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
    result = asyncio.run(rollout(spec, cached=args.cache == "on", sleep=args.sleep))
    latents = result.pop("latents")
    result["requests"] = len(spec.requests())
    if args.save_latents:
        torch.save(latents, args.save_latents)
    if args.compare_latents:
        reference = torch.load(args.compare_latents)
        same = sum(index in latents and torch.equal(latents[index], tensor) for index, tensor in reference.items())
        result["identical_latents"] = same
    print(json.dumps(result))
    if args.result:
        args.result.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
