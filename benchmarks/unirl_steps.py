"""UniRL's training loop through the real engine: text-encoder runs and wall time per step, per cache set-up.

Each set-up gets its own in-process ``Omni``, driven as UniRL's backend drives it (see
``vllm_omni_prompt_cache/tiny/unirl.py``): per step, ``generate`` (P prompts x K siblings collapsed
by ``num_outputs_per_prompt``, a shared negative prompt), then ``handle_sleep_task(level=1)``, a DiT
weight sync, ``handle_wake_task``. The dataset comes back to its first prompts after half the steps.
Set-ups, side by side in one run (rounds alternate them; the times are each step's median):

* no cache;
* vLLM-Omni's own cache, cleared before each sleep (what UniRL PR #449 does, as its
  ``DiTWeightSyncExtension.sleep`` calls ``clear_prompt_embed_cache``);
* this package's cache, host tier off (what a sleep did before the host tier defaulted to ``auto``);
* this package's cache with its defaults;
* this package's cache with a host tier of 64 MiB (``prompt_embed_cache_host_bytes="64MiB"``).

    python benchmarks/unirl_steps.py [--steps 4] [--prompts 2] [--group-size 4] [--rounds 3] [--route deploy]

Prints a Markdown table (and the machine it ran on); run it with the vLLM-Omni release to measure,
e.g. ``.nox/releases-vllm_omni-0-28-0/bin/python benchmarks/unirl_steps.py`` for UniRL's pin.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_omni_prompt_cache.demo.machine import cpu_summary

CACHE_ON = {"enable_prompt_embed_cache": True, "prompt_embed_cache_size": 32}
SETUPS: dict[str, dict[str, Any]] = {
    "no cache": {},
    "vLLM-Omni's cache, cleared at sleep (UniRL PR #449)": {**CACHE_ON, "prompt_embed_cache_backend": "vllm-omni"},
    "ours, host tier off": {**CACHE_ON, "prompt_embed_cache_host_bytes": "off"},
    "ours, defaults": dict(CACHE_ON),
    "ours, host tier 64MiB": {**CACHE_ON, "prompt_embed_cache_host_bytes": "64MiB"},
}
CLEARS_BEFORE_SLEEP = {"vLLM-Omni's cache, cleared at sleep (UniRL PR #449)"}


def run_setup(name: str, args: argparse.Namespace, deploy_config: str | None) -> dict[str, list[float]]:
    from vllm_omni_prompt_cache.demo.command import DEMO_MODEL
    from vllm_omni_prompt_cache.tiny import unirl
    from vllm_omni_prompt_cache.tiny.qwen_image import SAMPLE_NEGATIVE_PROMPT, SAMPLE_PROMPTS, ensure_tiny_qwen_image

    half = [SAMPLE_PROMPTS[i * args.prompts : (i + 1) * args.prompts] for i in range(args.steps // 2)]
    steps = half + half  # the dataset's second pass
    seen: dict[str, list[float]] = {"runs": [], "step_s": [], "sleep_wake_s": []}
    model = str(ensure_tiny_qwen_image(DEMO_MODEL if args.model == "demo" else None))
    with unirl.UniRLRollout(model, SETUPS[name], deploy_config=deploy_config) as rollout:
        for step, texts in enumerate(steps):
            before = rollout.worker("text_encoder_counters")["encoder_runs"]
            started = time.perf_counter()
            rollout.generate(
                unirl.grouped_prompts(texts, SAMPLE_NEGATIVE_PROMPT), unirl.sampling_kwargs(args.group_size, seed=step)
            )
            generated = time.perf_counter()
            if name in CLEARS_BEFORE_SLEEP:
                rollout.worker("clear_cache_before_sleep")
            rollout.sleep()
            rollout.worker("sync_weights", "transformer", step)
            rollout.wake()
            seen["step_s"].append(time.perf_counter() - started)
            seen["sleep_wake_s"].append(time.perf_counter() - generated)
            seen["runs"].append(rollout.worker("text_encoder_counters")["encoder_runs"] - before)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps (even: the second half repeats)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts a step")
    parser.add_argument("--group-size", type=int, default=4, help="siblings a prompt (num_outputs_per_prompt)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every set-up, alternating")
    parser.add_argument("--route", choices=("kwargs", "deploy"), default="deploy", help="with a deploy config or not")
    parser.add_argument(
        "--model",
        choices=("demo", "tiny"),
        default="demo",
        help="demo: the demo's checkpoint, whose text encoder costs what it does in real rollouts; tiny: the tests'",
    )
    args = parser.parse_args()
    if args.steps < 2 or args.steps % 2 or args.prompts < 1 or args.group_size < 1 or args.rounds < 1:
        parser.error("--steps must be an even number >= 2; --prompts, --group-size and --rounds >= 1")

    from vllm_omni_prompt_cache.cpu_platform.entry_points import opt_in_where_no_gpu

    opt_in_where_no_gpu()  # before vLLM is imported
    from vllm_omni_prompt_cache.tiny import unirl

    deploy_config = None
    if args.route == "deploy":
        path = Path(tempfile.mkdtemp()) / "deploy.yaml"
        path.write_text(unirl.deploy_config_text())
        deploy_config = str(path)
    results: dict[str, list[dict[str, list[float]]]] = {name: [] for name in SETUPS}
    for _ in range(args.rounds):
        for name in SETUPS:
            results[name].append(run_setup(name, args, deploy_config))

    versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in ("vllm-omni", "vllm", "torch"))
    print(
        f"UniRL loop, {args.route} route, {args.model} model: {args.steps} steps x {args.prompts} prompts x "
        f"{args.group_size} siblings, 64x64, 2 denoising steps, CFG; {args.rounds} rounds; {versions}; "
        f"CPU: {cpu_summary()}\n"
    )
    steps = " | ".join(f"step {i + 1}" for i in range(args.steps))
    print(f"| set-up | text-encoder runs per step | {steps} (median s) | sleep + sync + wake (median s) |")
    print("|---|---|" + "---|" * args.steps + "---|")
    for name, rounds in results.items():
        runs = rounds[0]["runs"]
        if any(each["runs"] != runs for each in rounds):
            raise SystemExit(f"{name}: encoder runs differ between rounds: {[each['runs'] for each in rounds]}")
        times = [statistics.median(each["step_s"][i] for each in rounds) for i in range(args.steps)]
        sleep_wake = statistics.median(t for each in rounds for t in each["sleep_wake_s"])
        print(
            f"| {name} | {', '.join(str(int(n)) for n in runs)} | "
            + " | ".join(f"{t:.3f}" for t in times)
            + f" | {sleep_wake:.3f} |"
        )


if __name__ == "__main__":
    main()
