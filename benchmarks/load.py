"""Load through the real client: ``vllm serve TINY --omni`` with the cache, driven by ``vllm bench serve --omni``.

Prints a Markdown table. Nothing here sends a request the operator's tools would not: the server is
the ``vllm serve`` command with our cache flags, the load is vLLM-Omni's own benchmark client on
``/v1/images/generations``, and the cache's counts come from ``GET /metrics``. Two prompt sets:

* ``repeated``: each prompt K times in a row, as an RL rollout sends a prompt's siblings;
* ``all new``: every prompt distinct, several times more than the cache's entry and byte budgets hold.

Each set runs at each concurrency on one server per replica count (engine starts are slow), its
prompts tagged with the run so no run hits another's entries. A run's counts are the differences
of two scrapes; levels (entries, bytes) are read after it. RSS is summed over the server's process
tree (head and replica processes) before and after each run.

    flock /tmp/engine.lock .venv/bin/python benchmarks/load.py            # 1 and 2 replicas, c = 1, 8, 32
    flock /tmp/engine.lock .venv/bin/python benchmarks/load.py --quick    # 1 replica, c = 8, small sets
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from vllm_omni_prompt_cache.demo.machine import cpu_summary
from vllm_omni_prompt_cache.demo.serving import (
    IMAGE_PARAMETERS,
    METRIC_PREFIX,
    VLLM,
    Server,
    distributed_flags,
    per_replica,
    scrape,
    served,
    server_rss,
    tail,
    total,
    warm_up,
)
from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image

ANIMALS = ("fox", "heron", "otter", "lynx", "crane", "badger", "seal", "wren")
PLACES = ("snow", "fog", "dusk", "rain", "sun", "moss", "dunes", "reeds")


class BenchError(RuntimeError):
    """``vllm bench serve`` exited non-zero or wrote no result; the message ends with its output's tail."""


