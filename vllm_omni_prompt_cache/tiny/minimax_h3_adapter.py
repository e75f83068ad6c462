"""A stand-in of verl-omni's MiniMax-H3 rollout adapters, faithful to how they encode pre-tokenized prompts.

MiniMax-H3's real pipeline (a Qwen3-VL-32B text encoder, a joint video-audio DiT) cannot be built
here, so :class:`MiniMaxH3PipelineWithLogProb` reproduces the adapters' *encode path* over this
package's tiny Qwen-Image (:class:`~.token_id_pipeline.TokenIdQwenImagePipeline` denoises and
decodes). What matters to the cache is kept: the request's ids reach the encode through instance
state, never through an argument, and every prompt's ``encode_prompt`` call has the same arguments.

Mirrored, from verl-project/verl-omni (main, December 2026):

* ``_ensure_prompt_text(request)`` (``minimax_h3_flow_grpo/weight_sync.py``, and the same in
  ``minimax_h3_diffusion_nft/common.py``): ``self._h3_prompt_ids`` is reset to None; a request whose
  first prompt is a dict with token ids (``prompt_token_ids`` / ``prompt_ids``) must carry
  ``extra_args["minimax_h3_token_id_native"] is True`` (else ``ValueError``); the ids (a list, or the
  first of a list of lists) become a 1-D int64 CPU tensor on ``self._h3_prompt_ids`` (empty:
  ``ValueError``), and the request's prompt text becomes ``"[pretokenized]"``.
* ``forward(request)`` (``minimax_h3_flow_grpo/vllm_omni_rollout_adapter.py``): one request per
  forward (else ``ValueError``), ``supports_request_batch = False``; ``_ensure_prompt_text``, then the
  stock forward, and ``self._h3_prompt_ids = None`` in a ``finally``.
* ``encode_prompt(self, *, task, prompt, **kwargs)`` (``weight_sync.py``): without stashed ids, the
  upstream encode; with them, ``self.tokenizer`` is swapped for an override that answers the
  placeholder prompt with the stashed ids, the upstream encode runs, and the tokenizer is restored
  in a ``finally``.
* The upstream encode (vLLM-Omni's ``MiniMaxH3Pipeline.encode_prompt``, keyword-only ``task`` and
  ``prompt``): rank 0 tokenizes, the text encoder runs, and the hidden states and per-token tags
  (all text: ones) are broadcast from rank 0 to the other DiT ranks when there are several; it
  returns ``(hidden [L, D], tags [L])``.

Left out: the video-audio DiT, CPS sampling, log-probabilities and the trajectory envelope, the
reference-image paths (``fl2va``, ``ref2va``) and LoRA weight sync; ``task`` is ``"t2va"``. The
stock Qwen-Image forward turns the ``(hidden, tags)`` into its prompt embeddings; CFG is off (the
H3 rollout's negative prompt is not part of what the cache sees differently).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

from vllm_omni_prompt_cache.tiny.token_id_pipeline import TokenIdQwenImagePipeline

MINIMAX_H3_PIPELINE = "vllm_omni_prompt_cache.tiny.minimax_h3_adapter.MiniMaxH3PipelineWithLogProb"
#: The sampling ``extra_args`` key verl-omni's H3 agent loop sets on token-ID requests.
TOKEN_ID_NATIVE_KEY = "minimax_h3_token_id_native"
PRETOKENIZED = "[pretokenized]"
T2VA = "t2va"
_ID_KEYS = ("prompt_token_ids", "prompt_ids")


class _PromptTokenOverride:
    """A tokenizer that answers ``prompt`` with the agent loop's ids and defers everything else."""

    def __init__(self, tokenizer: Any, prompt: str, prompt_ids: torch.Tensor) -> None:
        self._tokenizer, self._prompt, self._prompt_ids = tokenizer, prompt, prompt_ids

    def __call__(self, text: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if text == self._prompt:
            return {"input_ids": self._prompt_ids.unsqueeze(0)}
        return self._tokenizer(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


class MiniMaxH3TextEncode(TokenIdQwenImagePipeline):
    """The upstream H3 encode over the tiny text stack: keyword-only ``task`` and ``prompt``, rank 0
    tokenizes, the results are broadcast to the other ranks (see the module)."""

    supports_request_batch: ClassVar[bool] = False
    supports_step_execution: ClassVar[bool] = False

    def encode_prompt(self, *, task: str, prompt: str, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        if task != T2VA:
            raise NotImplementedError(f"this stand-in encodes {T2VA!r} only, got {task!r}")
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        hidden = tags = None
        if ranks == 1 or dist.get_rank() == 0:
            ids = torch.as_tensor(self.tokenizer(prompt)["input_ids"], dtype=torch.long).reshape(-1)
            embeds, mask = self.embed_token_ids(ids.unsqueeze(0).to(self.device), torch.ones_like(ids).unsqueeze(0))
            hidden = embeds[0, : int(mask[0].sum())]
            tags = torch.ones(hidden.shape[0], dtype=torch.long, device=hidden.device)
        if ranks > 1:  # rank 0's tensors go to every DiT rank: their shapes first, then their values
            shape = torch.tensor(list(hidden.shape) if hidden is not None else [0, 0], dtype=torch.long)
            dist.broadcast(shape, src=0)
            if hidden is None:
                hidden = torch.empty(*shape.tolist(), dtype=self.text_encoder.dtype)
                tags = torch.empty(int(shape[0]), dtype=torch.long)
            dist.broadcast(hidden, src=0)
            dist.broadcast(tags, src=0)
        return hidden, tags


class MiniMaxH3PipelineWithLogProb(MiniMaxH3TextEncode):
    """verl-omni's MiniMax-H3 rollout adapter's encode path (see the module)."""

    def encode_prompt(self, *, task: str, prompt: str, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        prompt_ids = getattr(self, "_h3_prompt_ids", None)
        if prompt_ids is None:
            return super().encode_prompt(task=task, prompt=prompt, **kwargs)
        tokenizer = self.tokenizer
        self.tokenizer = _PromptTokenOverride(tokenizer, prompt, prompt_ids)
        try:
            return super().encode_prompt(task=task, prompt=prompt, **kwargs)
        finally:
            self.tokenizer = tokenizer

    def _ensure_prompt_text(self, request: DiffusionRequestBatch) -> None:
        self._h3_prompt_ids = None
        prompts = getattr(request, "prompts", None)
        if not prompts or not isinstance(prompts[0], dict):
            return
        custom_prompt = prompts[0]
        token_ids = next((custom_prompt[key] for key in _ID_KEYS if key in custom_prompt), None)
        if token_ids is None:
            return
        extra_args = getattr(request.sampling_params_list[0], "extra_args", None) or {}
        if extra_args.get(TOKEN_ID_NATIVE_KEY) is not True:
            raise ValueError(f"MiniMax H3 token-ID-native rollout requires extra_args[{TOKEN_ID_NATIVE_KEY!r}]=True")
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.detach().cpu().tolist()
        if token_ids and isinstance(token_ids[0], list):
            token_ids = token_ids[0]
        self._h3_prompt_ids = torch.as_tensor([int(token) for token in token_ids], dtype=torch.long)
        if self._h3_prompt_ids.numel() == 0:
            raise ValueError("MiniMax H3 requires non-empty prompt_ids.")
        custom_prompt["prompt"] = PRETOKENIZED

    def encode_request_prompts(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        images_per_prompt: int,
        max_sequence_length: int,
        *,
        one_request: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As H3's forward encodes: ``encode_prompt(task=..., prompt=<the request's text>)``, whatever ids were
        collated (the ids reach the encode through ``self._h3_prompt_ids``)."""
        text = PRETOKENIZED if self._h3_prompt_ids is not None else self._warm_up_text
        hidden, _tags = self.encode_prompt(task=T2VA, prompt=text)
        embeds = hidden.unsqueeze(0).repeat_interleave(images_per_prompt, dim=0)
        return embeds, torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)

    def forward(self, req: DiffusionRequestBatch) -> list[DiffusionOutput]:
        if len(req.prompts) != 1:
            raise ValueError(f"MiniMax H3 expects one request, got {len(req.prompts)}.")
        prompt = req.prompts[0]
        # The engine's warm-up request carries text: the upstream encode tokenizes it, templated.
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        self._warm_up_text = self.prompt_template_encode.format(text or "")
        self._ensure_prompt_text(req)
        try:
            return super().forward(req)
        finally:
            self._h3_prompt_ids = None
