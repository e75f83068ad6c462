"""Two replicas of the tiny model behind ``omni_lb_policy="prompt-affinity"``, through the real AsyncOmni.

Both of vLLM-Omni 0.30's replica runtimes, each with two replica processes on the CPU platform,
each replica with its own cache: the distributed one in this process (an omni coordinator and a
master server, see ``demo/replicas.py``), and the single-node one from a deploy config with
``num_replicas: 2``, which 0.30 applies only to a registered pipeline.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
from engine_support import run, tiny_spec

from vllm_omni_prompt_cache.demo.rollout import run_mode, send_rollout
from vllm_omni_prompt_cache.tiny.qwen_image import checkpoint_dtype, register_one_stage_pipeline
from vllm_omni_prompt_cache.tiny.worker_extension import WORKER_EXTENSION
from vllm_omni_prompt_cache.vllm_omni.balancer import routing_stats
from vllm_omni_prompt_cache.vllm_omni.engine_client import open_engine, worker_values

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


#: A registry key that no model directory name contains (vLLM-Omni also matches keys against paths).
SINGLE_STAGE_KEY = "single_stage_diffusion_replicas"
DEPLOY_CONFIG = """\
pipeline: {key}
stages:
  - stage_id: 0
    num_replicas: 2
    max_num_seqs: 1
    dtype: {dtype}
    custom_pipeline_args: {{pipeline_class: vllm_omni_prompt_cache.tiny.token_id_pipeline.TokenIdQwenImagePipeline}}
    worker_extension_cls: {extension}
    enable_prompt_embed_cache: true
    prompt_embed_cache_size: 16
"""


def register_single_stage_pipeline() -> None:
    """Register a one-stage Qwen-Image pipeline, so vLLM-Omni applies a deploy config to the tiny model."""
    register_one_stage_pipeline(SINGLE_STAGE_KEY)


def test_single_node_replicas_from_a_deploy_config_are_routed_by_prompt(tmp_path) -> None:
    spec = tiny_spec()
    register_single_stage_pipeline()
    deploy = tmp_path / "deploy.yaml"
    dtype = checkpoint_dtype(spec.model_dir) or "bfloat16"
    deploy.write_text(DEPLOY_CONFIG.format(key=SINGLE_STAGE_KEY, dtype=dtype, extension=WORKER_EXTENSION))
    kwargs = {"model": str(spec.model_dir), "deploy_config": str(deploy), "omni_lb_policy": "prompt-affinity"}

    async def rollout():
        async with open_engine({**kwargs, "log_stats": False}) as engine:
            pool = engine.engine.stage_pools[0]
            assert not pool.is_distributed and pool.live_num_replicas == 2
            before = await worker_values(engine, "text_encoder_counters")
            sent = await send_rollout(engine, spec)
            after = await worker_values(engine, "text_encoder_counters")
            return (
                sent,
                [a["encoder_runs"] - b["encoder_runs"] for a, b in zip(after, before, strict=True)],
                (routing_stats(engine.engine.stage_pools)[0]),
            )

    sent, encoder_runs, routing = run(rollout())
    # Every request was placed by our balancer (stock's single-node runtime would round-robin them).
    assert sum(routing["placements"].values()) == len(spec.requests())
    assert routing["fallback_reasons"] == {} and 0 < routing["peak_load_over_bound"] <= 1.0
    requests = {index: prompt for index, prompt, _ in spec.requests()}
    prompts_by_replica: dict[int, set[int]] = defaultdict(set)
    for index, replica in sent.replica_by_request.items():
        prompts_by_replica[replica].add(requests[index])
    assert encoder_runs == [len(prompts_by_replica[r]) + bool(prompts_by_replica[r]) for r in range(2)]
