"""Benchmark-wide set-up: warm the machine, record its facts next to the timings, and share the
encoder and the reference / hit timings that every hit-path group makes."""

from __future__ import annotations

import os
import time

import pytest
import torch
import xxhash

from vllm_omni_prompt_cache.demo.machine import cpu_facts


def _memory_gib() -> float | None:
    """Return total memory in GiB from /proc/meminfo, or None off Linux."""
    try:
        with open("/proc/meminfo") as meminfo:
            kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return None
    return round(kib / 2**20, 1)


def pytest_benchmark_update_machine_info(config, machine_info) -> None:
    model, flags = cpu_facts()
    machine_info.pop("node", None)  # a host name: of no use to a reader of the committed JSON
    machine_info["lscpu_model_name"] = model
    machine_info["simd_flags"] = flags
    machine_info["cpus_available"] = len(os.sched_getaffinity(0))
    machine_info["memory_gib"] = _memory_gib()
    machine_info["torch_version"] = torch.__version__
    machine_info["torch_threads"] = torch.get_num_threads()
    machine_info["xxhash_version"] = xxhash.VERSION


def pytest_benchmark_update_json(config, benchmarks, output_json) -> None:
    # Every round's timing would make the committed JSON ~6x larger; the stats are what we read.
    for benchmark in output_json["benchmarks"]:
        benchmark["stats"].pop("data", None)


@pytest.fixture(scope="session", autouse=True)
def warm_machine() -> None:
    """Keep the CPU busy for a second before the first benchmark.

    Without it the first benchmark of a session measured 8.3 us where the same benchmark run again
    measured 5.4 us (clock ramp-up and first-touch costs land on whichever benchmark runs first).
    """
    ids = torch.randint(1, 32_000, (16, 1024))
    deadline = time.perf_counter() + 1.0
    while time.perf_counter() < deadline:
        xxhash.xxh3_128_digest(ids.numpy())
        torch.mm(ids[:, :64].float(), ids[:, :64].T.float())


@pytest.fixture(scope="session")
def bench_encoder() -> torch.nn.Module:
    """The encoder every hit-path group compares with: a real 6-layer Qwen2 (22M params), built once."""
    from vllm_omni_prompt_cache.tiny.text_encoder import build_qwen2_encoder

    return build_qwen2_encoder(vocab_size=32_000, hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6)


def encoder_label(encoder: torch.nn.Module) -> str:
    return f"a {sum(p.numel() for p in encoder.parameters()) / 1e6:.1f}M-param Qwen2 encoder"


def time_uncached(benchmark, pipeline, ids, mask, group: str, variant: str, *, rounds: int = 15) -> None:
    """Time one call of the original encode_prompt: the group's reference row."""
    original = pipeline._prompt_embed_cache_original_fn
    benchmark.group = group
    benchmark.extra_info.update(variant=variant, role="reference")
    # Fresh tensors on every call, as K sibling requests bring: identity never helps.
    benchmark.pedantic(lambda: original(ids.clone(), mask.clone()), rounds=rounds, warmup_rounds=1)


def time_hits(
    benchmark, pipeline, ids, mask, group: str, variant: str, *, rounds: int, iterations: int, role: str = "ours"
) -> None:
    """Time the whole wrapped call on a hit (fresh input tensors each call); fail if one encoded.

    ``role``: "alternative" for a row the group's "ours" row is compared with (a ratio in its table)."""
    runs_before = pipeline.encoder_runs
    benchmark.group = group
    benchmark.extra_info.update(variant=variant, role=role)
    benchmark.pedantic(
        lambda: pipeline.encode_prompt(ids.clone(), mask.clone()), rounds=rounds, iterations=iterations, warmup_rounds=3
    )
    assert pipeline.encoder_runs == runs_before, "a timed call reached the encoder"
