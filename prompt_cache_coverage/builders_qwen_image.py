"""Qwen-Image's text stack, built from the tiny random-weight Qwen-Image model (``tiny/qwen_image.py``).

Only the text path is built: each pipeline object gets the attributes its stock ``__init__`` sets
for ``encode_prompt`` (tokenizer, text encoder, template, device), nothing of its transformer or
VAE. Prompts are texts, called with the keywords each forward passes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from prompt_cache_coverage.harness import Case, NotBuilt

PROMPTS = ("a red fox in the snow", "a lighthouse above a stormy sea")


@functools.cache
def _text_stack() -> tuple[Any, Any]:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image, load_tokenizer

    model_dir = ensure_tiny_qwen_image()
    encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir / "text_encoder", dtype=torch.float32)
    return load_tokenizer(model_dir), encoder.eval()


def _text_pipeline(kind: type) -> Any:
    from vllm_omni_prompt_cache.tiny.qwen_image import PROMPT_TEMPLATE, TEMPLATE_DROP_TOKENS

    pipeline = kind.__new__(kind)
    torch.nn.Module.__init__(pipeline)
    pipeline.tokenizer, pipeline.text_encoder = _text_stack()
    pipeline.device = torch.device("cpu")
    pipeline.prompt_template_encode = PROMPT_TEMPLATE
    pipeline.prompt_template_encode_start_idx = TEMPLATE_DROP_TOKENS
    pipeline.tokenizer_max_length = 1024
    return pipeline


def _qwen_image() -> Any:
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline

    return _text_pipeline(QwenImagePipeline)


def _qwen_image_layered() -> Any:
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_layered import QwenImageLayeredPipeline

    return _text_pipeline(QwenImageLayeredPipeline)


def _qwen_image_dmd2() -> Any:
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImageDMD2Pipeline

    return _text_pipeline(QwenImageDMD2Pipeline)


def _forward_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As QwenImagePipeline.forward calls it: keywords, no precomputed embeddings."""
    return pipeline.encode_prompt(
        prompt=list(prompts),
        prompt_embeds=None,
        prompt_embeds_mask=None,
        num_images_per_prompt=1,
        max_sequence_length=512,
    )


def _layered_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As QwenImageLayeredPipeline.forward calls it: the device passed by keyword too."""
    return pipeline.encode_prompt(
        prompt=list(prompts),
        prompt_embeds=None,
        prompt_embeds_mask=None,
        device=pipeline.device,
        num_images_per_prompt=1,
        max_sequence_length=512,
    )


CASES: list[Case | NotBuilt] = [
    Case("QwenImagePipeline", _qwen_image, _forward_call, PROMPTS),
    Case("QwenImageLayeredPipeline", _qwen_image_layered, _layered_call, PROMPTS),
    Case(
        "QwenImageDMD2Pipeline",
        _qwen_image_dmd2,
        _forward_call,
        PROMPTS,
        note="DMD2 strips the negative prompt and true CFG: positive only, the call of QwenImagePipeline's case",
    ),
    NotBuilt(
        "QwenImageEditPipeline",
        "its encode_prompt runs the Qwen2.5-VL processor on the condition image; the tiny model has no "
        "image processor config yet",
    ),
    NotBuilt("QwenImageEditPlusPipeline", "as QwenImageEditPipeline: condition images through the VL processor"),
]
