"""The tiers below device memory through the real ``AsyncOmni`` engine on CPU, as tables.

    python benchmarks/tiers.py   # prints the tables and writes them to benchmarks/results/tiers.md

Every scenario runs the demo model (tiny Qwen-Image, random weights) behind the FlowGRPO-shaped
token-ID pipeline, with this package's cache (16 entries) on, 64x64, 2 steps, CFG with a shared
negative prompt; rows encoded are counted by the pipeline itself, whatever the cache says.

1. **Three steps with sleep and wake between them**, step 3 repeating step 1's prompts and seeds,
   as colocated RL does (4 prompts x 4 siblings a step): no tier, a host tier, a directory tier.
2. **A restarted engine** on the directory the third run of (1) left.
3. **Two replicas under vLLM-Omni's random policy**, 8 prompts x 4 siblings: each with its own
   cache only, then both on one directory.
4. **Faults** on a directory: a truncated file (a half-written file under the final name, what a
   disk failure leaves), a file written by another model under this model's name, a full disk (a
   64 KiB tmpfs, when this machine lets us mount one), and the concurrent writers of (3).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from vllm_omni_prompt_cache.demo.command import DEMO_MODEL
from vllm_omni_prompt_cache.demo.machine import cpu_summary
from vllm_omni_prompt_cache.demo.rollout import (
    DEFAULT_PROMPTS,
    RolloutResult,
    RolloutSpec,
    engine_kwargs,
    run_mode,
    send_rollout,
)
from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image
from vllm_omni_prompt_cache.vllm_omni.engine_client import open_engine, worker_value, worker_values

STEP_1, STEP_2 = DEFAULT_PROMPTS[:4], DEFAULT_PROMPTS[4:8]


def spec(prompts: tuple[str, ...], **overrides: Any) -> RolloutSpec:
    return RolloutSpec(model_dir=ensure_tiny_qwen_image(DEMO_MODEL), prompts=prompts, group_size=4, **overrides)


def kwargs_for(rollout: RolloutSpec, tier: dict[str, Any]) -> dict[str, Any]:
    return {**engine_kwargs(rollout, "ours", 16, None), **tier, "enable_sleep_mode": True}


async def rows(engine: Any) -> list[int]:
    """Rows the text encoder ran for so far, per replica."""
    return [int(counters["encoder_rows"]) for counters in await worker_values(engine, "text_encoder_counters")]


async def rows_of(engine: Any, rollout: RolloutSpec) -> tuple[int, Any]:
    before = sum(await rows(engine))
    sent = await send_rollout(engine, rollout)
    return sum(await rows(engine)) - before, sent


async def three_steps(tier: dict[str, Any]) -> dict[str, Any]:
    first, second = spec(STEP_1), spec(STEP_2)
    async with open_engine(kwargs_for(first, tier)) as engine:
        step_1, sent_1 = await rows_of(engine, first)
        await engine.sleep(level=1)
        asleep = await worker_value(engine, "get_prompt_embed_cache_stats")
        await engine.wake_up()
        step_2, _ = await rows_of(engine, second)
        await engine.sleep(level=1)
        await engine.wake_up()
        step_3, sent_3 = await rows_of(engine, first)
    same = all(torch.equal(sent_1.latents[index], sent_3.latents[index]) for index in sent_1.latents)
    return {"rows": (step_1, step_2, step_3), "asleep": asleep, "same": same}


def run(rollout: RolloutSpec, mode: str = "ours", tier: dict[str, Any] | None = None) -> RolloutResult:
    """One engine, one rollout (the demo's ``run_mode``): counts are what the rollout added, warm-up excluded."""
    return asyncio.run(run_mode(rollout, mode, cache_size=16, engine_overrides=tier))


def identical(result: RolloutResult, reference: RolloutResult) -> str:
    same = all(torch.equal(result.latents[i], reference.latents[i]) for i in reference.latents)
    return "bit-identical" if same else "DIFFER"


def damage(directory: Path) -> dict[str, str]:
    """Truncate one file, and replace another with the same entry as another model would have written it."""
    from safetensors import safe_open
    from safetensors.torch import save

    files = sorted(directory.glob("*/*.safetensors"))
    truncated, foreign = files[0], files[1]
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    with safe_open(str(foreign), "pt") as opened:
        metadata = dict(opened.metadata())
        tensors = {name: opened.get_tensor(name) for name in opened.keys()}  # noqa: SIM118
    metadata["namespace"] = "another-model-" + metadata["namespace"][14:]
    foreign.write_bytes(save(tensors, metadata))
    return {"truncated": truncated.name, "another model's": foreign.name}


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


RESULTS = Path(__file__).parent / "results" / "tiers.md"
_said: list[str] = []


def say(text: str = "") -> None:
    """Print a line of the results and keep it for :data:`RESULTS` (vLLM-Omni's in-process worker
    prefixes what this process prints from its start on, so the file is the clean copy)."""
    print(text, flush=True)
    _said.append(text)


def table(header: list[str], lines: list[list[Any]]) -> str:
    rows_text = ["| " + " | ".join(str(cell) for cell in line) + " |" for line in lines]
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *rows_text])


