"""How the demo and the tests run R replicas of the diffusion stage in one ``AsyncOmni`` process.

vLLM-Omni 0.30 applies ``omni_lb_policy`` only in its distributed runtime (an omni coordinator, a
master server, and the stage's replicas as processes that register with it); the single-node
runtime round-robins whatever the policy says. Its distributed runtime also serves a model that
needs no deploy config, such as Qwen-Image: ``stage_id=0`` with a master address and port makes
this process the head, and ``omni_dp_size_local=R`` launches R local replicas. So the demo
compares the policies there, with the same kwargs a user passes.

Starting and stopping such an engine is :mod:`~vllm_omni_prompt_cache.vllm_omni.engine_client`'s.
"""

from __future__ import annotations

import socket
from typing import Any

from vllm_omni_prompt_cache.vllm_omni.cli_args import POLICY

#: Load-balancing policies a run may use: vLLM-Omni 0.30's three, then ours.
LB_POLICIES = ("random", "round-robin", "least-queue-length", POLICY)


def free_port() -> int:
    """Return a TCP port on loopback that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def distributed_kwargs(replicas: int, lb_policy: str) -> dict[str, Any]:
    """Return the ``AsyncOmni`` kwargs that serve stage 0 with ``replicas`` local replicas behind ``lb_policy``."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if lb_policy not in LB_POLICIES:
        raise ValueError(f"unknown lb_policy {lb_policy!r}: expected one of {', '.join(LB_POLICIES)}")
    return {
        "stage_id": 0,
        "omni_master_address": "127.0.0.1",
        "omni_master_port": free_port(),
        "omni_dp_size_local": replicas,
        "omni_lb_policy": lb_policy,
    }
