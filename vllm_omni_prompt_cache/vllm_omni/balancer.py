"""The ``prompt-affinity`` load-balancing policy for the replicas of a vLLM-Omni 0.30 stage.

``--omni-lb-policy prompt-affinity`` (serve) or ``omni_lb_policy="prompt-affinity"`` (AsyncOmni /
Omni) sends a prompt's siblings to one replica, so its cache encodes the prompt once. What stock
0.30 does, and what each hook below changes:

* The distributed runtime (omni coordinator) builds each pool's balancer from the policy name and
  refuses names it does not know: :func:`patch_stage_runtime` adds ours.
* The single-node runtime (``num_replicas`` in a deploy config) has no balancer at all: it
  round-robins whatever the policy says. :func:`patch_engine_base` attaches ours to each pool,
  which stock code never consults without a coordinator, so only our submit hook reads it.
* Stock calls a balancer with the request id alone. :func:`patch_stage_pool` routes a pool whose
  balancer is ours before stock's pick, with the request's content, and records the route as a
  binding, which stock's pick honours; in-flight loads are the pool's live bindings, exact and
  current (the coordinator's queue lengths arrive with heartbeats). Requests stock routes itself
  (CFG companions follow their parent; re-picks after a replica fails) are not counted against
  the bound when placed.
* The serve parser and its check know three policies: :mod:`.cli_args` adds ours.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
from collections import Counter
from types import ModuleType
from typing import Any

from vllm_omni.distributed.omni_coordinator.load_balancer import LoadBalancer, Task
from vllm_omni.distributed.omni_coordinator.messages import ReplicaInfo, ReplicaStatus

from vllm_omni_prompt_cache.calls.routing import (
    PromptAffinityRouter,
    UnroutableRequest,
    epsilon_from_env,
    prompt_affinity_key,
)
from vllm_omni_prompt_cache.vllm_omni.cli_args import POLICY
from vllm_omni_prompt_cache.vllm_omni.imports import replace_once

logger = logging.getLogger("vllm_omni_prompt_cache")


class PromptAffinityBalancer(LoadBalancer):
    """vLLM-Omni ``LoadBalancer`` that routes by :func:`prompt_affinity_key` with bounded loads.

    Replicas are named by ``input_addr`` on the ring and loaded by ``queue_length``; a task
    without ``engine_inputs``, or whose inputs hold no prompt, goes to the least-loaded replica.
    Keying never raises into vLLM-Omni's request path: whatever fails is a fallback with its reason.
    Thread-safe: vLLM-Omni may pick from its main thread (multimodal cache scoping) as well.
    """

    def __init__(self, epsilon: float | None = None) -> None:
        self.router = PromptAffinityRouter(epsilon=epsilon_from_env() if epsilon is None else epsilon)
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def select(self, task: Task, replicas: list[ReplicaInfo]) -> int:
        if not replicas:
            raise ValueError("replicas must not be empty")
        key, reason = _task_key(task)
        names = [replica.input_addr for replica in replicas]
        loads = [replica.queue_length for replica in replicas]
        with self._lock:
            if key is None and reason not in self._warned:
                self._warned.add(reason)
                logger.warning(
                    "vllm-omni-prompt-cache: prompt-affinity sent request %s to the least-loaded replica: %s "
                    "(said once per reason).",
                    task.get("request_id"),
                    reason,
                )
            return self.router.route(key, names, loads, reason=reason)

    def stats(self) -> dict[str, Any]:
        """Return placement counts, fallback reasons, the fullest replica over the bound, and epsilon."""
        return {
            "epsilon": self.router.epsilon,
            "placements": dict(self.router.placements),
            "fallback_reasons": dict(self.router.fallback_reasons),
            "peak_load_over_bound": self.router.peak_load_over_bound,
        }


def _task_key(task: Task) -> tuple[str | None, str]:
    """Return the task's prompt-affinity key, or None and the reason it has none."""
    if task.get("engine_inputs") is None:
        return None, "no request content given to the balancer"
    try:
        return prompt_affinity_key(task["engine_inputs"]), ""
    except UnroutableRequest as unroutable:
        return None, unroutable.reason
    except Exception as error:  # user objects may raise anything; the request must still be served
        return None, f"{type(error).__name__} raised while keying the request"


