"""Which vLLM-Omni pipelines have their batched ``encode_prompt`` calls cached row by row.

Recognised without any declaration:

* vLLM-Omni's ``QwenImagePipeline`` text path (``prompt: str | list[str]``), and subclasses that
  keep its ``encode_prompt`` and ``_get_qwen_prompt_embeds``. Its embeddings hold each prompt's
  copies together; its mask tiles the batch (``repeat(1, n, 1)``), and the assembled output
  reproduces both orders exactly as the uncached call lays them out.
* Token-ID adapters: a ``QwenImagePipeline`` subclass whose ``encode_prompt`` takes exactly
  ``(prompt_ids, attention_mask, num_images_per_prompt, max_sequence_length)`` and returns
  ``(prompt_embeds [B*n, S, D], prompt_embeds_mask [B*n, S])`` right-padded with zeros to the
  longest attended row, the way verl-omni style adapters are written. Their copy order is not
  known, so a call with several rows and ``num_images_per_prompt > 1`` is keyed whole.

A pipeline class can declare its own layout (``prompt_embed_row_layout``, see
:class:`~vllm_omni_prompt_cache.rows.RowLayout`); a declaration wins. Anything else is keyed
whole: a layout is never guessed.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from vllm_omni_prompt_cache.rows import ROW_LAYOUT_ATTRIBUTE, RowLayout, RowOutput

QWEN_IMAGE_MODULE = "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image"

QWEN_IMAGE_TEXT = RowLayout(
    rows=("prompt",),
    copies="num_images_per_prompt",
    outputs=(RowOutput(pad_dim=1, copies="interleave"), RowOutput(pad_dim=1, copies="tile")),
    name="QwenImagePipeline text prompts",
)

TOKEN_ID_PARAMETERS = ("prompt_ids", "attention_mask", "num_images_per_prompt", "max_sequence_length")

TOKEN_IDS = RowLayout(
    rows=("prompt_ids", "attention_mask"),
    mask="attention_mask",
    copies="num_images_per_prompt",
    outputs=(RowOutput(pad_dim=1, copies=None), RowOutput(pad_dim=1, copies=None)),
    name="token-ID encode_prompt (prompt_ids, attention_mask)",
)


def row_layout_for(pipeline: Any) -> RowLayout | None:
    """Return the row layout of ``pipeline``'s ``encode_prompt``: declared, recognised, or None."""
    declared = getattr(type(pipeline), ROW_LAYOUT_ATTRIBUTE, None)
    if declared is not None:
        return declared
    module = sys.modules.get(QWEN_IMAGE_MODULE)  # a pipeline of that class means it is imported
    qwen_image = getattr(module, "QwenImagePipeline", None)
    if qwen_image is None or not isinstance(pipeline, qwen_image):
        return None
    kind = type(pipeline)
    if kind.encode_prompt is qwen_image.encode_prompt:
        # Rows are independent only if the embeddings come from the stock batched text encoder.
        return QWEN_IMAGE_TEXT if kind._get_qwen_prompt_embeds is qwen_image._get_qwen_prompt_embeds else None
    try:
        parameters = tuple(inspect.signature(kind.encode_prompt).parameters)[1:]  # without self
    except (TypeError, ValueError):
        return None
    return TOKEN_IDS if parameters == TOKEN_ID_PARAMETERS else None
