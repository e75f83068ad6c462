"""What proving a hit costs: a hit and a miss of the same call, before and after, side by side.

    python benchmarks/proof_cost.py [--before a77dba5] [--rounds 3] [--calls 200] [--write FILE]

A hit is proven by running the wrapped method with each text-encoder call answered by a stand-in and
comparing what reaches each call and what the method returns with the entry's record; a miss runs the
method once more so (the reference run) after its encode (``encoder_gate.py``). Two calls are timed,
each as a hit (the same ids again, fresh tensors) and as a miss (ids never seen), in child processes (this
script, run on the package of each tree) that alternate between a checkout of ``--before`` (made with ``git
worktree``, removed afterwards) and this tree, so both see the same machine at the same time. Each child
also measures the peak bytes of tensors alive during one hit and one miss (a dispatch mode adds up what
each op allocates and notes what is freed):

* ``[1,512] ids``: ``TokenIdTextPipeline`` around the 22M-parameter Qwen2 encoder of ``make bench``;
* ``tiny Qwen-Image``: the token-ID Qwen-Image pipeline inside a real ``AsyncOmni`` engine on the CPU
  platform (the tests' tiny checkpoint, fp32), its ``encode_prompt`` called with a templated prompt's ids.

Each child reports the median call of each kind; the table shows the median over rounds, and the hit as
a share of the miss.
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
MARK = "proof-cost results: "  # the child's one line of results among vLLM's log lines


def _median_call(call: Any, calls: int) -> float:
    """Return the median seconds of ``calls`` calls of ``call(i)``."""
    times = []
    for index in range(calls):
        started = time.perf_counter()
        call(index)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _peak_bytes(call: Any) -> int:
    """Return the most bytes of tensors made during ``call()`` that were alive at once."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    live = {"now": 0, "peak": 0}

    def freed(size: int) -> None:
        live["now"] -= size

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            output = func(*args, **(kwargs or {}))
            for tensor in output if isinstance(output, (tuple, list)) else (output,):
                if isinstance(tensor, torch.Tensor) and tensor._base is None:
                    size = tensor.untyped_storage().nbytes()
                    live["now"] += size
                    live["peak"] = max(live["peak"], live["now"])
                    weakref.finalize(tensor, freed, size)
            return output

    with Allocations():
        call()
    return live["peak"]


