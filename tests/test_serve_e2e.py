"""`vllm serve MODEL --omni` with the cache flags, as an operator sees it: HTTP in, ``/metrics`` out.

Real servers on loopback, on the CPU platform, serving the stock Qwen-Image pipeline through
vLLM-Omni's image API. The cache's counts are read where an operator reads them: the Prometheus
text on ``GET /metrics`` (no dev-mode route). One server with one replica; one with two replicas
behind ``--omni-lb-policy prompt-affinity`` (vLLM-Omni's distributed runtime, started by the same
command). A bad flag, refused before anything starts, is in ``test_settings.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from engine_support import tiny_spec

from vllm_omni_prompt_cache.demo import serving
from vllm_omni_prompt_cache.demo.serving import IMAGE_PARAMETERS, METRIC_PREFIX, post, scrape, series, total
from vllm_omni_prompt_cache.vllm_omni import hook_points

pytestmark = pytest.mark.engine
CACHE = METRIC_PREFIX


def generate(base: str, prompt: str, seed: int) -> None:
    image = post(f"{base}/v1/images/generations", {"prompt": prompt, **IMAGE_PARAMETERS, "seed": seed})
    assert image["data"][0]["b64_json"]


@contextlib.contextmanager
def served(log_path, *flags: str, kill: bool = False) -> Iterator[serving.Server]:
    """Run ``vllm serve TINY --omni FLAGS`` until the block ends; yield it once healthy.

    ``kill``: end it with SIGKILL (its whole session) instead of SIGTERM. vLLM-Omni 0.30's distributed
    shutdown waits 30 s for its membership watcher (see ``demo/replicas.py``), and a test that reads
    nothing from the server after the block has no use for that wait.
    """
    with serving.served(log_path, tiny_spec().model_dir, *flags) as server:
        try:
            yield server
        finally:
            if kill:
                server.kill()


CACHE_FLAGS = (
    "--enable-prompt-embed-cache", "--prompt-embed-cache-size", "8", "--prompt-embed-cache-max-bytes", "64MiB",
)  # fmt: skip


#: Whether the installed vLLM-Omni has what the /metrics families need (0.30 and later; see docs/support.md).
METRICS_ON = not hook_points.missing_by_feature()[hook_points.METRICS]


@pytest.mark.release
def test_metrics_show_the_hits_and_budgets_of_repeated_prompts(tmp_path) -> None:
    with served(tmp_path / "server.log", *CACHE_FLAGS) as server:
        base = server.base
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

    if not METRICS_ON:
        # The served cache is on; its families are absent, not half there, and the log says why.
        assert not [name for name, _ in after if name.startswith(CACHE)]
        log = server.log.read_text()
        assert "Prompt-embed cache (content-keyed) installed" in log
        assert f"{hook_points.METRICS} stay off, for want of" in log
        return

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


def test_two_replicas_behind_prompt_affinity_encode_each_prompt_once(tmp_path) -> None:
    distributed = serving.distributed_flags(2)
    # Room for every prompt on either replica: consistent hashing may send most of them to one.
    cache_flags = ("--enable-prompt-embed-cache", "--prompt-embed-cache-size", "128")
    with served(tmp_path / "server.log", *cache_flags, *distributed, kill=True) as server:
        base = server.base
        serving.warm_up(server, 2)
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
