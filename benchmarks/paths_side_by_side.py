"""The hit path and the row path of two versions of this package, side by side in one run.

    .venv/bin/python benchmarks/paths_side_by_side.py --before 346e052 [--rounds 7] [--write FILE]

A refactor must not make a hit slower. Each version runs in processes of its own (its source from
``git archive`` of the revision, or this checkout), one after the other, ``--rounds`` times over,
so that load on a shared machine falls on both alike; each process builds the same real 6-layer
Qwen2 encoder as ``make bench`` and times, best of many short rounds (fresh input tensors each call):

* whole-call hit   ``encode_prompt`` of a token-ID pipeline, [1,512], served from the cache
* one-row hit      the same call on a pipeline with a row layout: the one-row test, the row key
* 16 cached rows   a batched call of 4 prompts x 4 siblings, every row cached: split, keys, assembly

The table gives each version's best time over all its processes and the ratio after / before.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time, timeit
sys.path.insert(0, sys.argv[1])
import torch
import vllm_omni_prompt_cache as package
assert package.__file__.startswith(sys.argv[1]), package.__file__
from vllm_omni_prompt_cache import install_prompt_embed_cache
try:
    from vllm_omni_prompt_cache.calls.layouts import TOKEN_IDS
except ImportError:  # a revision before the folders (issue 60)
    from vllm_omni_prompt_cache.layouts import TOKEN_IDS
from vllm_omni_prompt_cache.tiny.text_encoder import (
    QwenStyleTokenPipeline, TokenIdTextPipeline, build_qwen2_encoder)

torch.set_num_threads(1)
encoder = build_qwen2_encoder(vocab_size=32_000, hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6)

def install(pipeline, max_size, layout=None):
    if layout is None:
        return install_prompt_embed_cache(pipeline, max_size=max_size)
    try:
        from vllm_omni_prompt_cache import PromptEmbedCacheSettings
        settings = PromptEmbedCacheSettings(row_layout=layout)
        return install_prompt_embed_cache(pipeline, max_size=max_size, settings=settings)
    except TypeError:  # a version before the settings object: the keyword
        return install_prompt_embed_cache(pipeline, max_size=max_size, row_layout=layout)

def best(call, number):
    for _ in range(3):
        call()
    return min(timeit.repeat(call, number=number, repeat=60)) / number

generator = torch.Generator().manual_seed(0)
ids = torch.randint(1, 32_000, (1, 512), generator=generator)
whole = TokenIdTextPipeline(encoder)
install(whole, 8)
whole.encode_prompt(ids, ids != 0)
row = QwenStyleTokenPipeline(encoder)
install(row, 8, TOKEN_IDS)
row.encode_prompt(ids, ids != 0)
lengths = torch.randint(100, 250, (4,), generator=generator).tolist()
prompts = [torch.randint(1, 32_000, (length,), generator=generator) for length in lengths]
batch = torch.zeros(16, max(lengths), dtype=torch.int64)
for index in range(16):
    batch[index, : lengths[index % 4]] = prompts[index % 4]
rows = QwenStyleTokenPipeline(encoder)
install(rows, 64, TOKEN_IDS)
rows.encode_prompt(batch, batch != 0)
before = (whole.encoder_runs, row.encoder_runs, rows.encoder_runs)
times = {
    "whole-call hit, [1,512]": best(lambda: whole.encode_prompt(ids.clone(), (ids != 0).clone()), 100),
    "one-row hit, [1,512], row layout": best(lambda: row.encode_prompt(ids.clone(), (ids != 0).clone()), 100),
    "16 cached rows (4 prompts x 4)": best(lambda: rows.encode_prompt(batch.clone(), (batch != 0).clone()), 10),
}
assert (whole.encoder_runs, row.encoder_runs, rows.encoder_runs) == before, "a timed call reached the encoder"
print(json.dumps(times))
"""


def source_of(revision: str, into: Path) -> Path:
    """Return a directory holding the package as it was at ``revision`` ('.' : this checkout)."""
    if revision == ".":
        return ROOT
    archive = subprocess.run(["git", "archive", revision, "vllm_omni_prompt_cache"], cwd=ROOT, capture_output=True)
    archive.check_returncode()
    target = into / revision
    target.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the git revision to compare with")
    parser.add_argument("--after", default=".", help="the revision measured against it (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=7, help="processes per version, alternating")
    parser.add_argument("--write", type=Path, help="also write the table (Markdown) to this file")
    args = parser.parse_args()
    best: dict[str, dict[str, float]] = {args.before: {}, args.after: {}}
    with tempfile.TemporaryDirectory() as scratch:
        trees = {revision: source_of(revision, Path(scratch)) for revision in best}
        for _ in range(args.rounds):
            for revision, tree in trees.items():
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, str(tree)], capture_output=True, text=True, cwd=scratch
                )
                if out.returncode:
                    sys.exit(f"{revision}: {out.stderr[-2000:]}")
                for name, seconds in json.loads(out.stdout.strip().splitlines()[-1]).items():
                    best[revision][name] = min(seconds, best[revision].get(name, float("inf")))
    from vllm_omni_prompt_cache.demo.machine import cpu_facts

    model, flags = cpu_facts()
    lines = [
        f"CPU: {model} ({flags}); {args.rounds} processes per version, alternating; best of 60 rounds each; "
        "torch threads 1",
        "",
        f"| path | before ({args.before}) | after ({args.after}) | after / before |",
        "|---|---:|---:|---:|",
    ]
    for name, seconds in best[args.before].items():
        after = best[args.after][name]
        lines.append(f"| {name} | {seconds * 1e6:.1f} us | {after * 1e6:.1f} us | {after / seconds:.3f} |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        args.write.write_text(table + "\n")


if __name__ == "__main__":
    main()
