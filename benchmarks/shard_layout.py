"""Files and read time per entry: one file per entry (the directory tier) against packed shards.

Writes N tiny entries through the real cache (a tiny Qwen2 text encoder, distinct token-ID prompts,
the directory tier), then reads every one back through a fresh cache on the same root (a new
"process": nothing in memory, every call a directory hit), first from the per-entry files, then
after ``pack`` from the shards. Both reads find the files in the page cache (just written): this
measures the tier's own cost per entry; on a shared filesystem each per-entry file adds its
metadata round trips (open, stat) on top, which the shards' one open per shard does not pay.

    python benchmarks/shard_layout.py [--entries 10000] [--shard-bytes 64MiB]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.demo.machine import cpu_summary
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.settings.schema import MAX_BYTES
from vllm_omni_prompt_cache.store.tiers.directory_shards import SHARDS, pack
from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder


def prompt(index: int) -> torch.Tensor:
    return torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, index % 97, index // 97 % 97, index // 9409 + 1]])


def encode(pipeline: TokenIdTextPipeline, index: int) -> None:
    ids = prompt(index)
    pipeline.encode_prompt(ids, torch.ones_like(ids))


#: File-system calls that go to a shared filesystem's metadata server (counted while entries are read).
METADATA_CALLS = ("open", "stat", "lstat", "utime")


@contextlib.contextmanager
def counting_metadata_calls() -> Iterator[Counter]:
    """Count this process's calls of :data:`METADATA_CALLS` (through the ``os`` module) inside the block."""
    counts: Counter = Counter()
    originals = {name: getattr(os, name) for name in METADATA_CALLS}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in METADATA_CALLS:
        setattr(os, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(os, name, original)


def read_all(root: Path, entries: int) -> tuple[list[float], int, int, Counter]:
    """Read every entry through a fresh cache on ``root``; return per-entry seconds (the first read, which
    fingerprints the namespace, left out), directory hits and encodes."""
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline, max_size=1, settings=PromptEmbedCacheSettings(directory=root))
    encode(pipeline, 0)  # the namespace's fingerprint is computed on first use: not a read's cost
    times = []
    with counting_metadata_calls() as calls:
        for index in range(1, entries):
            started = time.perf_counter()
            encode(pipeline, index)
            times.append(time.perf_counter() - started)
    return times, cache.snapshot().dir_hits, pipeline.encoder_runs, calls


def files_under(directory: Path) -> tuple[int, int]:
    paths = [path for path in directory.rglob("*") if path.is_file()]
    return len(paths), sum(path.stat().st_size for path in paths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--shard-bytes", default="64MiB")
    args = parser.parse_args()
    if args.entries < 2:
        parser.error("--entries must be >= 2")
    shard_bytes = MAX_BYTES.parse(args.shard_bytes, "--shard-bytes")
    root = Path(tempfile.mkdtemp(prefix="shard-layout-"))
    writer = TokenIdTextPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(writer, max_size=1, settings=PromptEmbedCacheSettings(directory=root))
    started = time.perf_counter()
    for index in range(args.entries):
        encode(writer, index)
    written_s = time.perf_counter() - started
    namespace = cache.directory.namespace
    directory = root / namespace
    rows = []
    files, size = files_under(directory)
    rows.append(("one file per entry", files, size, *read_all(root, args.entries)))
    started = time.perf_counter()
    report = pack(directory, namespace, shard_bytes=shard_bytes)
    pack_s = time.perf_counter() - started
    files, size = files_under(directory)
    rows.append(
        (f"shards of {args.shard_bytes} ({report.shards} shards + index)", files, size, *read_all(root, args.entries))
    )
    print(
        f"{args.entries} entries (tiny Qwen2 encoder, 11-token prompts), written in {written_s:.1f} s, packed in "
        f"{pack_s:.2f} s; page cache warm; CPU: {cpu_summary()}\n"
    )
    print(
        "| layout | files in the namespace | MiB | read per entry, median (us) | mean (us) | directory hits | "
        f"encodes | {' / '.join(METADATA_CALLS)} calls while reading |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, count, total, seconds, dir_hits, runs, calls in rows:
        print(
            f"| {name} | {count} | {total / 2**20:.1f} | {statistics.median(seconds) * 1e6:.0f} | "
            f"{statistics.fmean(seconds) * 1e6:.0f} | {dir_hits} | {runs} | "
            + " / ".join(str(calls[call]) for call in METADATA_CALLS)
            + " |"
        )
    files_left = sorted(path.name for path in directory.iterdir() if path.is_file())
    print(f"\nAfter the pack the namespace holds {files_left} and {SHARDS}/ ({report.entries} entries indexed).")


if __name__ == "__main__":
    main()
