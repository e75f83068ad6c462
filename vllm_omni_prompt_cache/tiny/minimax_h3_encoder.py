"""vLLM-Omni's own MiniMax-H3 text encoder, built tiny with random weights.

Mirrors ``vllm_omni/diffusion/models/minimax_h3/encoder.py`` (``MiniMaxH3Qwen3VLEncoder``, vLLM-Omni
0.30) and the way ``pipeline_minimax_h3.py`` builds and calls it. :func:`build_minimax_h3_encoder`
returns the real class, not a copy: its constructor reads a ``Qwen3VLConfig`` from a directory (a
tiny ``config.json`` is written to a temporary one); ``tests/test_minimax_h3_encoder.py`` makes the
pipeline's call.

The pipeline (``MiniMaxH3Pipeline.__init__``, ``text_encoder_tp_size == 1``) passes
``device=self.device``, ``load_model=True`` on rank 0 and an ``encoder_group`` that is its
``_SingleRankEncoderGroup`` (``world_size`` 1, ``rank_in_group`` 0, no collective ever runs); the
same placeholder is built here. Its ``encode_prompt`` tokenizes one prompt into a 1-D int64 id
tensor (no mask: the encoder uses an all-ones attention mask, causal), calls
``text_encoder.encode_ids(ids)`` (``forward`` is the same call, for model-level offload hooks), and
takes the result as the prompt's hidden states: ``[L, 5120]`` bfloat16 on the CPU, moved to its
device as bfloat16, paired with per-token tags (all ones for text).

What the tiny config keeps:

* The text width is the real 5120: ``_encode`` checks the output is ``[L, 5120]``, so nothing
  narrower runs. Everything else is small: one decoder layer (of the real 50 retained), 2 query heads
  and 1 KV head of dim 8 (interleaved M-RoPE sections ``[2, 1, 1]``), an MLP of 16, a vocabulary of
  1024 (about 6.4M parameters in all; building takes 0.1 s once vLLM is imported).
* The vision tower is built, as the constructor always builds it: one block of width 16, 2 heads,
  16 position embeddings, one DeepStack merger, output width 5120. It comes first in
  ``encoder.modules()``: the first module holding parameters is its patch embedding's ``nn.Conv3d``
  (``vision.patch_embed.proj``). The image/video placeholder ids keep Qwen3-VL's (151655, 151656),
  outside the tiny vocabulary, so no text id takes the vision path.
* The token table is ``text_model.embed_tokens``, a ``MiniMaxH3Qwen3VLVocabParallelEmbedding`` (an
  ``nn.Module`` of vLLM-Omni's own, neither ``nn.Embedding`` nor vLLM's ``VocabParallelEmbedding``).
  The vision tower's ``vision.pos_embed`` (an ``nn.Embedding`` of 16 rows) comes before it in
  ``modules()``. The encoder has no ``get_input_embeddings``; its ``forward`` takes ``input_ids``
  and keyword-only vision tensors and returns the hidden-state tensor (no tuple, no ``ModelOutput``).
* Weights are float32 (the constructor builds bfloat16; the module is cast after), eval mode. The
  encoder still returns bfloat16, as it does for the real checkpoint.

Building needs vLLM's tensor-parallel group, because vLLM's ``ModelWeightParameter`` (the weights of
its fused QKV / gate-up / row-parallel linears) reads the TP rank when made: a one-rank gloo group is
joined once per process and kept (:func:`one_rank_process_group`, which the coverage matrix uses too), and
the layers are built under ``set_current_vllm_config``. Their
weights are kept in place (vLLM's ``skip_weight_relayout``), since the encoder reads
``qkv_proj.weight`` and ``gate_up_proj.weight`` directly. ``VllmConfig()`` needs a vLLM platform:
where no GPU is visible, this package's CPU platform
(``cpu_platform.entry_points.opt_in_where_no_gpu()``, as ``tests/conftest.py`` calls it before vLLM
is imported).
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

#: The hidden width ``MiniMaxH3Qwen3VLEncoder._encode`` requires (``MINIMAX_H3_QWEN3VL_HIDDEN_DIM``).
HIDDEN = 5120
VOCAB = 1024

_TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 1, 1]},
}
_VISION_CONFIG: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": HIDDEN,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0],
}


class _OneRankEncoderGroup:
    """What the pipeline passes as ``encoder_group`` for one encoder rank (its ``_SingleRankEncoderGroup``)."""

    world_size = 1
    rank_in_group = 0
    ranks = [0]  # noqa: RUF012 - read-only, as upstream's class attribute
    device_group = None


@functools.cache
def one_rank_process_group() -> None:
    """Join a one-rank gloo group once per process (vLLM's parallel layers read its size and rank when made); it
    stays for the life of the process. The coverage matrix's builders use it too."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    rendezvous = Path(tempfile.mkdtemp(prefix="minimax-h3-gloo-")) / "rendezvous"
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(1, 0, f"file://{rendezvous}", 0, "gloo")
        parallel_state.initialize_model_parallel(1, 1)


def _keep_linear_weights(encoder: torch.nn.Module) -> None:
    """Finish vLLM's linears as its loader does, keeping each ``weight`` (the encoder reads some directly)."""
    from vllm.model_executor.layers.linear import LinearBase

    for module in encoder.modules():
        if isinstance(module, LinearBase):
            module.skip_weight_relayout = True  # on a CPU platform: plain F.linear, weight kept
            module.quant_method.process_weights_after_loading(module)


def build_minimax_h3_encoder(*, seed: int = 0, device: torch.device | str = "cpu") -> torch.nn.Module:
    """vLLM-Omni's ``MiniMaxH3Qwen3VLEncoder`` from the tiny config (see the module), seeded random
    float32 weights, eval mode. ``device`` is what ``MiniMaxH3Pipeline.__init__`` passes (its own): the encoder keeps
    it as its target and its weights on the CPU until ``load_to_device()``, as the real constructor does. Joins a
    one-rank vLLM TP group for the process if none is up."""
    from transformers import Qwen3VLConfig
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm_omni.diffusion.models.minimax_h3.encoder import MiniMaxH3Qwen3VLEncoder

    one_rank_process_group()
    config = Qwen3VLConfig(text_config=_TEXT_CONFIG, vision_config=_VISION_CONFIG)
    with (
        tempfile.TemporaryDirectory(prefix="minimax-h3-encoder-") as model_path,
        torch.random.fork_rng(devices=[]),
        set_current_vllm_config(VllmConfig()),
    ):
        Path(model_path, "config.json").write_text(json.dumps(config.to_dict()))
        torch.manual_seed(seed)
        encoder = MiniMaxH3Qwen3VLEncoder(
            model_path, device=torch.device(device), load_model=True, encoder_group=_OneRankEncoderGroup()
        )
        encoder.float()
        with torch.no_grad():  # vLLM's linears and the token table are allocated empty
            for parameter in encoder.parameters():
                if parameter.dim() > 1:
                    parameter.normal_(std=0.02)
        _keep_linear_weights(encoder)
    return encoder.eval()
