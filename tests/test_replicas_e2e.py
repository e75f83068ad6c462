"""Two replicas of the tiny model behind ``omni_lb_policy="prompt-affinity"``, through the real AsyncOmni.

vLLM-Omni's distributed runtime in this process: an omni coordinator, a master server and two
replica processes on the CPU platform, each with its own cache (see ``demo/replicas.py``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
from engine_support import run, tiny_spec

from vllm_omni_prompt_cache.demo.rollout import run_mode

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def affinity_run():
    spec = dataclasses.replace(tiny_spec(), replicas=2, lb_policy="prompt-affinity")
    return spec, run(run_mode(spec, "ours", cache_size=16))


def test_every_request_is_routed_by_its_prompt_within_the_bound(affinity_run) -> None:
    spec, result = affinity_run
    assert result.routing is not None, "the diffusion stage was not routed by prompt affinity"
    assert result.routing["fallback_reasons"] == {}
    assert sum(result.routing["placements"].values()) == len(spec.requests())
    assert 0 < result.routing["peak_load_over_bound"] <= 1.0
    assert sum(result.requests_per_replica) == len(spec.requests())
    assert len(result.requests_per_replica) == 2


def test_each_replica_encodes_each_prompt_it_serves_once(affinity_run) -> None:
    spec, result = affinity_run
    prompts_by_replica: dict[int, set[int]] = defaultdict(set)
    requests = {index: prompt for index, prompt, _ in spec.requests()}
    # Which replica served each request, as the engine's outputs say.
    from_outputs = result.replica_by_request
    for index, replica in from_outputs.items():
        prompts_by_replica[replica].add(requests[index])
    expected = [len(prompts_by_replica[replica]) + (1 if prompts_by_replica[replica] else 0) for replica in range(2)]
    assert list(result.encoder_runs_per_replica) == expected  # its prompts, plus the shared negative once
    assert result.stats.hits == 2 * len(spec.requests()) - sum(expected)  # two encode calls a request (CFG)