def _hit_and_miss(encode: Any, fresh_ids: Any, calls: int) -> dict[str, float]:
    """Time ``encode(ids)`` on hits (one prompt's ids, cloned each call) and misses (new ids each call); measure
    the peak bytes of one of each."""
    import torch

    seen = fresh_ids(10_000)
    encode(seen.clone())  # the entry hits are served from
    with torch.inference_mode():
        hit = _median_call(lambda _: encode(seen.clone()), calls)
        miss = _median_call(lambda index: encode(fresh_ids(index)), max(calls // 4, 20))
        hit_bytes = _peak_bytes(lambda: encode(seen.clone()))
        miss_bytes = _peak_bytes(lambda: encode(fresh_ids(20_000)))
    return {"hit_s": hit, "miss_s": miss, "hit_bytes": hit_bytes, "miss_bytes": miss_bytes}


def _micro(calls: int) -> dict[str, float]:
    import torch

    from vllm_omni_prompt_cache import install_prompt_embed_cache
    from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder

    pipeline = TokenIdTextPipeline(build_qwen2_encoder(vocab_size=32_000, hidden_size=256, num_layers=4))
    install_prompt_embed_cache(pipeline, max_size=4096)

    def fresh_ids(seed: int) -> torch.Tensor:
        return torch.randint(1, 32_000, (1, 512), generator=torch.Generator().manual_seed(seed))

    return _hit_and_miss(lambda ids: pipeline.encode_prompt(ids, ids != 0), fresh_ids, calls)


def _tiny_engine(calls: int) -> dict[str, float]:
    import torch

    from vllm_omni_prompt_cache.demo.rollout import RolloutSpec, engine_kwargs
    from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image, load_tokenizer, prompt_token_ids
    from vllm_omni_prompt_cache.tiny.token_id_pipeline import TokenIdQwenImagePipeline
    from vllm_omni_prompt_cache.vllm_omni.engine_client import open_engine

    spec = RolloutSpec(model_dir=ensure_tiny_qwen_image(), prompts=("a red fox",), group_size=1)
    tokenizer = load_tokenizer(spec.model_dir)
    words = ["fox", "lighthouse", "snow", "sea", "storm", "dawn", "hill", "river", "forest", "city", "night"]

    def fresh_ids(seed: int) -> torch.Tensor:
        text = " ".join(words[(seed + step) % len(words)] for step in range(8)) + f" {seed}"
        return torch.tensor([prompt_token_ids(tokenizer, text)])

    async def measure() -> dict[str, float]:
        async with open_engine(engine_kwargs(spec, "ours", 4096, None)):
            # The engine runs in this process (one stage, inline): its pipeline is an object here.
            (pipeline,) = [obj for obj in gc.get_objects() if isinstance(obj, TokenIdQwenImagePipeline)]
            return _hit_and_miss(lambda ids: pipeline.encode_prompt(ids, ids != 0), fresh_ids, calls)

    return asyncio.run(measure())


def child(calls: int) -> None:
    """Measure in this process (its package is whichever tree PYTHONPATH names) and print JSON."""
    from vllm_omni_prompt_cache.cpu_platform.entry_points import opt_in_where_no_gpu

    opt_in_where_no_gpu()  # before vLLM is imported: without a GPU, the engine runs on the opt-in CPU platform
    print(MARK + json.dumps({"[1,512] ids": _micro(calls), "tiny Qwen-Image": _tiny_engine(calls)}), flush=True)


def _run_child(tree: Path, calls: int) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    script = Path(__file__)  # this script, on the tree's package (PYTHONPATH)
    done = subprocess.run(
        [sys.executable, str(script), "--child", "--calls", str(calls)],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"the child on {tree} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    # vLLM's engine prefixes this process's stdout lines with its worker's name once it has started.
    (line,) = [line for line in done.stdout.splitlines() if MARK in line]
    return json.loads(line.split(MARK, 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="a77dba5", help="the revision to compare with (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="child processes per tree (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=200, help="hits timed per child (default: %(default)s)")
    parser.add_argument("--write", type=Path, help="also write the table to this file")
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
    lines = [
        f"Hit and miss of one call, before ({arguments.before}) and after; median of {arguments.rounds} child "
        f"processes each, {arguments.calls} hits per child. CPU: {cpu_summary()}.",
        "",
        "| call | hit before | hit after | miss before | miss after | miss after / before | hit after / miss after "
        "| peak bytes: hit / miss (after) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for call in results["after"][0]:

        def median(tree: str, kind: str, call: str = call) -> float:
            return statistics.median(run[call][kind] for run in results[tree])

        hit_before, hit_after = median("before", "hit_s"), median("after", "hit_s")
        miss_before, miss_after = median("before", "miss_s"), median("after", "miss_s")
        hit_bytes, miss_bytes = median("after", "hit_bytes"), median("after", "miss_bytes")
        lines.append(
            f"| {call} | {hit_before * 1e6:.0f} us | {hit_after * 1e6:.0f} us | {miss_before * 1e3:.2f} ms | "
            f"{miss_after * 1e3:.2f} ms | {miss_after / miss_before:.3f} | {hit_after / miss_after:.1%} | "
            f"{hit_bytes / 1024:.0f} KiB / {miss_bytes / 1024:.0f} KiB |"
        )
    table = "\n".join(lines)
    print(table)
    if arguments.write:
        arguments.write.write_text(table + "\n")


if __name__ == "__main__":
    main()
