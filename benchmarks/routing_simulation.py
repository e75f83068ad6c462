"""Simulate a GRPO rollout's routing over R replicas with the real balancer classes; print a table.

P prompts x K siblings reach the head at once, as an RL rollout's ``asyncio.gather`` sends them,
in one of three orders: ``interleaved`` (sibling-major: one request of every prompt, then the next
round), ``grouped`` (bursty, prompt-major: a prompt's K siblings back to back, as verl lays out a
batch) or ``shuffled`` (any order, as many concurrent clients produce). Nothing finishes while
they arrive, so a replica's in-flight load is what it has been given. Each request goes through a
balancer's ``select(task, replicas)`` with ``queue_length`` = that in-flight load, as our pool hook
supplies it. A request hits if an earlier sibling went to the same replica (one cache per replica,
large enough for the rollout).

Policies: vLLM-Omni 0.30's ``RandomBalancer``, ``RoundRobinBalancer`` and
``LeastQueueLengthBalancer``; our ``PromptAffinityBalancer``; and verl's sticky routing as
verl-omni uses it with its prompt-embed cache's routing affinity on: a group's first request goes to
the replica with the fewest requests in flight (ties to the first replica), and every later request
with the same group uid goes where the first went, whatever its load (verl's
``GlobalRequestLoadBalancer.acquire_server``, routing id = the group's uid). For reference, a greedy
oracle under prompt-affinity's bound: it knows where every prompt is warm and joins the least-loaded
warm replica with room, else the least-loaded one.

    python benchmarks/routing_simulation.py                 # R = 2..64, P = 64, K = 16, 5 seeds
    python benchmarks/routing_simulation.py --replicas 2 8 --seeds 1
    VLLM_OMNI_PROMPT_AFFINITY_EPSILON=1 python benchmarks/routing_simulation.py   # a looser bound
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_omni.distributed.omni_coordinator.load_balancer import (
    LeastQueueLengthBalancer,
    LoadBalancer,
    RandomBalancer,
    RoundRobinBalancer,
    Task,
)
from vllm_omni.distributed.omni_coordinator.messages import ReplicaInfo, ReplicaStatus

from vllm_omni_prompt_cache.calls.routing import EPSILON_ENV, BoundedLoadRing, epsilon_from_env
from vllm_omni_prompt_cache.vllm_omni.balancer import PromptAffinityBalancer

ORDERS = ("interleaved", "grouped", "shuffled")


class StickyLeastLoaded(LoadBalancer):
    """verl's sticky routing, modelled: a uid's first request to the fewest in flight, its siblings after it.

    verl counts in-flight requests per server itself (acquire / release); here nothing finishes
    during the rollout, so that count is the replica's ``queue_length``. Its mapping is an LRU of
    10,000 routing ids, far more than a rollout's groups, so nothing is forgotten here.
    """

    def __init__(self) -> None:
        self._server_of: dict[str, str] = {}

    def select(self, task: Task, replicas: list[ReplicaInfo]) -> int:
        uid = task["engine_inputs"]["uid"]
        addresses = [replica.input_addr for replica in replicas]
        server = self._server_of.get(uid)
        if server in addresses:
            return addresses.index(server)
        index = min(range(len(replicas)), key=lambda each: replicas[each].queue_length)  # first of the least loaded
        self._server_of[uid] = addresses[index]
        return index


class GreedyUnderTheBound(LoadBalancer):
    """Reference only: remembers every placement and hits whenever the bound allows; no consistent hashing."""

    def __init__(self) -> None:
        self.bound = BoundedLoadRing(epsilon=epsilon_from_env())  # only for its capacity()
        self._warm: dict[str, set[str]] = {}

    def select(self, task: Task, replicas: list[ReplicaInfo]) -> int:
        uid = task["engine_inputs"]["uid"]
        loads = [replica.queue_length for replica in replicas]
        cap = self.bound.capacity(sum(loads) + 1, len(replicas))
        warm = self._warm.setdefault(uid, set())
        room = [index for index, replica in enumerate(replicas) if replica.input_addr in warm and loads[index] < cap]
        index = min(room or range(len(replicas)), key=loads.__getitem__)
        warm.add(replicas[index].input_addr)
        return index


POLICIES: dict[str, Callable[[], LoadBalancer]] = {
    "random": RandomBalancer,
    "round-robin": RoundRobinBalancer,
    "least-queue-length": LeastQueueLengthBalancer,
    "sticky least-loaded (verl-omni)": StickyLeastLoaded,
    "prompt-affinity": PromptAffinityBalancer,
    "(reference: greedy oracle under the bound)": GreedyUnderTheBound,
}


@dataclass(frozen=True)
class Outcome:
    hit_rate: float
    max_over_mean: float
    us_per_request: float


def rollout(policy: str, replica_count: int, prompts: int, group_size: int, order: str, seed: int) -> Outcome:
    """Route one rollout and return its hit rate, final max/mean load and routing cost."""
    rng = random.Random(seed)
    random.seed(seed)  # vLLM-Omni's random policies draw from the module's generator
    negative = [rng.randrange(150_000) for _ in range(12)]
    contents = [
        {"prompt_ids": [rng.randrange(150_000) for _ in range(rng.randrange(20, 120))], "negative_prompt_ids": negative}
        for _ in range(prompts)
    ]
    if order == "interleaved":
        arrivals = [prompt for _ in range(group_size) for prompt in range(prompts)]
    else:
        arrivals = [prompt for prompt in range(prompts) for _ in range(group_size)]
        if order == "shuffled":
            rng.shuffle(arrivals)
    balancer = POLICIES[policy]()
    names = [f"tcp://10.0.{seed}.{index}:{5000 + index}" for index in range(replica_count)]
    loads = [0] * replica_count
    warm: set[tuple[int, int]] = set()
    hits = 0
    started = time.perf_counter()
    for number, prompt in enumerate(arrivals):
        replicas = [
            ReplicaInfo(name, "", 0, ReplicaStatus.UP, load, 0.0, 0.0) for name, load in zip(names, loads, strict=True)
        ]
        inputs = {**contents[prompt], "uid": f"group-{seed}-{prompt}"}
        index = balancer.select(Task(request_id=f"req-{number}", engine_inputs=inputs), replicas)
        loads[index] += 1
        hits += (prompt, index) in warm
        warm.add((prompt, index))
    elapsed = time.perf_counter() - started
    mean = len(arrivals) / replica_count
    return Outcome(hits / len(arrivals), max(loads) / mean, elapsed / len(arrivals) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=5, help="rollouts per cell (different prompts)")
    args = parser.parse_args()
    if min(args.replicas) < 1 or args.prompts < 1 or args.group_size < 1 or args.seeds < 1:
        parser.error("--replicas, --prompts, --group-size and --seeds must be >= 1")

    best = (args.group_size - 1) / args.group_size
    print(
        f"P = {args.prompts} prompts x K = {args.group_size} siblings, all in flight; hit rate = mean over "
        f"{args.seeds} rollouts (best possible {best:.4f}); max/mean = worst final load over them "
        f"(prompt-affinity's bound: 1 + epsilon = {1 + epsilon_from_env():g}, rounded up per replica; "
        f"epsilon from {EPSILON_ENV})\n"
    )
    columns = " | ".join(f"R={count}" for count in args.replicas)
    print(f"| arrivals | policy | {columns} |")
    print("|---|---|" + "---:|" * len(args.replicas))
    cost: dict[str, list[float]] = {}  # microseconds per select, by policy, per R (best of the rollouts)
    for order in ORDERS:
        for policy in POLICIES:
            cells = []
            for count in args.replicas:
                runs = [
                    rollout(policy, count, args.prompts, args.group_size, order, seed) for seed in range(args.seeds)
                ]
                hit = sum(run.hit_rate for run in runs) / len(runs)
                cells.append(f"{hit:.3f} / {max(run.max_over_mean for run in runs):.2f}")
                if order == ORDERS[0]:
                    cost.setdefault(policy, []).append(min(run.us_per_request for run in runs))
            print(f"| {order} | {policy} | " + " | ".join(cells) + " |")
    print("\ncells: hit rate / max-over-mean load\n")
    print("Routing cost, microseconds per request (interleaved; building the replica list included):\n")
    print(f"| policy | {columns} |")
    print("|---|" + "---:|" * len(args.replicas))
    for policy, microseconds in cost.items():
        print(f"| {policy} | " + " | ".join(f"{value:.1f}" for value in microseconds) + " |")


if __name__ == "__main__":
    main()
