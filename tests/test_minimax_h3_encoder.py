"""vLLM-Omni's own MiniMax-H3 text encoder, built tiny: recognised, its calls served, and a hit runs no layer of it.

``MiniMaxH3Qwen3VLEncoder`` (``vllm_omni/diffusion/models/minimax_h3/encoder.py``, 0.30) is a Qwen3-VL whose
vision tower comes first in its module order (its first weighted layer is a ``Conv3d``) and which has no
``get_input_embeddings``: its token table sits inside ``text_model``. The pipeline below makes the call
vLLM-Omni's ``MiniMaxH3Pipeline`` makes without offload (``_encode_text_hidden``: ``encode_ids`` on a 1-D id
tensor, not the module's ``__call__``), and keeps the request's ids where verl-omni's MiniMax-H3 adapters keep
them (``_ensure_prompt_text`` stashes them on ``self._h3_prompt_ids``; ``encode_prompt(task=..., prompt=...)``
gets the same arguments for every prompt). Every call must equal its uncached twin's, and a hit must run no
layer of the encoder: a method of the encoder's own that code calls (``encode_ids``) is served as an encoder call.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.encoders.text_encoders import text_encoders

PROMPTS = {"A": [5, 17, 29, 3], "B": [88, 41, 7, 7, 90, 12], "C": [600, 2]}
SEQUENCE = "AAABACB"


@pytest.fixture(scope="module")
def encoder() -> torch.nn.Module:
    from vllm_omni_prompt_cache.tiny.minimax_h3_encoder import build_minimax_h3_encoder

    return build_minimax_h3_encoder()


class H3Encode(torch.nn.Module):
    """MiniMax-H3's text encode (``MiniMaxH3Pipeline.encode_prompt``'s text path) with verl-omni's stashed ids."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.transformer = torch.nn.Linear(8, 8)  # a stand-in DiT
        self._h3_prompt_ids: torch.Tensor | None = None

    @torch.inference_mode()
    def encode_prompt(self, *, task: str, prompt: str, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self._h3_prompt_ids if self._h3_prompt_ids is not None else torch.tensor([1, 2, 3])
        self.text_encoder.load_to_device()  # as _encode_text_hidden does without offload, then encode_ids
        hidden = self.text_encoder.encode_ids(ids)
        return hidden, torch.ones(hidden.shape[0], dtype=torch.long)

    @torch.inference_mode()
    def embed_request(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self._h3_prompt_ids
        self.text_encoder.load_to_device()
        hidden = self.text_encoder.encode_ids(ids)
        return hidden, torch.ones(hidden.shape[0], dtype=torch.long)

    @torch.inference_mode()
    def forward(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed_request(prompt)
        self.transformer(torch.zeros(8))
        return embeds


class FoundByWatching(H3Encode):
    encode_prompt = None  # type: ignore[assignment]


def test_the_encoder_is_recognised_by_the_token_table_inside_it(encoder) -> None:
    pipeline = H3Encode(encoder)
    first_weighted = next(part for part in encoder.modules() if any(True for _ in part.parameters(recurse=False)))
    assert isinstance(first_weighted, torch.nn.Conv3d) and not hasattr(encoder, "get_input_embeddings")
    assert list(text_encoders(pipeline)) == ["text_encoder"]


@pytest.mark.parametrize("found", [False, True], ids=["encode_prompt", "found by watching"])
def test_its_hits_run_no_layer_of_it(encoder, found: bool) -> None:
    from vllm_omni_prompt_cache import uninstall_prompt_embed_cache

    pipeline = (FoundByWatching if found else H3Encode)(encoder)
    twin = H3Encode(encoder)
    expected = {}  # the uncached twin's, made before the install: the encoder is shared, and its calls are served
    for name, ids in PROMPTS.items():
        twin._h3_prompt_ids = torch.tensor(ids)
        expected[name] = twin.encode_prompt(task="t2va", prompt="[pretokenized]")[0]
    lookups = []
    handle = encoder.text_model.layers[0].register_forward_hook(lambda *_: lookups.append(1))  # a decoder layer ran
    try:
        cache = install_prompt_embed_cache(pipeline)
        assert cache is not None
        wrong = 0
        for name in SEQUENCE:
            pipeline._h3_prompt_ids = torch.tensor(PROMPTS[name])
            served = (
                pipeline("[pretokenized]") if found else pipeline.encode_prompt(task="t2va", prompt="[pretokenized]")
            )
            wrong += not torch.equal(served[0], expected[name])
        stats = cache.stats()
    finally:
        handle.remove()
        uninstall_prompt_embed_cache(pipeline)
    method = "embed_request" if found else "encode_prompt"
    assert wrong == 0
    assert stats["encode_methods"][method]["state"] == "cached", stats["encode_methods"]
    assert stats["key_only_hits"] == 0
    # Each prompt encoded once, plus one encode of A: the first call of encode_ids runs for real while it is seen
    # to reach the encoder, its later calls are served. Every other repeat is a hit that ran no layer of it.
    assert len(lookups) <= len(set(SEQUENCE)) + 1
    counted = stats["methods"][method]
    # Found by watching, the call it was found in is counted before the method is wrapped.
    assert len(SEQUENCE) - found <= counted["hits"] + counted["misses"] <= len(SEQUENCE), counted
    assert counted["misses"] <= len(lookups), counted
