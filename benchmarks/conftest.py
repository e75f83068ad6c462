"""Benchmark-wide set-up: warm the machine, record the machine facts the tables need next to the timings."""

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
