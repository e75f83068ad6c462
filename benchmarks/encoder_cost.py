"""What a hit and a miss cost, before and after, side by side; and what the method's own code costs.

    python benchmarks/encoder_cost.py [--before 93c5d4e] [--rounds 3] [--calls 200] [--write FILE]

A hit runs the wrapped method as written with each text-encoder call answered from the cache; the floor of that is
the method's body with its encoder answered by a ready output, which no hit can skip. Timed in child processes (this
script, run on the package of each tree) that alternate between a checkout of ``--before`` (made with ``git
worktree``, removed afterwards) and this tree, so both see the same machine at the same time:

* ``[1,512] ids``: ``TokenIdTextPipeline`` around the 22M-parameter Qwen2 encoder of ``make bench``;
* ``tiny Qwen-Image``: the token-ID Qwen-Image pipeline inside a real ``AsyncOmni`` engine on the CPU platform (the
  tests' and the demo's tiny checkpoint, fp32), its ``encode_prompt`` called with a templated prompt's ids; for it
  also the uncached call (the cache switched off), the floor (that call with the text encoder's forward answering
  its own first output), and the cache's bytes per entry (what one prompt costs it: the demo's model);
* ``tiny Qwen-Image, text``: the stock ``QwenImagePipeline.encode_prompt`` text path of the same pipeline (a string
  prompt through the real tokenizer and chat template), hit against uncached (after only: before, that path was not
  wrapped when called on the class).

Each child reports medians; the table shows the median over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MARK = "encoder-cost results: "  # the child's one line of results among vLLM's log lines


def _median_us(call: Any, calls: int) -> float:
    times = []
    for index in range(calls):
        started = time.perf_counter()
        call(index)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def _hit_and_miss(encode: Any, fresh_ids: Any, calls: int) -> dict[str, float]:
    seen = fresh_ids(10_000)
    encode(seen.clone())  # the entry hits are served from
    encode(seen.clone())  # and a first hit
    return {
        "hit_us": _median_us(lambda _: encode(seen.clone()), calls),
        "miss_us": _median_us(lambda index: encode(fresh_ids(index)), max(calls // 4, 20)),
    }


def _micro(calls: int) -> dict[str, float]:
    import torch

    from vllm_omni_prompt_cache import install_prompt_embed_cache
    from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder

    pipeline = TokenIdTextPipeline(build_qwen2_encoder(vocab_size=32_000, hidden_size=256, num_layers=4))
    install_prompt_embed_cache(pipeline, max_size=4096)

    def fresh_ids(seed: int) -> torch.Tensor:
        return torch.randint(1, 32_000, (1, 512), generator=torch.Generator().manual_seed(seed))

    with torch.inference_mode():
        return _hit_and_miss(lambda ids: pipeline.encode_prompt(ids, ids != 0), fresh_ids, calls)


def _tiny_engine(calls: int) -> dict[str, dict[str, float]]:
    import torch
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline

    from vllm_omni_prompt_cache.demo.rollout import RolloutSpec, engine_kwargs
    from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image, load_tokenizer, prompt_token_ids
    from vllm_omni_prompt_cache.tiny.token_id_pipeline import TokenIdQwenImagePipeline
    from vllm_omni_prompt_cache.vllm_omni.engine_client import open_engine

    spec = RolloutSpec(model_dir=ensure_tiny_qwen_image(), prompts=("a red fox",), group_size=1)
    tokenizer = load_tokenizer(spec.model_dir)
    words = ["fox", "lighthouse", "snow", "sea", "storm", "dawn", "hill", "river", "forest", "city", "night"]

    def text(seed: int) -> str:
        return " ".join(words[(seed + step) % len(words)] for step in range(8)) + f" {seed}"

    def fresh_ids(seed: int) -> torch.Tensor:
        return torch.tensor([prompt_token_ids(tokenizer, text(seed))])

    async def measure() -> dict[str, dict[str, float]]:
        async with open_engine(engine_kwargs(spec, "ours", 4096, None)):
            # The engine runs in this process (one stage, inline): its pipeline is an object here.
            (pipeline,) = [obj for obj in gc.get_objects() if isinstance(obj, TokenIdQwenImagePipeline)]
            cache = pipeline._prompt_embed_cache
            encode = pipeline.encode_prompt
            with torch.inference_mode():
                ids = fresh_ids(10_000)
                cached = _hit_and_miss(lambda i: encode(i, i != 0), fresh_ids, calls)
                with cache.disabled():
                    cached["uncached_us"] = _median_us(lambda _: encode(ids.clone(), ids != 0), max(calls // 4, 20))
                    encoder = pipeline.text_encoder
                    ready = encoder(input_ids=ids, attention_mask=(ids != 0).long(), output_hidden_states=True)
                    object.__setattr__(encoder, "forward", lambda *args, **kwargs: ready)
                    try:  # the body alone: the encoder's forward answers at once (its hooks still run)
                        cached["floor_us"] = _median_us(lambda _: encode(ids.clone(), ids != 0), calls)
                    finally:
                        object.__delattr__(encoder, "forward")
                before = cache.snapshot()
                for seed in range(20_000, 20_016):
                    encode(fresh_ids(seed), fresh_ids(seed) != 0)
                after = cache.snapshot()
                cached["bytes_per_entry"] = (after.bytes - before.bytes) / max(after.size - before.size, 1)
                prompt = text(30_000)

                def stock(_: int) -> Any:  # the stock text path, called on the class: not wrapped, its encoder is
                    return QwenImagePipeline.encode_prompt(pipeline, prompt=[prompt], max_sequence_length=256)

                stock(0)
                texts = {"hit_us": _median_us(stock, calls)}
                with cache.disabled():
                    texts["uncached_us"] = _median_us(stock, max(calls // 4, 20))
            return {"tiny Qwen-Image": cached, "tiny Qwen-Image, text": texts}

    return asyncio.run(measure())


def child(calls: int) -> None:
    """Measure in this process (its package is whichever tree PYTHONPATH names) and print JSON."""
    from vllm_omni_prompt_cache.cpu_platform.entry_points import opt_in_where_no_gpu

    opt_in_where_no_gpu()  # before vLLM is imported: without a GPU, the engine runs on the opt-in CPU platform
    print(MARK + json.dumps({"[1,512] ids": _micro(calls), **_tiny_engine(calls)}), flush=True)


def _run_child(tree: Path, calls: int) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, str(Path(__file__)), "--child", "--calls", str(calls)],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"the child on {tree} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    (line,) = [line for line in done.stdout.splitlines() if MARK in line]
    return json.loads(line.split(MARK, 1)[1])


def _cell(results: list[dict], call: str, kind: str) -> float | None:
    values = [run[call][kind] for run in results if kind in run.get(call, {})]
    return statistics.median(values) if values else None


def _us(value: float | None) -> str:
    return "" if value is None else f"{value:.0f} us" if value < 10_000 else f"{value / 1000:.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="93c5d4e", help="the revision to compare with (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="child processes per tree (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=200, help="hits timed per child (default: %(default)s)")
    parser.add_argument("--write", type=Path, help="also write the tables to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    for name in ("rounds", "calls"):
        if getattr(arguments, name) < 1:
            parser.error(f"--{name} must be a whole number >= 1, got {getattr(arguments, name)}")
    if arguments.child:
        child(arguments.calls)
        return
    from vllm_omni_prompt_cache.demo.machine import cpu_summary

    with tempfile.TemporaryDirectory() as scratch:
        before_tree = Path(scratch) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(before_tree), arguments.before], cwd=ROOT, check=True)
        try:
            results: dict[str, list[dict]] = {"before": [], "after": []}
            for _ in range(arguments.rounds):  # alternate, so that both see the machine as it is then
                results["before"].append(_run_child(before_tree, arguments.calls))
                results["after"].append(_run_child(ROOT, arguments.calls))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before_tree)], cwd=ROOT, check=False)
    before, after = results["before"], results["after"]
    lines = [
        f"Before ({arguments.before}) and after, side by side; median of {arguments.rounds} child processes each, "
        f"{arguments.calls} hits per child. CPU: {cpu_summary()}.",
        "",
        "| call | hit before | hit after | miss before | miss after | uncached (after) | floor (after) "
        "| miss after / uncached | hit after - floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for call in after[0]:
        hit_b, hit_a = _cell(before, call, "hit_us"), _cell(after, call, "hit_us")
        miss_b, miss_a = _cell(before, call, "miss_us"), _cell(after, call, "miss_us")
        uncached, floor = _cell(after, call, "uncached_us"), _cell(after, call, "floor_us")
        ratio = f"{miss_a / uncached:.3f}" if miss_a is not None and uncached else ""
        over = f"{hit_a - floor:+.0f} us" if hit_a is not None and floor is not None else ""
        lines.append(
            f"| {call} | {_us(hit_b)} | {_us(hit_a)} | {_us(miss_b)} | {_us(miss_a)} | {_us(uncached)} | "
            f"{_us(floor)} | {ratio} | {over} |"
        )
    per_entry_before = _cell(before, "tiny Qwen-Image", "bytes_per_entry")
    per_entry_after = _cell(after, "tiny Qwen-Image", "bytes_per_entry")
    lines += [
        "",
        f"Cache bytes per prompt on the tiny Qwen-Image engine (the demo's model; 16 new prompts, tensor bytes and "
        f"witness bytes): before {per_entry_before / 1024:.2f} KiB, after {per_entry_after / 1024:.2f} KiB "
        f"({per_entry_after / per_entry_before:.3f} times).",
    ]
    table = "\n".join(lines)
    print(table)
    if arguments.write:
        arguments.write.write_text(table + "\n")


if __name__ == "__main__":
    main()
