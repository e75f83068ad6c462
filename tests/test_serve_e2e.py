"""`vllm serve MODEL --omni` with the cache flags, as an operator sees it: HTTP in, ``/metrics`` out.

Real servers on loopback, on the CPU platform, serving the stock Qwen-Image pipeline through
vLLM-Omni's image API. The cache's counts are read where an operator reads them: the Prometheus
text on ``GET /metrics`` (no dev-mode route). One server with one replica; one with two replicas
behind ``--omni-lb-policy prompt-affinity`` (vLLM-Omni's distributed runtime, started by the same
command); and a bad flag, refused before anything starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from engine_support import tiny_spec
from prometheus_client.parser import text_string_to_metric_families

from vllm_omni_prompt_cache.demo.replicas import free_port
from vllm_omni_prompt_cache.tiny.qwen_image import checkpoint_dtype

pytestmark = pytest.mark.engine
STARTUP_TIMEOUT_S = 300
VLLM = os.path.join(os.path.dirname(sys.executable), "vllm")
CACHE = "vllm_omni:prompt_embed_cache_"


def post(url: str, payload: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def generate(base: str, prompt: str, seed: int) -> None:
    image = post(
        f"{base}/v1/images/generations", {"prompt": prompt, "size": "64x64", "num_inference_steps": 2, "seed": seed}
    )
    assert image["data"][0]["b64_json"]


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    """Return ``/metrics`` as ``{(sample name, sorted labels): value}``."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(scraped: dict, name: str, **labels: str) -> float:
    """Sum a sample over every series whose labels include ``labels``."""
    return sum(
        value
        for (sample, series), value in scraped.items()
        if sample == name and labels.items() <= dict(series).items()
    )


def series(scraped: dict, name: str) -> list[dict[str, str]]:
    return [dict(labels) for sample, labels in scraped if sample == name]


@contextlib.contextmanager
def served(log_path, *flags: str) -> Iterator[str]:
    """Run ``vllm serve TINY --omni FLAGS`` until the block ends; yield its base URL once healthy."""
    model_dir = tiny_spec().model_dir
    port = free_port()
    command = [
        VLLM, "serve", str(model_dir), "--omni", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", checkpoint_dtype(model_dir),  # vLLM-Omni builds the denoiser in bf16 unless told
        *flags,
    ]  # fmt: skip
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm serve did not start in {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
                time.sleep(1)
        yield base
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


CACHE_FLAGS = (
    "--enable-prompt-embed-cache", "--prompt-embed-cache-size", "8", "--prompt-embed-cache-max-bytes", "64MiB",
)  # fmt: skip


def test_metrics_show_the_hits_and_budgets_of_repeated_prompts(tmp_path) -> None:
    with served(tmp_path / "server.log", *CACHE_FLAGS) as base:
        # The first output brings counts from before serving too: vLLM-Omni's start-up warm-up
        # encodes a dummy prompt. Measure from the group's first request on.
        generate(base, "a red fox in the snow", seed=7)
        before = scrape(base)
        for seed in (8, 9):  # the group's siblings
            generate(base, "a red fox in the snow", seed)
        siblings = scrape(base)
        generate(base, "a lighthouse at dusk", seed=7)  # the next group
        after = scrape(base)
    print(
        "\n".join(
            f"{name}{{{','.join(f'{k}={v!r}' for k, v in labels)}}} {value:g}"
            for (name, labels), value in sorted(after.items())
            if name.startswith(CACHE) and not name.endswith("_created")
        )
    )  # the scrape, for the record (pytest -s)

    def grew(name: str, since: dict, until: dict) -> float:
        return total(until, CACHE + name) - total(since, CACHE + name)

    assert [grew(name, before, siblings) for name in ("hits_total", "misses_total", "queries_total")] == [2, 0, 2]
    assert [grew(name, siblings, after) for name in ("hits_total", "misses_total", "rows_encoded_total")] == [0, 1, 1]
    assert grew("entries", before, after) == 1 and total(after, CACHE + "bytes") > total(before, CACHE + "bytes")
    assert total(after, CACHE + "bypassed_total") == 0 and total(after, CACHE + "verification_failures_total") == 0
    assert (total(after, CACHE + "max_entries"), total(after, CACHE + "max_bytes")) == (8, 64 * 2**20)
    model_dir = str(tiny_spec().model_dir)
    assert series(after, CACHE + "hits_total") == [{"model_name": model_dir, "stage": "0", "replica": "0"}]
    # Labelled as vLLM-Omni's own diffusion families are.
    assert {"model_name": model_dir, "stage": "0", "replica": "0"} in series(after, "vllm_omni:diffusion_exec_s_count")


#: Twelve prompts: the ring hashes replica addresses that change every start, so fewer could all
#: land on one replica (with 12, and even odds for each prompt, 2 / 2**12: once in 2,048 starts).
ANIMALS, PLACES = ("fox", "heron", "otter"), ("snow", "fog", "dusk", "sun")
PROMPTS = tuple(f"a {animal} in the {place}" for animal in ANIMALS for place in PLACES)


def wait_until_replicas_report(base: str, replicas: int, attempts: int = 40) -> None:
    """Send distinct warm-up prompts until ``/metrics`` has series of every replica.

    ``/health`` answers once the head is up; a replica takes requests only once the coordinator
    sees it up, which can be a few requests later.
    """
    for attempt in range(attempts):
        generate(base, f"warm-up prompt {attempt}", seed=0)
        if len({labels["replica"] for labels in series(scrape(base), CACHE + "entries")}) == replicas:
            return
    pytest.fail(f"only some of {replicas} replicas served {attempts} requests")


def test_two_replicas_behind_prompt_affinity_encode_each_prompt_once(tmp_path) -> None:
    distributed = (
        "--omni-lb-policy", "prompt-affinity", "--stage-id", "0", "--omni-master-address", "127.0.0.1",
        "--omni-master-port", str(free_port()), "--omni-dp-size-local", "2",
    )  # fmt: skip
    # Room for every prompt on either replica: consistent hashing may send most of them to one.
    cache_flags = ("--enable-prompt-embed-cache", "--prompt-embed-cache-size", "128")
    with served(tmp_path / "server.log", *cache_flags, *distributed) as base:
        wait_until_replicas_report(base, 2)
        before = scrape(base)
        for seed in range(2):  # sibling-major, as an RL rollout sends a batch
            for prompt in PROMPTS:
                generate(base, prompt, seed)
        after = scrape(base)

    def grew(name: str, replica: str) -> float:
        return total(after, CACHE + name, replica=replica) - total(before, CACHE + name, replica=replica)

    counted = ("misses_total", "hits_total", "entries")
    per_replica = {replica: [grew(name, replica) for name in counted] for replica in ("0", "1")}
    print(per_replica)  # for the record (pytest -s)
    # Both replicas served; each encoded each of its prompts once and hit on every sibling: so every
    # prompt was encoded once in all, on one replica.
    for misses, hits, entries in per_replica.values():
        assert hits >= 1 and misses == hits and entries == misses
    assert sum(hits for _, hits, _ in per_replica.values()) == len(PROMPTS)


def test_a_bad_flag_is_refused_with_its_name_and_the_allowed_values() -> None:
    result = subprocess.run(
        [VLLM, "serve", str(tiny_spec().model_dir), "--omni", "--prompt-embed-cache-size", "0"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2, result.stderr[-3000:]  # argparse's usage error: nothing started
    assert "argument --prompt-embed-cache-size" in result.stderr
    assert "command-line flag --prompt-embed-cache-size" in result.stderr and "an integer >= 1" in result.stderr
