"""The prompt-affinity policy inside vLLM-Omni's own routing: StagePool, the coordinator, the serve CLI.

The pools, the coordinator, its hub and stage clients, the serve parser and the balancer factory are
vLLM-Omni's real ones with the plugin's hooks applied. What stands in for a replica is only its
engine client (``_ReplicaClient`` records what it is sent): running engines here is the job of
``test_replicas_e2e.py``.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm_omni", reason="the balancer hooks need the vllm-omni extra")

from vllm_omni.distributed.omni_coordinator import OmniCoordClientForHub, OmniCoordinator
from vllm_omni.distributed.omni_coordinator.omni_coord_client_for_stage import OmniCoordClientForStage
from vllm_omni.engine import stage_runtime
from vllm_omni.engine.stage_pool import StagePool
from vllm_omni.entrypoints.cli.serve import OmniServeCommand
from vllm_omni.utils.tracking_parser import TrackingArgumentParser

from vllm_omni_prompt_cache.calls.routing import EPSILON_ENV
from vllm_omni_prompt_cache.settings.schema import PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image
from vllm_omni_prompt_cache.vllm_omni.balancer import PromptAffinityBalancer, _local_replica, routing_stats
from vllm_omni_prompt_cache.vllm_omni.cli_args import POLICY

PROMPTS = ([101, 7, 7, 9], [101, 8, 3], [101, 5, 5, 5, 5], [101, 2])
NEGATIVE = [101, 0]
SIBLINGS = 4


class _ReplicaClient:
    """Stands in for one replica's diffusion engine client: records the requests it is sent."""

    stage_type = "diffusion"
    final_output = True

    def __init__(self, address: str) -> None:
        self.request_address = address
        self.requests: list[str] = []

    async def add_request_async(self, request_id: str, request: object, params: object, **_: object) -> None:
        self.requests.append(request_id)


def _state() -> SimpleNamespace:
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    return SimpleNamespace(sampling_params_list=[OmniDiffusionSamplingParams()])


async def _rollout(pool: StagePool, prompts=PROMPTS) -> dict[int, set[int]]:
    """Submit every prompt's siblings interleaved; return the replicas each prompt reached."""
    reached: dict[int, set[int]] = {}
    for sibling in range(SIBLINGS):
        for index, ids in enumerate(prompts):
            request = {"prompt_ids": list(ids), "negative_prompt_ids": NEGATIVE}
            replica = await pool.submit_initial(f"p{index}-s{sibling}", _state(), request)
            reached.setdefault(index, set()).add(replica)
    return reached


def _single_node_pool(replicas: int, balancer=None) -> StagePool:
    pool = StagePool(0, [_ReplicaClient(f"inproc://replica-{index}") for index in range(replicas)])
    if balancer is not None:
        pool.attach_load_balancer(balancer)  # what the engine hook does when the policy is ours
    return pool


def test_single_node_siblings_share_a_replica_within_the_bound() -> None:
    pool = _single_node_pool(2, PromptAffinityBalancer(epsilon=0.25))
    reached = asyncio.run(_rollout(pool))
    assert all(len(replicas) == 1 for replicas in reached.values())
    per_replica = [len(client.requests) for client in pool.clients]
    assert sum(per_replica) == len(PROMPTS) * SIBLINGS and max(per_replica) <= 10  # ceil(1.25 * 16 / 2)
    assert routing_stats([pool])[0]["placements"]["with siblings"] == len(PROMPTS) * (SIBLINGS - 1)
    # Finished requests release their bindings; the loads the balancer sees drop back to zero.
    pool.release_bindings([f"p{i}-s{s}" for i in range(len(PROMPTS)) for s in range(SIBLINGS)])
    assert pool._request_bindings == {}


def test_single_node_without_our_policy_keeps_stock_round_robin() -> None:
    pool = _single_node_pool(2)
    reached = asyncio.run(_rollout(pool, prompts=PROMPTS[:1]))
    assert reached == {0: {0, 1}}


def test_a_cfg_companion_follows_its_parent_and_unroutable_requests_go_least_loaded() -> None:
    pool = _single_node_pool(2, PromptAffinityBalancer())

    async def scenario() -> tuple[int, int, int]:
        parent = await pool.submit_initial("parent", _state(), {"prompt_ids": [1, 2, 3]})
        companion = await pool.submit_initial("parent-cfg", _state(), {"prompt_ids": [9]}, affinity_request_id="parent")
        embeds_only = await pool.submit_initial("embeds", _state(), {"prompt_embeds": None})
        return parent, companion, embeds_only

    parent, companion, embeds_only = asyncio.run(scenario())
    assert companion == parent
    assert embeds_only != parent  # the other replica holds nothing
    assert routing_stats([pool])[0]["fallback_reasons"] == {
        "no prompt content (none of prompt_ids, prompt_token_ids, prompt, multi_modal_data)": 1
    }


