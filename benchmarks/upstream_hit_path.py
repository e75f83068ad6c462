"""What a cached call costs with the upstream series' module (after PR 1, and after the whole series),
side by side with vLLM-Omni 0.30's own module and this package's plugin, in one process (the numbers
``upstream/README.md`` quotes).

    python benchmarks/upstream_hit_path.py [--rounds 60] [--pr5195-module PATH] [--write FILE]

Each implementation wraps the same pipeline, whose ``encode_prompt`` returns a ready tensor, so a
row's time is the wrapper's own cost: key, lookup and (for ours) the witness compare on a hit, or the
key attempt and the original call on a bypass. Every call passes fresh tensors (``clone()``), as the K
siblings of a rollout group do; "bare call" is the same call with no cache. Rounds of each variant
are interleaved, and the best and median round per call are reported. One real encode of a 22M
Qwen2 text encoder ([1,512]) is timed for scale. ``--pr5195-module`` adds the
``prompt_embed_cache.py`` of vLLM-Omni PR #5195's head, 485f1be (closed unmerged; it keys int64/bool
tensors by their raw bytes, with the device), from a file you supply; this repository carries no
copy of it. Every release up to 0.32.0rc1 ships 0.30's module.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

import torch

from vllm_omni_prompt_cache.demo.machine import cpu_summary

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "a photo of a red fox standing on a snowy hill at dawn, highly detailed"


class Pipeline:
    """An ``encode_prompt`` taking text or token ids (the ids and mask parameters of verl-omni's
    Qwen-Image encode, a ``prompt`` for text calls) whose encoder costs nothing."""

    def __init__(self) -> None:
        self.runs = 0
        self.output = (torch.zeros(1, 512, 64), torch.ones(1, 512, dtype=torch.bool))

    def encode_prompt(
        self, prompt=None, prompt_ids=None, attention_mask=None, num_images_per_prompt=1, max_sequence_length=512
    ):
        self.runs += 1
        return self.output


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def implementations(pr_module: Path | None) -> dict[str, Callable[[Pipeline], object]]:
    from vllm_omni_prompt_cache import install_prompt_embed_cache
    from vllm_omni_prompt_cache.vllm_omni.bindings import upstream_cache_module

    modules = {"vLLM-Omni 0.30 module": upstream_cache_module()}
    if pr_module is not None:
        modules["vLLM-Omni #5195 module"] = _load(pr_module, "pr5195_prompt_embed_cache")
    series = _load(ROOT / "upstream" / "check" / "run_series.py", "upstream_run_series")
    package = Path(importlib.util.find_spec("vllm_omni").origin).parent
    last = len(series.series_steps())
    for number, label in ((1, "series PR 1 module"), (last, f"series PR {last} module (whole series)")):
        path = series.step_module(package, Path(tempfile.mkdtemp(prefix=f"series-pr{number}-")), number)
        modules[label] = _load(path, f"series_pr{number}_prompt_embed_cache")
    variants: dict[str, Callable[[Pipeline], object]] = {"no cache (bare call)": lambda pipeline: None}
    for name, module in modules.items():
        variants[name] = lambda pipeline, m=module: m.install_prompt_embed_cache(pipeline, max_size=8)
    variants["this package's plugin"] = lambda pipeline: install_prompt_embed_cache(pipeline, max_size=8)
    return variants


def cases() -> dict[str, Callable[[], dict]]:
    generator = torch.Generator().manual_seed(0)
    small = torch.randint(1, 32_000, (1, 512), generator=generator)
    large = torch.randint(1, 32_000, (16, 1024), generator=generator)
    return {
        "text prompt": lambda: {"prompt": PROMPT, "num_images_per_prompt": 1},
        "[1,512] int64 ids + bool mask": lambda: {"prompt_ids": small.clone(), "attention_mask": small != 0},
        "[16,1024] int64 ids + bool mask": lambda: {"prompt_ids": large.clone(), "attention_mask": large != 0},
    }


def time_round(call: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def one_real_encode_ms() -> float:
    from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder

    encoder = build_qwen2_encoder(vocab_size=32_000, hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6)
    pipeline = TokenIdTextPipeline(encoder)
    ids = torch.randint(1, 32_000, (1, 512), generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(6):
        start = time.perf_counter()
        pipeline.encode_prompt(ids, ids != 0)
        times.append(time.perf_counter() - start)
    return min(times[1:]) * 1e3


def measure(rounds: int, pr_module: Path | None) -> list[dict]:
    rows = []
    for case, make_kwargs in cases().items():
        calls = 200 if case.startswith("[16") else 1000
        variants = {}
        for name, install in implementations(pr_module).items():
            pipeline = Pipeline()
            install(pipeline)
            pipeline.encode_prompt(**make_kwargs())  # fill the cache where there is one
            runs_before = pipeline.runs
            variants[name] = (pipeline, runs_before, [])
        gc.disable()
        try:
            for _ in range(rounds):
                for pipeline, _, times in variants.values():
                    times.append(time_round(lambda p=pipeline, k=make_kwargs: p.encode_prompt(**k()), calls))
        finally:
            gc.enable()
        bare = min(variants["no cache (bare call)"][2])
        for name, (pipeline, runs_before, times) in variants.items():
            reached_encoder = pipeline.runs - runs_before
            did = "encoder ran" if reached_encoder else "hit"
            cache = getattr(pipeline, "_prompt_embed_cache", None)
            if cache is not None and cache.stats()["bypassed"]:
                did = "bypassed: encoder ran"
            rows.append(
                {
                    "case": case,
                    "implementation": name,
                    "did": "-" if name.startswith("no cache") else did,
                    "best_us": min(times),
                    "median_us": statistics.median(times),
                    "over_bare_us": min(times) - bare,
                }
            )
    return rows


def digest_costs() -> list[tuple[str, float, float, float]]:
    """Best-of-5 costs of what keying an array input does: the digest (xxh3-128; blake3, the fallback
    without xxhash) and a copy of its bytes (what a hit's witness compare makes of the caller's)."""
    import timeit

    import blake3
    import xxhash

    rows = []
    for label, shape in (("128 KiB ([16,1024] int64)", (16, 1024)), ("2 MiB ([64,4096] int64)", (64, 4096))):
        array = torch.randint(1, 32_000, shape).numpy()
        view = array.reshape(-1).view("uint8")

        def best(call: Callable[[], object], view=view) -> float:
            return min(timeit.repeat(call, number=100, repeat=5)) / 100 * 1e6

        rows.append(
            (
                label,
                best(lambda view=view: xxhash.xxh3_128_digest(view)),
                best(lambda view=view: blake3.blake3(view).digest(length=16)),
                best(lambda view=view: view.tobytes()),
            )
        )
    return rows


def render(rows: list[dict], encode_ms: float, rounds: int, pr_module: Path | None) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    lines = [
        f"{cpu_summary()}; Python {sys.version.split()[0]}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); {datetime.now(UTC):%Y-%m-%d %H:%M} UTC at commit "
        f"{commit.stdout.strip() or 'unknown'}; {rounds} interleaved rounds per variant.",
        "",
        "| call | implementation | what the call did | best us/call | median us/call | best over the bare call (us) |",
        "|---|---|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['implementation']} | {row['did']} | {row['best_us']:.2f} | "
            f"{row['median_us']:.2f} | {row['over_bare_us']:.2f} |"
        )
    lines += ["", f"One real encode for scale (22M-param Qwen2 text encoder, [1,512], best of 5): {encode_ms:.1f} ms."]
    if pr_module is not None:
        sha = hashlib.sha256(pr_module.read_bytes()).hexdigest()
        lines += ["", f"vLLM-Omni #5195 module: {pr_module.name}, sha256 {sha}."]
    lines += [
        "",
        "| input bytes | xxh3-128 (us) | blake3, 16 bytes (us) | copy of the bytes (us) |",
        "|---|---:|---:|---:|",
        *(f"| {label} | {xxh:.1f} | {b3:.1f} | {copy:.1f} |" for label, xxh, b3, copy in digest_costs()),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60, help="interleaved timing rounds per variant (>= 1)")
    parser.add_argument(
        "--pr5195-module", type=Path, help="prompt_embed_cache.py of vLLM-Omni PR #5195 (485f1be), to compare with"
    )
    parser.add_argument("--write", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.pr5195_module is not None and not args.pr5195_module.is_file():
        parser.error(f"--pr5195-module {args.pr5195_module}: no such file")
    rows = measure(args.rounds, args.pr5195_module)
    table = render(rows, one_real_encode_ms(), args.rounds, args.pr5195_module)
    print(table)
    if args.write:
        args.write.write_text(table)


if __name__ == "__main__":
    main()
