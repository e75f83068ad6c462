"""Talking to a running ``AsyncOmni`` engine: start and stop it, and ask its diffusion workers for values.

The demo, ``precompute`` and the tests all drive the real engine through these. vLLM-Omni 0.30's
distributed shutdown waits for the membership watcher, which stops only on an event set after that
wait: :func:`membership_watchers_stopped` sets it first, or every shutdown of a distributed engine
hangs for its 30 s timeout and leaves the replica processes running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

from vllm_omni_prompt_cache.counts.stats import CacheStats


@contextlib.asynccontextmanager
async def open_engine(kwargs: dict[str, Any]) -> AsyncIterator[Any]:
    """Yield a started ``AsyncOmni`` built from ``kwargs``; shut it down afterwards."""
    from vllm_omni.entrypoints.async_omni import AsyncOmni

    distributed = "omni_master_address" in kwargs
    engine = None
    try:
        with membership_watchers_stopped() if distributed else contextlib.nullcontext():
            engine = AsyncOmni(**kwargs)
            yield engine
    finally:  # after the watchers are told to stop: distributed shutdown waits for them
        if engine is not None:
            engine.shutdown()


async def cache_stats(engine: Any) -> CacheStats | None:
    """Return the diffusion workers' cache statistics (summed over replicas), or None when there is no cache."""
    replicas = [stats for stats in await worker_values(engine, "get_prompt_embed_cache_stats") if stats is not None]
    return CacheStats.merged(CacheStats.from_dict(stats) for stats in replicas) if replicas else None


async def worker_value(engine: Any, method: str) -> Any:
    """Return the first diffusion worker's answer to an RPC (one stage, one worker here)."""
    return (await worker_values(engine, method))[0]


async def worker_values(engine: Any, method: str) -> list[Any]:
    """Return every replica's diffusion worker's answer to an RPC, in replica order."""
    values = []
    for value in await engine.collective_rpc(method):
        while isinstance(value, list):  # one list per replica, one entry per worker
            value = value[0]
        values.append(value)
    return values


@contextlib.contextmanager
def membership_watchers_stopped() -> Iterator[None]:
    """Record membership controllers started inside the block; on leaving it, stop their watchers.

    Leave the block before ``engine.shutdown()``.
    """
    from vllm_omni.engine.membership_controller import MembershipController

    started: list[tuple[Any, asyncio.AbstractEventLoop]] = []
    original_start = MembershipController.start

    def start(self: Any) -> Any:
        started.append((self, asyncio.get_running_loop()))
        return original_start(self)

    MembershipController.start = start
    try:
        yield
    finally:
        MembershipController.start = original_start
        for controller, loop in started:
            if not loop.is_closed():
                loop.call_soon_threadsafe(controller._shutdown_event.set)