@pytest.fixture
def coordinator():
    """vLLM-Omni's real omni coordinator on loopback, with two registered replicas of stage 0."""
    coord = OmniCoordinator("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_timeout=30.0)
    addresses = ["tcp://127.0.0.1:40001", "tcp://127.0.0.1:40002"]
    stages = [OmniCoordClientForStage(coord.router_zmq_addr, address, address + "/out", 0) for address in addresses]
    hub = OmniCoordClientForHub(coord.pub_zmq_addr)
    deadline = time.monotonic() + 10
    while len(hub.get_replicas_for_stage(0).replicas) < 2:
        assert time.monotonic() < deadline, "the hub never saw both replicas"
        time.sleep(0.05)
    yield hub, addresses
    hub.close()
    for stage in stages:
        stage.close()
    coord.close()


def test_distributed_pool_routes_through_the_coordinators_replica_list(coordinator) -> None:
    hub, addresses = coordinator
    pool = StagePool(0, [])
    for address in addresses:
        pool.add_client(address, _ReplicaClient(address))
    pool.attach_hub(hub)
    pool.attach_load_balancer(stage_runtime._build_load_balancer_factory(POLICY)())  # as MembershipController does
    assert pool.is_distributed and isinstance(pool._lb, PromptAffinityBalancer)
    reached = asyncio.run(_rollout(pool))
    assert all(len(replicas) == 1 for replicas in reached.values())
    assert max(len(client.requests) for client in pool.clients) <= 10
    assert routing_stats([pool])[0]["fallback_reasons"] == {}


def test_the_factory_knows_our_policy_and_still_refuses_unknown_ones(monkeypatch) -> None:
    assert stage_runtime._build_load_balancer_factory(POLICY) is PromptAffinityBalancer
    with pytest.raises(ValueError, match="unknown --omni-lb-policy 'fastest'"):
        stage_runtime._build_load_balancer_factory("fastest")
    monkeypatch.setenv(EPSILON_ENV, "-1")
    with pytest.raises(PromptEmbedCacheConfigError, match=f"environment variable {EPSILON_ENV}"):
        stage_runtime._build_load_balancer_factory(POLICY)()


def _serve_parser() -> TrackingArgumentParser:
    parser = TrackingArgumentParser(prog="vllm-omni")
    OmniServeCommand().subparser_init(parser.add_subparsers(dest="subparser"))
    return parser


def test_serve_accepts_the_policy_and_names_it_in_errors(capsys, monkeypatch) -> None:
    model = str(ensure_tiny_qwen_image())  # a local model: validation resolves it (no downloads)
    args = _serve_parser().parse_args(["serve", model, "--omni", "--omni-lb-policy", POLICY])
    assert args.omni_lb_policy == POLICY
    OmniServeCommand().validate(args)  # stock's check knows three policies; ours passes
    assert args.omni_lb_policy == POLICY
    assert args.get_explicit_kwargs_dict()["omni_lb_policy"] == POLICY  # what reaches AsyncOmni

    monkeypatch.setenv(EPSILON_ENV, "abc")
    with pytest.raises(PromptEmbedCacheConfigError, match="invalid prompt-affinity load slack 'abc'"):
        OmniServeCommand().validate(args)

    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["serve", model, "--omni", "--omni-lb-policy", "fastest"])
    assert f"'{POLICY}'" in capsys.readouterr().err