async def route_before_submit(
    pool: Any, balancer: PromptAffinityBalancer, request_id: str, request: Any, affinity_request_id: Any
) -> None:
    """Bind ``request_id`` to the replica ``balancer`` picks for ``request`` among ``pool``'s replicas."""
    # A CFG companion follows its parent, and a route chosen earlier (multimodal cache scoping) stands.
    if affinity_request_id is not None or pool.get_bound_replica_id(request_id) is not None:
        return
    task = Task(request_id=request_id, engine_inputs=request)
    if pool.is_distributed:
        # Replicas register with the coordinator after start-up; wait for one as stock's pick does.
        deadline = time.monotonic() + pool.DISPATCH_WAIT_TIMEOUT_S
        while not (candidates := pool._collect_serviceable_replicas()):
            if time.monotonic() >= deadline:
                from vllm_omni.engine.stage_pool import StageUnavailableError

                raise StageUnavailableError(  # as stock's pick would, without waiting a second time
                    f"no UP replica for stage {pool.stage_id} after {pool.DISPATCH_WAIT_TIMEOUT_S:.1f}s"
                )
            await asyncio.sleep(pool.DISPATCH_RETRY_INTERVAL_S)
        in_flight = Counter(pool._affinity.values())  # request id -> input address, released on finish
        infos = [dataclasses.replace(info, queue_length=in_flight[info.input_addr]) for info, _ in candidates]
        pool.bind(request_id, infos[balancer.select(task, infos)].input_addr)
        return
    live = [replica_id for replica_id in pool.live_replica_ids() if pool.is_replica_available(replica_id)]
    if len(live) < 2:
        return
    in_flight = Counter(pool._request_bindings.values())  # request id -> replica id, released on finish
    infos = [_local_replica(pool.stage_id, replica_id, in_flight[replica_id]) for replica_id in live]
    # Stock keeps single-node routes in this map and honours them in select_replica_id.
    pool._request_bindings[request_id] = live[balancer.select(task, infos)]


def _local_replica(stage_id: int, replica_id: int, load: int) -> ReplicaInfo:
    # Named by stage and index, which are the same on every start (client addresses are not).
    name = f"stage-{stage_id}/replica-{replica_id}"
    return ReplicaInfo(
        input_addr=name,
        output_addr="",
        stage_id=stage_id,
        status=ReplicaStatus.UP,
        queue_length=load,
        last_heartbeat=0.0,
        registered_at=0.0,
    )


def routing_stats(stage_pools: Any) -> dict[int, dict[str, Any]]:
    """Return each prompt-affinity pool's balancer statistics, by stage id."""
    return {
        pool.stage_id: pool._lb.stats()
        for pool in stage_pools
        if isinstance(getattr(pool, "_lb", None), PromptAffinityBalancer)
    }


# ---- hooks ----------------------------------------------------------------------------------


def patch_stage_runtime(module: ModuleType) -> None:
    """Let the distributed runtime build our balancer from the policy name."""
    replace_once(module, "_build_load_balancer_factory", _knowing_our_policy)


def _knowing_our_policy(original: Any) -> Any:
    @functools.wraps(original)
    def build_load_balancer_factory(policy: str) -> Any:
        if policy == POLICY:
            return PromptAffinityBalancer
        return original(policy)

    return build_load_balancer_factory


def patch_engine_base(module: ModuleType) -> None:
    """Give single-node pools our balancer when the engine's policy is ours."""
    replace_once(module.OmniEngineBase, "_initialize_stages", _attaching_our_balancer)


def _attaching_our_balancer(original: Any) -> Any:
    @functools.wraps(original)
    def initialize_stages(self: Any, *args: Any, **kwargs: Any) -> Any:
        ours = getattr(self, "_omni_lb_policy", None) == POLICY
        epsilon = epsilon_from_env() if ours else None  # a bad value stops the engine before any stage loads
        result = original(self, *args, **kwargs)
        if ours:
            for pool in self.stage_pools:
                if getattr(pool, "_lb", None) is None:
                    pool.attach_load_balancer(PromptAffinityBalancer(epsilon))
            replicas = {pool.stage_id: pool.live_num_replicas for pool in self.stage_pools}
            logger.info(
                "vllm-omni-prompt-cache: prompt-affinity routing (epsilon %s), replicas by stage %s", epsilon, replicas
            )
        return result

    return initialize_stages


def patch_stage_pool(module: ModuleType) -> None:
    """Route a prompt-affinity pool's new requests by their content before stock's pick."""
    replace_once(module.StagePool, "submit_initial", _routing_first)


def _routing_first(original: Any) -> Any:
    @functools.wraps(original)
    async def submit_initial(
        self: Any, request_id: str, req_state: Any, request: Any, *args: Any, **kwargs: Any
    ) -> Any:
        balancer = getattr(self, "_lb", None)
        if isinstance(balancer, PromptAffinityBalancer):
            await route_before_submit(self, balancer, request_id, request, kwargs.get("affinity_request_id"))
        return await original(self, request_id, req_state, request, *args, **kwargs)

    return submit_initial
