"""Which vLLM-Omni pipelines get row-level caching: recognised, declared, or keyed whole.

Instances are made without running ``__init__`` (which loads a model): recognition reads only the
class, exactly as it does on a loaded pipeline.
"""

from __future__ import annotations

import torch
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline

from vllm_omni_prompt_cache import RowLayout, RowOutput
from vllm_omni_prompt_cache.tiny.token_id_pipeline import TokenIdQwenImagePipeline
from vllm_omni_prompt_cache.vllm_omni.layouts import QWEN_IMAGE_TEXT, TOKEN_IDS, row_layout_for


def bare(cls: type) -> object:
    return object.__new__(cls)


def test_stock_qwen_image_text_path_is_recognised() -> None:
    assert row_layout_for(bare(QwenImagePipeline)) is QWEN_IMAGE_TEXT


def test_a_subclass_keeping_the_stock_encoder_path_is_recognised() -> None:
    class Distilled(QwenImagePipeline):
        pass

    assert row_layout_for(bare(Distilled)) is QWEN_IMAGE_TEXT


def test_a_subclass_with_its_own_embedding_code_is_keyed_whole() -> None:
    class Rewritten(QwenImagePipeline):
        def _get_qwen_prompt_embeds(self, *args, **kwargs):
            raise NotImplementedError

    assert row_layout_for(bare(Rewritten)) is None


def test_a_token_id_adapter_is_recognised_without_declaring_anything() -> None:
    assert row_layout_for(bare(TokenIdQwenImagePipeline)) is TOKEN_IDS


def test_a_token_adapter_with_another_signature_is_keyed_whole() -> None:
    class WithDevice(QwenImagePipeline):
        def encode_prompt(
            self, prompt_ids, attention_mask, num_images_per_prompt=1, max_sequence_length=1024, device=None
        ):
            raise NotImplementedError

    class Reordered(QwenImagePipeline):
        def encode_prompt(self, attention_mask, prompt_ids, num_images_per_prompt=1, max_sequence_length=1024):
            raise NotImplementedError

    assert row_layout_for(bare(WithDevice)) is None
    assert row_layout_for(bare(Reordered)) is None


def test_a_declaration_wins() -> None:
    declared = RowLayout(rows=("prompt_ids",), outputs=(RowOutput(),), name="mine")

    class Declared(TokenIdQwenImagePipeline):
        prompt_embed_row_layout = declared

    assert row_layout_for(bare(Declared)) is declared


def test_other_pipelines_are_keyed_whole() -> None:
    class NotQwen(torch.nn.Module):
        def encode_prompt(self, prompt_ids, attention_mask, num_images_per_prompt=1, max_sequence_length=1024):
            raise NotImplementedError

    assert row_layout_for(NotQwen()) is None