def test_a_request_sent_before_any_replica_registers_waits_and_is_still_routed_by_content() -> None:
    coord = OmniCoordinator("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_timeout=30.0)
    hub = OmniCoordClientForHub(coord.pub_zmq_addr)
    address = "tcp://127.0.0.1:40003"
    pool = StagePool(0, [])
    pool.add_client(address, _ReplicaClient(address))
    pool.attach_hub(hub)
    pool.attach_load_balancer(PromptAffinityBalancer())
    stages = []

    async def scenario() -> int:
        submitted = asyncio.ensure_future(pool.submit_initial("early", _state(), {"prompt_ids": [1, 2]}))
        await asyncio.sleep(0.3)  # the request waits: the coordinator knows no replica yet
        assert not submitted.done()
        stages.append(OmniCoordClientForStage(coord.router_zmq_addr, address, address + "/out", 0))
        return await submitted

    try:
        assert asyncio.run(scenario()) == 0
        assert routing_stats([pool])[0]["fallback_reasons"] == {}
    finally:
        hub.close()
        for stage in stages:
            stage.close()
        coord.close()


def test_a_request_that_raises_while_keyed_is_still_served() -> None:
    class Hostile(dict):
        def get(self, name, default=None):  # what a user's prompt object may do
            raise RuntimeError("no")

    pool = _single_node_pool(2, PromptAffinityBalancer())
    asyncio.run(pool.submit_initial("hostile", _state(), Hostile(prompt="x")))
    bf16 = {"prompt_ids": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}
    asyncio.run(pool.submit_initial("bf16", _state(), bf16))
    reasons = routing_stats([pool])[0]["fallback_reasons"]
    assert reasons == {
        "RuntimeError raised while keying the request": 1,
        "prompt_tokens are not integers (dtype torch.bfloat16)": 1,
    }


def test_with_no_replica_registered_the_request_fails_after_one_wait(coordinator) -> None:
    from vllm_omni.engine.stage_pool import StageUnavailableError

    hub, _ = coordinator
    pool = StagePool(1, [])  # stage 1: the coordinator knows no replica of it
    pool.add_client("tcp://127.0.0.1:40009", _ReplicaClient("tcp://127.0.0.1:40009"))
    pool.attach_hub(hub)
    pool.attach_load_balancer(PromptAffinityBalancer())
    pool.DISPATCH_WAIT_TIMEOUT_S = 0.5
    started = time.monotonic()
    with pytest.raises(StageUnavailableError, match=r"no UP replica for stage 1 after 0\.5s"):
        asyncio.run(pool.submit_initial("lost", _state(), {"prompt_ids": [1]}))
    assert time.monotonic() - started < 0.9  # one wait, not ours and then stock's


def test_validate_leaves_stock_policies_to_stock_and_restores_ours_when_stock_refuses() -> None:
    model = str(ensure_tiny_qwen_image())
    stock = _serve_parser().parse_args(["serve", model, "--omni", "--omni-lb-policy", "round-robin"])
    OmniServeCommand().validate(stock)
    assert stock.omni_lb_policy == "round-robin"
    ours = _serve_parser().parse_args(["serve", model, "--omni", "--omni-lb-policy", POLICY, "--stage-id", "0"])
    with pytest.raises(ValueError, match="--stage-id requires both"):
        OmniServeCommand().validate(ours)
    assert ours.omni_lb_policy == POLICY


def test_concurrent_selects_lose_no_placement_and_keep_siblings_together() -> None:
    """vLLM-Omni may pick a replica from its main thread and its orchestrator at once."""
    balancer = PromptAffinityBalancer(epsilon=0.25)
    replicas = [_local_replica(0, index, load=0) for index in range(4)]
    threads, calls = 8, 400
    chosen: dict[int, set[int]] = {index: set() for index in range(len(PROMPTS))}
    start = threading.Barrier(threads)

    def submit(offset: int) -> None:
        start.wait()
        for call in range(calls):
            index = (offset + call) % len(PROMPTS)
            task = {"request_id": f"t{offset}-{call}", "engine_inputs": {"prompt_ids": list(PROMPTS[index])}}
            chosen[index].add(balancer.select(task, replicas))  # set.add holds the GIL: no lost element

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        workers = [threading.Thread(target=submit, args=(offset,)) for offset in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
    finally:
        sys.setswitchinterval(interval)
    placements = balancer.stats()["placements"]
    # One first placement per prompt, then every sibling to where it went; none lost to a race.
    assert placements == {"home": len(PROMPTS), "with siblings": threads * calls - len(PROMPTS)}
    assert all(len(replica_ids) == 1 for replica_ids in chosen.values())  # siblings never split


def test_a_select_waits_while_another_thread_is_routing() -> None:
    """The router's state changes over several steps: one thread routes at a time."""
    balancer = PromptAffinityBalancer(epsilon=0.25)
    replicas = [_local_replica(0, index, load=0) for index in range(2)]
    route = balancer.router.route
    inside, most_inside = [0], [0]
    first_inside, release = threading.Event(), threading.Event()

    def observed_route(*args, **kwargs) -> int:
        inside[0] += 1
        most_inside[0] = max(most_inside[0], inside[0])
        if not first_inside.is_set():
            first_inside.set()
            release.wait(10)  # hold the first routing step open
        try:
            return route(*args, **kwargs)
        finally:
            inside[0] -= 1

    balancer.router.route = observed_route
    tasks = [{"request_id": f"r{index}", "engine_inputs": {"prompt_ids": list(PROMPTS[index])}} for index in (0, 1)]
    results: list[int] = []
    first = threading.Thread(target=lambda: results.append(balancer.select(tasks[0], replicas)))
    second = threading.Thread(target=lambda: results.append(balancer.select(tasks[1], replicas)))
    first.start()
    assert first_inside.wait(10)
    second.start()
    second.join(0.5)  # long enough for an unguarded select to enter the router
    assert second.is_alive() and most_inside[0] == 1
    release.set()
    first.join(10)
    second.join(10)
    assert len(results) == 2 and most_inside[0] == 1
