"""Which vLLM-Omni pipelines get row-level caching, and that vLLM-Omni's own encode_prompt is laid out right.

Instances are made without running ``__init__`` (which loads a model): recognition reads only the
class, exactly as it does on a loaded pipeline.
"""

from __future__ import annotations

import pytest
import torch
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline

from vllm_omni_prompt_cache import RowLayout, RowOutput, install_prompt_embed_cache, uninstall_prompt_embed_cache
from vllm_omni_prompt_cache.calls.layouts import (
    QWEN_IMAGE_EDIT_TOKEN_IDS,
    QWEN_IMAGE_TEXT,
    QWEN_IMAGE_TOKEN_IDS,
    TOKEN_IDS,
    find_row_layout,
    resolve_declared_layouts,
    row_layout_for,
)
from vllm_omni_prompt_cache.rows.layout_proofs import DECLARED_BY_CLASS
from vllm_omni_prompt_cache.settings.schema import PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.tiny.qwen_image import (
    PROMPT_TEMPLATE,
    TEMPLATE_DROP_TOKENS,
    ensure_tiny_qwen_image,
    load_tokenizer,
)
from vllm_omni_prompt_cache.tiny.token_id_pipeline import TokenIdQwenImagePipeline


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
    class Undeclared(QwenImagePipeline):
        def encode_prompt(self, prompt_ids, attention_mask, num_images_per_prompt=1, max_sequence_length=1024):
            raise NotImplementedError

    assert row_layout_for(bare(Undeclared)) is TOKEN_IDS
    assert find_row_layout(bare(Undeclared), {}) == (TOKEN_IDS, "proven layout 'token-ids'")
    assert find_row_layout(bare(TokenIdQwenImagePipeline), {}) == (TOKEN_IDS, DECLARED_BY_CLASS)


def test_verl_omni_adapters_signatures_are_recognised() -> None:
    from vllm_omni_prompt_cache.tiny.verl_omni_adapters import (
        ListIdsQwenImagePipeline,
        TeamTokenIdPipeline,
        VerlOmniQwenImagePipeline,
    )

    for kind in (VerlOmniQwenImagePipeline, ListIdsQwenImagePipeline):
        assert find_row_layout(bare(kind), {}) == (QWEN_IMAGE_TOKEN_IDS, "proven layout 'qwen-image-token-ids'")
    assert find_row_layout(bare(TeamTokenIdPipeline), {}) == (None, "no layout known")

    class Edit(QwenImagePipeline):
        def encode_prompt(
            self,
            prompt_ids,
            attention_mask=None,
            num_images_per_prompt=1,
            prompt_embeds=None,
            prompt_embeds_mask=None,
            max_sequence_length=1024,
            condition_images=None,
        ):
            raise NotImplementedError

    assert find_row_layout(bare(Edit), {})[0] is QWEN_IMAGE_EDIT_TOKEN_IDS


def test_a_user_declaration_wins_over_the_class_and_applies_to_subclasses() -> None:
    from vllm_omni_prompt_cache.tiny.verl_omni_adapters import TeamTokenIdPipeline

    path = f"{TokenIdQwenImagePipeline.__module__}.TokenIdQwenImagePipeline"
    declared = resolve_declared_layouts({path: "qwen-image-token-ids"}, "a test")
    layout, source = find_row_layout(bare(TeamTokenIdPipeline), declared)
    assert layout is QWEN_IMAGE_TOKEN_IDS and path in source and "prompt_embed_cache_row_layouts" in source


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("no-such-layout", "no proven layout is named 'no-such-layout'; expected one of qwen-image-text"),
        ("vllm_omni_prompt_cache.nowhere:X", "cannot be imported"),
        ("vllm_omni_prompt_cache.calls.layouts:PROVEN_LAYOUTS", "is a dict, expected a RowLayout"),
    ],
)
def test_a_declaration_naming_no_layout_is_refused_with_the_setting_and_source(reference, message) -> None:
    with pytest.raises(PromptEmbedCacheConfigError) as raised:
        resolve_declared_layouts({"pkg.mod.Adapter": reference}, "environment variable X")
    assert (
        f"invalid prompt_embed_cache_row_layouts entry pkg.mod.Adapter={reference} from environment variable X"
        in str(raised.value)
    )
    assert message in str(raised.value)


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


