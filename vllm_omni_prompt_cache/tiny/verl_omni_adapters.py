"""Stand-ins of the token-ID adapters our users run, faithful to how they call ``encode_prompt``.

verl-omni cannot be installed here (it pins a verl commit the package index lacks), so these
classes reproduce its Qwen-Image adapter's *encode path* — signature, argument types, devices and
call pattern — over this package's tiny Qwen-Image. Denoising and decoding are
:class:`~.token_id_pipeline.TokenIdQwenImagePipeline`'s: the cache sees only ``encode_prompt``.

Mirrored, from verl-project/verl-omni (main, August 2026):

* ``encode_prompt``: ``QwenImageTokenIdPromptMixin.encode_prompt`` in
  ``verl_omni/pipelines/qwen_image_flow_grpo/common.py`` (the same method is on
  ``QwenImagePipelineWithLogProb`` in ``vllm_omni_rollout_adapter.py`` beside it). Six parameters
  ``(prompt_ids, attention_mask=None, num_images_per_prompt=1, prompt_embeds=None,
  prompt_embeds_mask=None, max_sequence_length=1024)``; 1-D ids and masks are one row; no mask
  means every position is attended; given ``prompt_embeds`` skip the encoder; the result is cut to
  ``max_sequence_length`` and copied by ``repeat_interleave``.
* The request batch (``forward``): ``collate_prompt_rows`` / ``collate_prompt_mask`` in
  ``verl_omni/pipelines/request_batch.py``: each request's ``prompt_token_ids`` (a list) becomes one
  row of an int64 ``[B, L]`` tensor right-padded with 0 on the worker's device; the mask is the
  requests' ``prompt_mask`` or, without one, built from the lengths, as bool. One ``encode_prompt``
  call per forward with keywords, ``prompt_embeds=None`` and ``prompt_embeds_mask=None`` included,
  and one more for ``negative_prompt_ids`` under CFG.
* Step execution (``prepare_encode``): per request, ``torch.tensor(prompt_token_ids)`` — a 1-D
  tensor — and the request's mask as it came, with four keywords.

Two variants that nobody registered, for the inference path:

* :class:`ListIdsQwenImagePipeline`: issue #15's "newer verl-omni" keeps the ids as Python lists
  up to ``encode_prompt`` (no public source of it was available to mirror; the signature is kept).
* :class:`TeamTokenIdPipeline`: an RL team's own adapter with other parameter names and an extra
  argument.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm_omni_prompt_cache.tiny.token_id_pipeline import TokenIdQwenImagePipeline

VERL_OMNI_PIPELINE = "vllm_omni_prompt_cache.tiny.verl_omni_adapters.VerlOmniQwenImagePipeline"
LIST_IDS_PIPELINE = "vllm_omni_prompt_cache.tiny.verl_omni_adapters.ListIdsQwenImagePipeline"
TEAM_PIPELINE = "vllm_omni_prompt_cache.tiny.verl_omni_adapters.TeamTokenIdPipeline"


class VerlOmniQwenImagePipeline(TokenIdQwenImagePipeline):
    """verl-omni's Qwen-Image token-ID ``encode_prompt`` and its two call patterns (see the module)."""

    supports_request_batch: ClassVar[bool] = True

    def encode_prompt(  # type: ignore[override]
        self,
        prompt_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        num_images_per_prompt: int = 1,
        prompt_embeds: torch.Tensor | None = None,
        prompt_embeds_mask: torch.Tensor | None = None,
        max_sequence_length: int = 1024,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(embeds [B*n, S, D], mask [B*n, S])`` for ids ``[B, L]`` or ``[L]``."""
        if prompt_embeds is None:
            if prompt_ids is None:
                raise ValueError("prompt_ids is required when prompt_embeds is not given")
            prompt_ids = prompt_ids.unsqueeze(0) if prompt_ids.dim() == 1 else prompt_ids
            if attention_mask is None:
                attention_mask = torch.ones_like(prompt_ids, dtype=torch.long)
            attention_mask = attention_mask.unsqueeze(0) if attention_mask.dim() == 1 else attention_mask
            prompt_embeds, prompt_embeds_mask = self.embed_token_ids(prompt_ids, attention_mask)
        return _cut_and_copy(prompt_embeds, prompt_embeds_mask, num_images_per_prompt, max_sequence_length)

    def encode_request_prompts(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        images_per_prompt: int,
        max_sequence_length: int,
        *,
        one_request: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if one_request:  # prepare_encode: the request's own list as a 1-D tensor, four keywords
            (length,) = mask.sum(dim=1).tolist()
            return self.encode_prompt(
                prompt_ids=ids[0, :length],
                attention_mask=None,  # the rollout's requests carry no prompt_mask
                num_images_per_prompt=images_per_prompt,
                max_sequence_length=max_sequence_length,
            )
        return self.encode_prompt(
            prompt_ids=ids,
            attention_mask=mask,
            prompt_embeds=None,
            prompt_embeds_mask=None,
            num_images_per_prompt=images_per_prompt,
            max_sequence_length=max_sequence_length,
        )

    def collate_token_ids(self, prompts: list[Any], kind: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        collated = super().collate_token_ids(prompts, kind)
        if collated is None:
            return None
        ids, mask = collated
        return ids.masked_fill(~mask, 0), mask  # verl-omni pads ids with 0, whatever the tokenizer's pad id


class ListIdsQwenImagePipeline(VerlOmniQwenImagePipeline):
    """The same ``encode_prompt`` signature, with the ids kept as Python lists (one per request) and no mask."""

    def encode_prompt(  # type: ignore[override]
        self,
        prompt_ids: list[list[int]] | torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        num_images_per_prompt: int = 1,
        prompt_embeds: torch.Tensor | None = None,
        prompt_embeds_mask: torch.Tensor | None = None,
        max_sequence_length: int = 1024,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(prompt_ids, list) and prompt_embeds is None:
            rows = [prompt_ids] if prompt_ids and isinstance(prompt_ids[0], int) else prompt_ids
            longest = max(len(row) for row in rows)
            prompt_ids = torch.zeros((len(rows), longest), dtype=torch.int64, device=self.device)
            attention_mask = torch.zeros((len(rows), longest), dtype=torch.bool, device=self.device)
            for index, row in enumerate(rows):
                prompt_ids[index, : len(row)] = torch.tensor(row, dtype=torch.int64)
                attention_mask[index, : len(row)] = True
        return super().encode_prompt(
            prompt_ids, attention_mask, num_images_per_prompt, prompt_embeds, prompt_embeds_mask, max_sequence_length
        )

    def encode_request_prompts(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        images_per_prompt: int,
        max_sequence_length: int,
        *,
        one_request: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [row[:length].tolist() for row, length in zip(ids, mask.sum(dim=1).tolist(), strict=True)]
        return self.encode_prompt(
            prompt_ids=rows,
            attention_mask=None,
            prompt_embeds=None,
            prompt_embeds_mask=None,
            num_images_per_prompt=images_per_prompt,
            max_sequence_length=max_sequence_length,
        )


class TeamTokenIdPipeline(TokenIdQwenImagePipeline):
    """An RL team's own token-ID adapter: other parameter names and an extra argument, registered nowhere."""

    supports_request_batch: ClassVar[bool] = True

    def encode_prompt(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        input_mask: torch.Tensor | None = None,
        images_per_prompt: int = 1,
        max_tokens: int = 1024,
        output_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(embeds [B*n, S, D], mask [B*n, S])`` for int64 ids ``[B, L]`` and a bool mask."""
        mask = torch.ones_like(input_ids, dtype=torch.bool) if input_mask is None else input_mask
        embeds, embeds_mask = self.embed_token_ids(input_ids, mask)
        embeds, embeds_mask = _cut_and_copy(embeds, embeds_mask, images_per_prompt, max_tokens)
        return (embeds if output_dtype is None else embeds.to(output_dtype)), embeds_mask

    def encode_request_prompts(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        images_per_prompt: int,
        max_sequence_length: int,
        *,
        one_request: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encode_prompt(
            input_ids=ids, input_mask=mask, images_per_prompt=images_per_prompt, max_tokens=max_sequence_length
        )


def _cut_and_copy(
    embeds: torch.Tensor, mask: torch.Tensor, copies: int, max_sequence_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    embeds, mask = embeds[:, :max_sequence_length], mask[:, :max_sequence_length]
    if copies > 1:
        embeds, mask = embeds.repeat_interleave(copies, dim=0), mask.repeat_interleave(copies, dim=0)
    return embeds, mask