@dataclasses.dataclass(frozen=True)
class Budget:
    """The cache's budgets, as the serve flags set them."""

    max_entries: int
    max_bytes: int

    def flags(self) -> tuple[str, ...]:
        """Return the ``vllm serve`` flags that turn the cache on with these budgets."""
        return (
            "--enable-prompt-embed-cache",
            "--prompt-embed-cache-size", str(self.max_entries),
            "--prompt-embed-cache-max-bytes", str(self.max_bytes),
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A prompt set in the order the client sends it."""

    name: str
    prompts: tuple[str, ...]

    @property
    def distinct(self) -> int:
        return len(set(self.prompts))


def scene(index: int) -> str:
    """Return the ``index``-th of 64 short scenes (prompts of similar length, so entries of similar size)."""
    return f"a {ANIMALS[index % len(ANIMALS)]} in the {PLACES[index // len(ANIMALS) % len(PLACES)]}"


def repeated(tag: str, prompts: int, siblings: int) -> Pattern:
    """Return ``prompts`` distinct prompts, each sent ``siblings`` times in a row (an RL group)."""
    return Pattern("repeated", tuple(f"{tag} {scene(i)}" for i in range(prompts) for _ in range(siblings)))


def all_new(tag: str, prompts: int) -> Pattern:
    """Return ``prompts`` distinct prompts, each sent once."""
    return Pattern("all new", tuple(f"{tag} {scene(i)} #{i}" for i in range(prompts)))


# --- the client ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """What ``vllm bench serve``'s ``--save-result`` JSON says about a run."""

    completed: int
    failed: int
    request_throughput: float
    duration_s: float
    errors: tuple[str, ...]  # of the failed requests


def bench_command(server: Server, dataset: Path, requests: int, concurrency: int, result: Path) -> list[str]:
    """Return the ``vllm bench serve --omni`` command that sends ``dataset``'s prompts in file order."""
    return [
        VLLM, "bench", "serve", "--omni",
        "--base-url", server.base, "--model", server.model,
        "--backend", "/v1/images/generations", "--endpoint", "/v1/images/generations",
        # ShareGPT's format, read with the json module: the "custom" JSONL loader needs pandas
        # (vllm[bench]), which vLLM-Omni does not install. Its loader counts prompt tokens, so it
        # gets the checkpoint's tokenizer; sent as written: no shuffle, no resampling.
        "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--num-prompts", str(requests),
        "--tokenizer", str(Path(server.model) / "tokenizer"), "--sharegpt-output-len", "1",
        "--disable-shuffle", "--no-oversample",
        "--max-concurrency", str(concurrency), "--request-rate", "inf",
        "--extra-body", json.dumps(IMAGE_PARAMETERS),
        "--percentile-metrics", "e2el", "--disable-tqdm",
        "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name,
    ]  # fmt: skip


def sharegpt(prompts: Sequence[str]) -> str:
    """Return ``prompts`` as a ShareGPT file: one two-turn conversation each (the second turn is never sent)."""
    return json.dumps(
        [
            {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": "an image"}]}
            for prompt in prompts
        ]
    )


def bench_serve(server: Server, pattern: Pattern, concurrency: int, work_dir: Path, label: str) -> BenchResult:
    """Send ``pattern`` through ``vllm bench serve --omni`` at ``concurrency``; return its saved result."""
    dataset = work_dir / f"{label}.prompts.json"
    dataset.write_text(sharegpt(pattern.prompts))
    result = work_dir / f"{label}.json"
    log = work_dir / f"{label}.bench.log"
    with open(log, "w") as output:
        finished = subprocess.run(
            bench_command(server, dataset, len(pattern.prompts), concurrency, result),
            stdout=output,
            stderr=subprocess.STDOUT,
            timeout=1800,
        )
    if finished.returncode != 0 or not result.exists():
        raise BenchError(f"vllm bench serve exited with {finished.returncode}:\n{tail(log)}")
    saved = json.loads(result.read_text())
    return BenchResult(
        completed=saved["completed"],
        failed=saved["failed"],
        request_throughput=saved["request_throughput"],
        duration_s=saved["duration"],
        errors=tuple(error for error in saved.get("errors", ()) if error),
    )


# --- one run ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    """One pattern at one concurrency on one server: the client's result and the cache's counts over it."""

    replicas: int
    pattern: str
    requests: int
    distinct: int
    concurrency: int
    bench: BenchResult
    counts: dict[str, float]  # COUNTED: differences over the run, summed over replicas
    entries_start: dict[str, float]  # per replica, before the run
    entries: dict[str, float]  # per replica, after it
    bytes: dict[str, float]
    max_entries: dict[str, float]
    max_bytes: dict[str, float]
    rss_start: int
    rss_end: int
    wall_s: float


#: The counter families a run reports (short names; ``_total`` samples), differences over the run.
COUNTED = ("queries", "hits", "misses", "bypassed", "rows_encoded", "evictions")


def measure(server: Server, replicas: int, pattern: Pattern, concurrency: int, work_dir: Path) -> Run:
    """Run ``pattern`` at ``concurrency`` and return what the client and ``/metrics`` saw."""
    label = f"r{replicas}-{pattern.name.replace(' ', '-')}-c{concurrency}"
    before, rss_start, started = scrape(server.base), server_rss(server.pid), time.monotonic()
    bench = bench_serve(server, pattern, concurrency, work_dir, label)
    wall_s = time.monotonic() - started
    after, rss_end = scrape(server.base), server_rss(server.pid)
    counts = {
        name: total(after, f"{METRIC_PREFIX}{name}_total") - total(before, f"{METRIC_PREFIX}{name}_total")
        for name in COUNTED
    }
    return Run(
        replicas=replicas,
        pattern=pattern.name,
        requests=len(pattern.prompts),
        distinct=pattern.distinct,
        concurrency=concurrency,
        bench=bench,
        counts=counts,
        entries_start=per_replica(before, "entries"),
        entries=per_replica(after, "entries"),
        bytes=per_replica(after, "bytes"),
        max_entries=per_replica(after, "max_entries"),
        max_bytes=per_replica(after, "max_bytes"),
        rss_start=rss_start,
        rss_end=rss_end,
        wall_s=wall_s,
    )


# --- the table -------------------------------------------------------------------------------


def _levels(levels: dict[str, float], budgets: dict[str, float], unit: float = 1) -> str:
    """Each replica's level over its budget, e.g. ``5/8 ; 3/8``."""
    return " ; ".join(f"{levels[r] / unit:.4g}/{budgets.get(r, float('nan')) / unit:.4g}" for r in levels)


def table(runs: Sequence[Run]) -> str:
    """Return the runs as a Markdown table."""
    header = (
        "| replicas | pattern | requests (distinct) | concurrency | req/s | failed | hits | misses | bypassed "
        "| queries | evictions | entries / max | KiB / max KiB | RSS start → end (MiB) | wall s (with client start) |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for run in runs:
        counts = " | ".join(f"{run.counts[name]:g}" for name in ("hits", "misses", "bypassed", "queries", "evictions"))
        lines.append(
            f"| {run.replicas} | {run.pattern} | {run.requests} ({run.distinct}) | {run.concurrency} "
            f"| {run.bench.request_throughput:.2f} | {run.bench.failed} | {counts} "
            f"| {_levels(run.entries, run.max_entries)} | {_levels(run.bytes, run.max_bytes, 1024)} "
            f"| {run.rss_start / 2**20:.0f} → {run.rss_end / 2**20:.0f} | {run.wall_s:.1f} |"
        )
    return "\n".join(lines)


# --- the benchmark ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a benchmark runs: the sets' sizes, the budgets, the replica counts and concurrencies."""

    replicas: tuple[int, ...]
    concurrencies: tuple[int, ...]
    repeated_prompts: int
    siblings: int
    new_prompts: int
    budget: Budget


#: An entry of these prompts is about 11 KiB (embeddings and mask in fp32, and the key's bytes), so
#: 64 KiB holds 5: the byte budget binds before the entry budget, and 64 new prompts are 8 times the
#: entry budget and about 12 times what the byte budget holds.
FULL = Plan(replicas=(1, 2), concurrencies=(1, 8, 32), repeated_prompts=8, siblings=8, new_prompts=64,
            budget=Budget(max_entries=8, max_bytes=64 * 1024))  # fmt: skip
QUICK = dataclasses.replace(FULL, replicas=(1,), concurrencies=(8,), repeated_prompts=3, siblings=4, new_prompts=32)


def run_plan(plan: Plan, work_dir: Path) -> tuple[list[Run], dict[int, float]]:
    """Run every pattern at every concurrency, one server per replica count; return the runs and start-up times."""
    model_dir = ensure_tiny_qwen_image()
    runs: list[Run] = []
    startups: dict[int, float] = {}
    for replicas in plan.replicas:
        flags = plan.budget.flags() + (distributed_flags(replicas) if replicas > 1 else ())
        with served(work_dir / f"server-r{replicas}.log", model_dir, *flags) as server:
            startups[replicas] = server.startup_s
            warm_up(server, replicas)
            for concurrency in plan.concurrencies:
                tag = f"r{replicas}c{concurrency}"
                for pattern in (repeated(tag, plan.repeated_prompts, plan.siblings), all_new(tag, plan.new_prompts)):
                    runs.append(measure(server, replicas, pattern, concurrency, work_dir))
                    print(table(runs[-1:]).splitlines()[-1], file=sys.stderr, flush=True)  # progress
    return runs, startups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one replica, concurrency 8, small sets")
    parser.add_argument("--work-dir", type=Path, help="where server logs, prompt files and results go (kept)")
    args = parser.parse_args()
    from vllm_omni_prompt_cache.cpu_platform.entry_points import opt_in_where_no_gpu

    opt_in_where_no_gpu()  # the servers inherit the choice
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    plan = QUICK if args.quick else FULL
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="load-bench-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    runs, startups = run_plan(plan, work_dir)
    budget = plan.budget
    print(f"\nCPU: {cpu_summary()}; {len(os.sched_getaffinity(0))} CPUs available")
    print(
        f"Tiny Qwen-Image, {IMAGE_PARAMETERS['size']}, {IMAGE_PARAMETERS['num_inference_steps']} steps; cache budget "
        f"{budget.max_entries} entries, {budget.max_bytes / 1024:g} KiB per replica; repeated: "
        f"{plan.repeated_prompts} prompts x {plan.siblings} siblings in a row; all new: {plan.new_prompts} prompts.\n"
        "One server per replica count, reused across patterns and concurrencies in the order shown "
        f"(healthy after {', '.join(f'{r} replica(s): {s:.0f} s' for r, s in startups.items())}); "
        "counts are differences over each run, levels are after it, per replica. req/s and failed are the "
        "client's (--save-result), timed from its first request to its last answer; wall s includes the "
        "client's start (~20 s of imports here).\n"
    )
    print(table(runs))
    print(f"\nTotal {time.monotonic() - started:.0f} s; logs and results in {work_dir}")


if __name__ == "__main__":
    main()