@pytest.fixture(scope="module")
def stock_text_pipelines() -> tuple[QwenImagePipeline, QwenImagePipeline]:
    """Two stock QwenImagePipelines sharing the tiny model's real tokenizer and text encoder.

    Only the text path is built (``__init__`` would load the transformer and VAE too); the
    attributes set are the ones stock ``__init__`` sets for ``encode_prompt``.
    """
    from transformers import Qwen2_5_VLForConditionalGeneration

    model_dir = ensure_tiny_qwen_image()
    tokenizer = load_tokenizer(model_dir)
    encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir / "text_encoder", torch_dtype=torch.float32
    ).eval()

    def build() -> QwenImagePipeline:
        pipeline = QwenImagePipeline.__new__(QwenImagePipeline)
        torch.nn.Module.__init__(pipeline)
        pipeline.tokenizer, pipeline.text_encoder, pipeline.device = tokenizer, encoder, torch.device("cpu")
        pipeline.prompt_template_encode = PROMPT_TEMPLATE
        pipeline.prompt_template_encode_start_idx = TEMPLATE_DROP_TOKENS
        pipeline.tokenizer_max_length = 1024
        return pipeline

    return build(), build()


@pytest.mark.parametrize(("copies", "max_sequence_length"), [(1, 1024), (2, 1024), (3, 1024), (2, 10)])
def test_stock_encode_prompt_output_is_laid_out_as_uncached(stock_text_pipelines, copies, max_sequence_length) -> None:
    """vLLM-Omni's own encode_prompt, batched: embeddings interleave copies, the mask tiles them.

    The public install finds the proven layout itself, checks it on the first call (served
    uncached), and serves the second, another batch of the same rows, from the rows alone.
    """
    cached, uncached = stock_text_pipelines
    cache = install_prompt_embed_cache(cached, max_size=16)
    try:
        first = ["a red fox in the snow", "sky", "a red fox in the snow", "a lighthouse above a stormy sea"]
        cached.encode_prompt(first, num_images_per_prompt=copies, max_sequence_length=max_sequence_length)
        stats = cache.snapshot()
        assert (stats.layout_checks, stats.layout_mismatches, stats.rows_encoded) == (1, 0, 3)
        prompts = ["sky", "a lighthouse above a stormy sea", "a red fox in the snow"]
        embeds, mask = cached.encode_prompt(
            prompts, num_images_per_prompt=copies, max_sequence_length=max_sequence_length
        )
        assert cache.snapshot().row_hits == stats.row_hits + 3  # no encode: three cached rows
        want_embeds, want_mask = uncached.encode_prompt(
            prompts, num_images_per_prompt=copies, max_sequence_length=max_sequence_length
        )
        assert (embeds.shape, embeds.dtype, mask.dtype) == (want_embeds.shape, want_embeds.dtype, want_mask.dtype)
        assert torch.equal(mask, want_mask)  # the tiled mask order, exactly
        if max_sequence_length < 1024:
            assert embeds.shape[1] == max_sequence_length  # the longest rows were truncated
        # Rows encoded alone vs one batched encode: at most the encoder's batch-invariance gap.
        assert (embeds - want_embeds).abs().max().item() < 1e-4
        assert cache.snapshot().rows_encoded == 3
    finally:
        uninstall_prompt_embed_cache(cached)


def test_a_one_prompt_text_call_is_its_own_row(stock_text_pipelines) -> None:
    """A call with one prompt and one copy is keyed as its row. The first of its form is checked (the
    layout is proven for vLLM-Omni, not declared by the class); later ones are served from the row
    with no split, and a batch holding that prompt reads the same row."""
    cached, uncached = stock_text_pipelines
    cache = install_prompt_embed_cache(cached, max_size=16)
    try:
        embeds, mask = cached.encode_prompt("a red fox in the snow")
        want_embeds, want_mask = uncached.encode_prompt("a red fox in the snow")
        assert torch.equal(embeds, want_embeds) and torch.equal(mask, want_mask)  # the check serves the uncached
        stats = cache.snapshot()
        assert (stats.misses, stats.row_misses, stats.rows_encoded, stats.layout_checks) == (1, 1, 1, 1)
        again, _ = cached.encode_prompt("a red fox in the snow")
        assert torch.equal(again, embeds) and cached.encode_prompt("a red fox in the snow")[0] is again  # the entry
        stats = cache.snapshot()
        assert (stats.hits, stats.row_hits, stats.layout_checks) == (2, 2, 1)
        cached.encode_prompt(["sky", "a red fox in the snow"])  # checked (first batch): encodes "sky" alone
        stats = cache.snapshot()
        assert (stats.hits, stats.row_hits, stats.rows_encoded, stats.layout_checks) == (2, 3, 2, 2)
    finally:
        uninstall_prompt_embed_cache(cached)
