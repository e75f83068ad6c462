"""Two ranks on CPU (gloo): an encode whose ranks exchange tensors runs its collectives on every rank, every call.

vLLM-Omni's ``MiniMaxH3Pipeline.encode_prompt`` tokenizes and encodes on rank 0 and broadcasts the
hidden states to every other DiT rank, which is called with nothing to encode itself; a text encoder
under tensor parallelism all-reduces inside its forward. Were one rank to skip the method while another
ran it, the running rank would wait forever in its collective. The cache answers text-encoder calls on
each rank from that rank's entries and runs every encode method for real, so every collective runs on
every rank, every call, and a repeated prompt's encoder call is answered without running the encoder.
Each rank runs in its own process, as in the engine; every wait is bounded, so a hang fails the test.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns
from vllm_omni_prompt_cache.tiny.text_encoder import build_qwen2_encoder

RANKS = 2
ORDER = ((5, 6, 7), (5, 6, 7), (9, 9, 9, 9), (5, 6, 7))  # A, A, B, A
#: How long a collective, and a rank's process, may take before the test calls it a hang.
COLLECTIVE_TIMEOUT_S = 60
JOIN_S = 150

#: How many calls entered each pipeline's encode method (its collectives run there), kept outside the pipeline.
_BODY_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _entered(pipeline: Any) -> None:
    _BODY_RUNS[pipeline] = _BODY_RUNS.get(pipeline, 0) + 1


class BroadcastingEncode(CountsEncoderRuns, torch.nn.Module):
    """The H3 pattern: ids stashed on the pipeline; rank 0 encodes them and broadcasts the hidden states."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.count_encoder_calls(encoder)  # real runs of the encoder's forward: an answered call makes none

    @torch.inference_mode()
    def encode_prompt(self, *, task: str, prompt: str) -> torch.Tensor:
        _entered(self)
        if dist.get_rank() == 0:
            hidden = self.text_encoder(input_ids=torch.tensor([self._h3_prompt_ids])).last_hidden_state[0]
            shape = torch.tensor(hidden.shape)
        else:
            shape = torch.zeros(2, dtype=torch.long)
        dist.broadcast(shape, src=0)
        if dist.get_rank() != 0:
            hidden = torch.empty(*shape.tolist())
        dist.broadcast(hidden, src=0)
        return hidden


class AllReducingEncode(CountsEncoderRuns, torch.nn.Module):
    """Tensor parallelism's pattern: every rank encodes its share and the shares are summed (all-reduce)."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.count_encoder_calls(encoder)

    @torch.inference_mode()
    def encode_prompt(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        _entered(self)
        hidden = self.text_encoder(input_ids=prompt_ids).last_hidden_state / dist.get_world_size()
        dist.all_reduce(hidden)
        return hidden


def _rank(rank: int, port: int, kind: str, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=RANKS, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    try:
        torch.manual_seed(0)
        pipeline_class = BroadcastingEncode if kind == "broadcast" else AllReducingEncode
        pipeline = pipeline_class(build_qwen2_encoder())  # the same weights on every rank
        cache = install_prompt_embed_cache(pipeline, max_size=8)
        outputs = []
        try:
            for ids in ORDER:
                if kind == "broadcast":
                    pipeline._h3_prompt_ids = list(ids) if rank == 0 else None  # only rank 0 has the request's ids
                    outputs.append(pipeline.encode_prompt(task="t2va", prompt="[pretokenized]"))
                else:
                    outputs.append(pipeline.encode_prompt(torch.tensor([ids])))
        except Exception:  # a collective timed out, say: the other rank skipped it
            stats = cache.stats()
            results[rank] = {
                "error": f"call {len(outputs)} of {len(ORDER)}: {traceback.format_exc()[-1500:]}",
                "entered": _BODY_RUNS.get(pipeline, 0),
                "encode_methods": stats["encode_methods"],
                "key_only_hits": stats["key_only_hits"],
            }
            raise
        stats = cache.stats()
        results[rank] = {
            "outputs": outputs,
            "runs": pipeline.encoder_runs,
            "entered": _BODY_RUNS.get(pipeline, 0),
            "state": stats["encode_methods"]["encode_prompt"]["state"],
            "hits": stats["hits"],
            "misses": stats["misses"],
            "key_only_hits": stats["key_only_hits"],
        }
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(kind: str) -> dict[int, dict[str, Any]]:
    """What each rank's cache did with one pattern, in two processes joined by a gloo group; a rank still running
    after ``JOIN_S`` is killed and reported."""
    context = mp.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        port = _free_port()
        processes = [context.Process(target=_rank, args=(rank, port, kind, results)) for rank in range(RANKS)]
        for process in processes:
            process.start()
        stuck = []
        for process in processes:
            process.join(JOIN_S)
            if process.is_alive():
                stuck.append(process.pid)
                process.kill()
                process.join(10)
        found = dict(results)
        assert not stuck, f"a rank is stuck in a collective: {stuck}; {found}"
        return found


@pytest.mark.parametrize("kind", ["broadcast", "all_reduce"])
def test_every_collective_runs_on_every_rank_and_every_rank_returns_rank_0s(kind) -> None:
    ranks = run_ranks(kind)
    results = {rank: ranks.get(rank) for rank in range(RANKS)}
    errors = {rank: result["error"] for rank, result in results.items() if result and "error" in result}
    assert not errors, errors
    assert all(results[rank] is not None for rank in range(RANKS)), results
    # Every call ran the method on every rank, so every collective ran; and every rank returned what rank 0
    # encoded.
    assert all(results[rank]["entered"] == len(ORDER) for rank in range(RANKS))
    for rank in range(1, RANKS):
        for mine, rank0s in zip(results[rank]["outputs"], results[0]["outputs"], strict=True):
            assert torch.equal(mine, rank0s)
    assert not torch.equal(results[0]["outputs"][0], results[0]["outputs"][2])
    # The encoder ran once per distinct prompt where it is called (rank 0; with all-reduce every rank): each
    # repeat's encoder call was answered from that rank's cache.
    distinct = len(set(ORDER))
    encoding = range(RANKS) if kind == "all_reduce" else (0,)
    for rank in encoding:
        assert results[rank]["runs"] == distinct, results[rank]
        assert (results[rank]["hits"], results[rank]["misses"]) == (len(ORDER) - distinct, distinct)
        assert results[rank]["state"] == "cached" and results[rank]["key_only_hits"] == 0
    for rank in set(range(RANKS)) - set(encoding):  # a rank that calls no encoder: nothing of it is cached
        assert results[rank]["runs"] == 0 and results[rank]["key_only_hits"] == 0, results[rank]