def main() -> None:
    from vllm_omni_prompt_cache.cpu_platform.entry_points import opt_in_where_no_gpu

    opt_in_where_no_gpu()  # before vLLM is imported
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    say(f"CPU: {cpu_summary()}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        directory = scratch / "embeddings"
        tiers = {
            # The host tier's default keeps a sleep's entries: "off" measures the cache alone, and the
            # directory tier alone.
            "no tier (cache only)": {"prompt_embed_cache_host_bytes": "off"},
            "host tier (64 MiB)": {"prompt_embed_cache_host_bytes": "64MiB"},
            "default host tier (a sleep's entries)": {},
            "directory tier": {"prompt_embed_cache_host_bytes": "off", "prompt_embed_cache_dir": str(directory)},
        }
        results = {name: asyncio.run(three_steps(tier)) for name, tier in tiers.items()}
        say("### Three rollout steps, sleep and wake between them; step 3 repeats step 1\n")
        say(
            table(
                [
                    "tiers",
                    "rows encoded: step 1",
                    "step 2",
                    "step 3",
                    "device entries asleep",
                    "step 3 latents = step 1",
                ],
                [
                    [name, *result["rows"], result["asleep"]["size"], "bit-identical" if result["same"] else "DIFFER"]
                    for name, result in results.items()
                ],
            )
        )

        restart_spec = spec(STEP_1 + STEP_2)
        restarted = run(restart_spec, tier=tiers["directory tier"])
        reference = run(restart_spec, "off")
        say("\n### A restarted engine on that directory: steps 1 and 2's 8 prompts x 4 siblings\n")
        say(
            table(
                ["engine", "rows encoded", "directory hits", "latents vs no cache"],
                [
                    ["no cache", reference.encoder_rows, "-", "-"],
                    [
                        "restarted, directory tier",
                        restarted.encoder_rows,
                        restarted.stats.dir_hits,
                        identical(restarted, reference),
                    ],
                ],
            )
        )

        shared = scratch / "shared"
        replicated = dataclasses.replace(spec(DEFAULT_PROMPTS[:8]), replicas=2, lb_policy="random")
        own = run(replicated)
        both = run(replicated, tier={"prompt_embed_cache_dir": str(shared)})
        say("\n### Two replicas, vLLM-Omni's random policy: 8 prompts x 4 siblings and a negative prompt\n")

        def per_replica(counts: tuple[int, ...]) -> str:
            return " / ".join(map(str, counts))

        say(
            table(
                [
                    "caches",
                    "requests per replica",
                    "rows encoded per replica (one a call here)",
                    "rows encoded in all",
                    "waited for the other's encode",
                    "bad files",
                ],
                [
                    [
                        "each its own",
                        per_replica(own.requests_per_replica),
                        per_replica(own.encoder_runs_per_replica),
                        own.encoder_rows,
                        "-",
                        "-",
                    ],
                    [
                        "both on one directory",
                        per_replica(both.requests_per_replica),
                        per_replica(both.encoder_runs_per_replica),
                        both.encoder_rows,
                        both.stats.dir_waits,
                        sum(both.stats.dir_rejections.values()),
                    ],
                ],
            )
        )

        def fault_line(fault: str, result: RolloutResult) -> list[Any]:
            return [
                fault,
                f"{len(result.latents)}/{len(restart_spec.requests())}",
                result.encoder_rows,
                json.dumps(dict(result.stats.dir_rejections)),
                result.stats.dir_write_errors,
                identical(result, reference),
            ]

        damaged = damage(directory)
        after = run(restart_spec, tier=tiers["directory tier"])
        lines = [fault_line("a truncated file, and another model's file under this model's name", after)]
        disk = scratch / "full-disk"
        if mount_tmpfs(disk, "64k"):
            try:
                full = run(restart_spec, tier={"prompt_embed_cache_dir": str(disk)})
            finally:
                subprocess.run(["umount", str(disk)], check=False)
            lines.append(fault_line("a full disk (64 KiB tmpfs)", full))
        else:
            lines.append(["a full disk", "not run: this machine does not let us mount a tmpfs", "", "", "", ""])
        say("\n### Faults: the restarted engine's rollout (8 prompts x 4 siblings) on a damaged directory\n")
        say(
            table(
                [
                    "fault",
                    "requests served",
                    "rows encoded",
                    "files removed, by reason",
                    "write errors",
                    "latents vs no cache",
                ],
                lines,
            )
        )
        say(f"\n(damaged: {damaged})")
    RESULTS.write_text("\n".join(_said) + "\n")


if __name__ == "__main__":
    main()
