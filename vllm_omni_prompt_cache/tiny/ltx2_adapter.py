"""A stand-in of verl-omni's LTX-2.3 FlowGRPO rollout adapter, faithful to how it encodes pre-tokenized prompts.

verl-omni cannot be installed here (see :mod:`.verl_omni_adapters`), so :class:`LTX23PipelineWithLogProb`
reproduces its LTX-2 adapter's *encode path* over vLLM-Omni 0.30's own ``LTX2Pipeline`` and this
package's tiny LTX-2.3 (:mod:`.ltx2`). Load it with
``custom_pipeline_args={"pipeline_class": LTX2_FLOW_GRPO_PIPELINE}``. The class keeps the real one's
name and base class, and its encoder method keeps the real one's name and signature: the cache
recognizes ``_encode_token_ids`` by the class that defines it.

Mirrored, from verl-project/verl-omni (main at a1139ba, August 2026),
``verl_omni/pipelines/ltx2_flow_grpo/vllm_omni_rollout_adapter.py``, ``LTX23PipelineWithLogProb``:

* the class (lines 71-75): a subclass of ``LTX2Pipeline`` with ``supports_request_batch = False``,
  so vLLM-Omni refuses to start it with ``max_num_seqs`` > 1, and one request reaches each forward;
* ``_encode_token_ids(token_ids, attention_mask, max_sequence_length)`` (lines 100-138): a list
  becomes a 1-D int64 tensor on the pipeline's device (a tensor is moved and cast), 1-D ids and
  masks become one row, no mask means every position is attended; ids and mask are cut to their
  first ``max_sequence_length`` positions and left-padded to exactly that length with the
  tokenizer's pad id (its eos id if it has none), the mask with zeros; Gemma 3 runs on
  ``input_ids`` / ``attention_mask`` with ``output_hidden_states=True``, and every hidden state
  (embeddings and each layer) is stacked on a last axis and flattened into ``[B, L, D x
  (layers + 1)]``, cast to the encoder's dtype. Returns ``(embeds, mask)``.
* ``_inject_precomputed_prompt_embeds`` (lines 140-167): a non-dict prompt is a ``TypeError``; with
  no ``prompt_token_ids`` nothing is injected; ``max_sequence_length`` is the request's, else the
  tokenizer's. One ``_encode_token_ids`` call for ``prompt_token_ids`` / ``prompt_mask``, and one
  for ``negative_prompt_ids`` / ``negative_prompt_mask`` when the request has them; row 0 of each
  result goes into a copy of the prompt dict as ``prompt_embeds`` / ``prompt_attention_mask`` and
  ``negative_prompt_embeds`` / ``negative_prompt_attention_mask``, which replaces the request's
  prompt. ``LTX2Pipeline``'s request path then stacks them back into ``[1, L, ...]`` and its
  ``encode_prompt`` returns them unencoded.
* ``forward`` (lines 422-430): exactly one request per forward (else ``ValueError``); the request's
  output type is normalized as ``_configure_flow_grpo`` does (lines 169-170, ``common.py`` lines
  51-53: ``"image"`` becomes ``"pt"``), the embeddings are injected, and ``LTX2Pipeline.forward``
  runs. It has no warm-up branch, and needs none: the LTX-2 family's ``dummy_run_num_frames`` is 0,
  so vLLM-Omni skips its start-up dummy request (whose text prompt the injection would reject).

Requests are built as verl-omni's rollout builds them: ``ltx2_flow_grpo/agent_loop.py`` lines 82-106
tokenize the raw prompt text with ``add_special_tokens=True`` (Gemma's ``<bos>`` first), no padding,
truncated to the rollout's prompt length; ``verl_omni/agent_loop/single_turn_agent_loop.py`` lines
86-91 tokenize the negative prompt the same way (the negative of the LTX-2 example data,
``examples/flowgrpo_trainer/ltx2/prepare_data.py`` line 52, is empty, so its ids are ``[<bos>]``);
``verl_omni/workers/rollout/vllm_rollout/vllm_omni_async_server.py`` lines 584-591 send
``{"prompt_token_ids": ..., "negative_prompt_ids": ...}`` with no masks.

Left out, because the cache never sees it: the CPS/SDE sampling and per-step log-probabilities
(the ``FlowMatchSDEDiscreteScheduler`` loaded in ``__init__``, lines 77-98; ``_select_sde_steps``,
lines 182-201; ``run_phase`` with its own sigma schedule and shift, lines 208-372; ``_denoise_step``,
lines 374-420): denoising here is the stock 2.3 recipe's phase, with its Euler scheduler. Also left
out: the rest of ``_configure_flow_grpo`` (SDE knobs from ``extra_args``, lines 171-180), the
prompt-context capture (lines 203-206) and the rollout envelope with trajectory and connector
outputs (lines 431-472), the post-processing hook patched in at import (lines 59-68), and the
registry decorator. ``forward`` returns ``LTX2Pipeline``'s own ``(video, audio)`` output and, when the
request asks for trajectory latents, the final video latents as ``trajectory_latents`` (exactness
checks compare these). The training side (``diffusers_training_adapter.py``) never runs inside
vLLM-Omni.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.models.ltx2.pipeline_ltx2 import LTX2Pipeline
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns

LTX2_FLOW_GRPO_PIPELINE = "vllm_omni_prompt_cache.tiny.ltx2_adapter.LTX23PipelineWithLogProb"


class LTX23PipelineWithLogProb(CountsEncoderRuns, LTX2Pipeline):
    """LTX-2 that encodes pre-tokenized prompts as verl-omni's FlowGRPO adapter does (see the module)."""

    supports_request_batch = False

    def __init__(self, *, od_config: OmniDiffusionConfig, prefix: str = "") -> None:
        super().__init__(od_config=od_config, prefix=prefix)
        self.set_progress_bar_config(disable=True)  # one bar per request is noise in a rollout
        self._final_video_latents: torch.Tensor | None = None
        # Hooks on the module itself count every path into the encoder, this class's and the stock one's.
        self.count_encoder_calls(self.text_encoder)

    def _encode_token_ids(
        self,
        token_ids: torch.Tensor | list[int],
        attention_mask: torch.Tensor | None,
        max_sequence_length: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return Gemma 3's stacked hidden states ``[B, L, D x (layers + 1)]`` and the left-padded mask ``[B, L]``."""
        device = self.device
        if isinstance(token_ids, list):
            ids = torch.tensor(token_ids, device=device, dtype=torch.long)
        else:
            ids = token_ids.to(device=device, dtype=torch.long)
        ids = ids.unsqueeze(0) if ids.ndim == 1 else ids
        if attention_mask is None:
            mask = torch.ones_like(ids)
        else:
            mask = attention_mask.to(device=device)
            mask = mask.unsqueeze(0) if mask.ndim == 1 else mask

        ids, mask = ids[:, :max_sequence_length], mask[:, :max_sequence_length]
        missing = max_sequence_length - ids.shape[1]
        if missing > 0:  # left padding, as LTX's own tokenization pads
            pad_id = self.tokenizer.pad_token_id
            pad_id = self.tokenizer.eos_token_id if pad_id is None else pad_id
            ids = torch.nn.functional.pad(ids, (missing, 0), value=pad_id)
            mask = torch.nn.functional.pad(mask, (missing, 0), value=0)

        hidden_states = self.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        embeds = torch.stack(hidden_states, dim=-1).flatten(2, 3).to(dtype=self.text_encoder.dtype)
        return embeds, mask

    def _inject_precomputed_prompt_embeds(self, request: OmniDiffusionRequest) -> None:
        """Encode the request's token ids and put the raw Gemma embeddings into its prompt dict."""
        if not isinstance(request.prompt, dict):
            raise TypeError(f"{type(self).__name__} expects a dict prompt with 'prompt_token_ids'")
        prompt = dict(request.prompt)
        prompt_ids = prompt.get("prompt_token_ids")
        if prompt_ids is None:
            return
        max_sequence_length = request.sampling_params.max_sequence_length or self.tokenizer_max_length

        embeds, mask = self._encode_token_ids(prompt_ids, prompt.get("prompt_mask"), max_sequence_length)
        prompt["prompt_embeds"], prompt["prompt_attention_mask"] = embeds[0], mask[0]
        negative_ids = prompt.get("negative_prompt_ids")
        if negative_ids is not None:
            embeds, mask = self._encode_token_ids(negative_ids, prompt.get("negative_prompt_mask"), max_sequence_length)
            prompt["negative_prompt_embeds"], prompt["negative_prompt_attention_mask"] = embeds[0], mask[0]
        request.prompt = prompt

    @torch.no_grad()
    def forward(self, req: DiffusionRequestBatch, **kwargs: Any) -> DiffusionOutput:
        if req.num_reqs != 1:
            raise ValueError(f"{type(self).__name__} serves one request per forward, got {req.num_reqs}")
        request = req.requests[0]
        if request.sampling_params.output_type == "image":  # the generic default; LTX returns video tensors
            request.sampling_params.output_type = "pt"
        self._inject_precomputed_prompt_embeds(request)
        self._final_video_latents = None
        output = super().forward(req, **kwargs)
        if isinstance(output, list):
            if len(output) != 1:
                raise RuntimeError(f"one request gave {len(output)} outputs")
            output = output[0]
        if request.sampling_params.return_trajectory_latents and self._final_video_latents is not None:
            output.trajectory_latents = self._final_video_latents
        return output

    def decode_phase(self, phase: Any) -> DiffusionOutput | list[DiffusionOutput]:
        self._final_video_latents = phase.video.detach().clone()  # denoised, unpacked, before the VAE
        return super().decode_phase(phase)
