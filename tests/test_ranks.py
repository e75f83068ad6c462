"""Two ranks on CPU (gloo): an encode whose ranks exchange tensors is never served on one rank and run on another.

vLLM-Omni's ``MiniMaxH3Pipeline.encode_prompt`` tokenizes and encodes on rank 0 and broadcasts the
hidden states to every other DiT rank, which is called with nothing to encode itself; a text encoder
under tensor parallelism all-reduces inside its forward. Were one rank to hit while another missed,
the missing rank would wait forever in its collective. The cache sees the collectives on each rank's
first call (which every rank makes, uncached) and no rank caches that method: every rank takes the
same decision, every call. Each rank runs in its own process, as in the engine.
"""

from __future__ import annotations

import os
import socket
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


class BroadcastingEncode(CountsEncoderRuns, torch.nn.Module):
    """The H3 pattern: ids stashed on the pipeline; rank 0 encodes them and broadcasts the hidden states."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder

    @torch.inference_mode()
    def encode_prompt(self, *, task: str, prompt: str) -> torch.Tensor:
        if dist.get_rank() == 0:
            self.encoder_runs += 1
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

    @torch.inference_mode()
    def encode_prompt(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        self.encoder_runs += 1
        hidden = self.text_encoder(input_ids=prompt_ids).last_hidden_state / dist.get_world_size()
        dist.all_reduce(hidden)
        return hidden


def _rank(rank: int, port: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        torch.manual_seed(0)
        encoder = build_qwen2_encoder()  # the same weights on every rank
        for kind, pipeline_class in (("broadcast", BroadcastingEncode), ("all_reduce", AllReducingEncode)):
            pipeline = pipeline_class(encoder)
            cache = install_prompt_embed_cache(pipeline, max_size=8)
            outputs = []
            for ids in ORDER:
                if kind == "broadcast":
                    pipeline._h3_prompt_ids = list(ids) if rank == 0 else None  # only rank 0 has the request's ids
                    outputs.append(pipeline.encode_prompt(task="t2va", prompt="[pretokenized]"))
                else:
                    outputs.append(pipeline.encode_prompt(torch.tensor([ids])))
            stats = cache.stats()
            results[(kind, rank)] = {
                "outputs": outputs,
                "runs": pipeline.encoder_runs,
                "refusal": stats["encode_methods"]["encode_prompt"]["refusal"],
                "hits": stats["hits"],
            }
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def ranks() -> dict[tuple[str, int], dict[str, Any]]:
    """What each rank's cache did with both patterns, in two processes joined by a gloo group."""
    context = mp.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        port = _free_port()
        processes = [context.Process(target=_rank, args=(rank, port, results)) for rank in range(RANKS)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(120)
            assert not process.is_alive(), "a rank is stuck in a collective"
            assert process.exitcode == 0
        return dict(results)


@pytest.mark.parametrize("kind", ["broadcast", "all_reduce"])
def test_every_rank_takes_the_same_decision_and_every_collective_runs(kind, ranks) -> None:
    results = {rank: ranks[(kind, rank)] for rank in range(RANKS)}
    (refusal,) = {results[rank]["refusal"] for rank in range(RANKS)}  # the same on every rank
    assert refusal is not None and "collectives" in refusal and "c10d." in refusal
    assert all(results[rank]["hits"] == 0 for rank in range(RANKS))
    # Every call ran on every rank (rank 0 encoded each; with all-reduce every rank did), and every rank
    # returned what rank 0 encoded.
    assert results[0]["runs"] == len(ORDER)
    for rank in range(1, RANKS):
        for mine, rank0s in zip(results[rank]["outputs"], results[0]["outputs"], strict=True):
            assert torch.equal(mine, rank0s)
    assert not torch.equal(results[0]["outputs"][0], results[0]["outputs"][2])
