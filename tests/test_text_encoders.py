"""Which child modules are text encoders: decided by what they are, the same answer for the encoder calls served, the
directory tier's fingerprint and the encoder placed on a miss; attribute names play no part.

Real modules throughout: tiny transformers encoders, the tiny checkpoints' own components (DiTs,
VAEs, connectors, vocoders), a diffusers Qwen-Image DiT that holds an ``nn.Embedding``, and a CLIP
vision tower, whose position embedding is an ``nn.Embedding`` too.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_omni_prompt_cache.calls.installation import INSTALLATION_ATTRIBUTE
from vllm_omni_prompt_cache.calls.wrapper import PLACEMENT_ATTRIBUTE, install_prompt_embed_cache
from vllm_omni_prompt_cache.encoders.fingerprint import code_and_configuration, pipeline_fingerprint
from vllm_omni_prompt_cache.encoders.text_encoders import text_encoders
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings, resolve_settings
from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns
from vllm_omni_prompt_cache.tiny.text_encoder import build_qwen2_encoder
from vllm_omni_prompt_cache.tiny.text_stacks import t5_encoder

IDS = torch.tensor([[5, 6, 7, 8]])


class ConditionedDiT(torch.nn.Module):
    """A DiT that keeps an ``nn.Embedding`` for a condition (as Qwen-Image's additional-t embedding): its
    input layer is a projection of latents, not a token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.proj_in = torch.nn.Linear(64, 64)
        self.condition = torch.nn.Embedding(2, 64)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj_in(hidden) + self.condition(torch.zeros(1, dtype=torch.long))


class PromptTowerPipeline(CountsEncoderRuns, torch.nn.Module):
    """A pipeline whose text encoder sits under a name no rule of names would pick."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.prompt_tower = build_qwen2_encoder(seed=seed)
        self.transformer = ConditionedDiT()
        self.count_encoder_calls(self.prompt_tower)  # real runs of the encoder's forward: a hit makes none

    @torch.inference_mode()
    def encode_prompt(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        return self.prompt_tower(input_ids=prompt_ids).last_hidden_state


def test_a_text_encoder_under_any_name_is_found_and_a_dit_holding_an_embedding_is_not() -> None:
    pipeline = PromptTowerPipeline()
    assert list(text_encoders(pipeline)) == ["prompt_tower"]
    install_prompt_embed_cache(pipeline)
    assert getattr(pipeline, INSTALLATION_ATTRIBUTE).encoders == ["prompt_tower"]  # whose calls are served


def test_the_fingerprint_covers_a_text_encoder_under_any_name(tmp_path) -> None:
    pipeline = PromptTowerPipeline()
    fixed = code_and_configuration(pipeline, pipeline.encode_prompt, "tiny")
    before = pipeline_fingerprint(pipeline, fixed)
    assert isinstance(before, dict) and list(before["encoders"]) == ["prompt_tower"]
    with torch.no_grad():
        pipeline.transformer.condition.weight.add_(1.0)  # the DiT's weights are not the encoder's
    assert pipeline_fingerprint(pipeline, fixed) == before
    with torch.no_grad():
        pipeline.prompt_tower.embed_tokens.weight.mul_(2.0)  # as a weight sync would
    assert pipeline_fingerprint(pipeline, fixed)["encoders"] != before["encoders"]

    # Through the directory tier: the new weights read none of the old weights' files.
    writer = PromptTowerPipeline()
    install_prompt_embed_cache(writer, settings=PromptEmbedCacheSettings(directory=tmp_path))
    writer.encode_prompt(IDS)
    reader = PromptTowerPipeline()
    with torch.no_grad():
        reader.prompt_tower.embed_tokens.weight.mul_(2.0)
    cache = install_prompt_embed_cache(reader, settings=PromptEmbedCacheSettings(directory=tmp_path))
    reader.encode_prompt(IDS)
    assert reader.encoder_runs == 1 and cache.snapshot().dir_hits == 0
    same = PromptTowerPipeline()
    cache = install_prompt_embed_cache(same, settings=PromptEmbedCacheSettings(directory=tmp_path))
    same.encode_prompt(IDS)
    assert same.encoder_runs == 0 and cache.snapshot().dir_hits == 1  # the same weights read the file


def test_a_text_encoder_under_any_name_is_placed_on_a_miss_and_the_dit_is_not() -> None:
    from vllm_omni_prompt_cache.vllm_omni import runner

    pipeline = PromptTowerPipeline()
    given = resolve_settings(
        {"enable_prompt_embed_cache": True, "prompt_embed_cache_encoder_on_miss": True}, environ={}
    )
    runner.install_for_stage(pipeline, given, "tiny")
    placement = getattr(pipeline, PLACEMENT_ATTRIBUTE)
    assert list(placement.encoders) == ["prompt_tower"]
    seen_during_forward: list[int] = []
    pipeline.prompt_tower.register_forward_hook(lambda *_: seen_during_forward.append(placement.device_bytes()))
    pipeline.encode_prompt(IDS)
    assert seen_during_forward == [placement.host_bytes()] and placement.host_bytes() > 0  # placed for the miss
    assert placement.device_bytes() == 0  # and back in host memory after it
    with torch.inference_mode():
        pipeline.transformer(torch.zeros(1, 64))
    assert placement.stray_placements == 0  # the DiT's forward placed nothing


class VocabParallelLike(torch.nn.Module):
    """The shape of vLLM's ``VocabParallelEmbedding`` (not an ``nn.Embedding``): vLLM-Omni's own T5-Gemma and
    Mistral encoders begin with one."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = torch.nn.Parameter(torch.randn(num_embeddings, embedding_dim))

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(input_, self.weight)


def test_an_encoder_beginning_with_a_vocabulary_parallel_embedding_is_a_text_encoder() -> None:
    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = torch.nn.Sequential(VocabParallelLike(32, 8), torch.nn.Linear(8, 8))
            self.projection = torch.nn.Sequential(torch.nn.Linear(8, 8), VocabParallelLike(4, 8))

    assert list(text_encoders(Holder())) == ["encoder"]


def test_an_image_encoder_and_a_dit_holding_embeddings_are_not_text_encoders() -> None:
    from diffusers import QwenImageTransformer2DModel
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    class Pipeline(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.prompt_encoder = t5_encoder()
            self.image_encoder = CLIPVisionModelWithProjection(
                CLIPVisionConfig(
                    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28
                )
            )
            self.transformer = QwenImageTransformer2DModel(
                num_layers=1,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=64,
                axes_dims_rope=(4, 6, 6),
                use_additional_t_cond=True,
            )

    pipeline = Pipeline()
    for name in ("image_encoder", "transformer"):  # each holds an nn.Embedding
        assert any(isinstance(part, torch.nn.Embedding) for part in getattr(pipeline, name).modules())
    assert list(text_encoders(pipeline)) == ["prompt_encoder"]


def _tiny_checkpoints() -> list[Path]:
    from vllm_omni_prompt_cache.tiny.ltx2 import ensure_tiny_ltx2
    from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image
    from vllm_omni_prompt_cache.tiny.sd3 import ensure_tiny_sd3
    from vllm_omni_prompt_cache.tiny.wan22 import ensure_tiny_wan22

    return [ensure() for ensure in (ensure_tiny_qwen_image, ensure_tiny_wan22, ensure_tiny_sd3, ensure_tiny_ltx2)]


#: Where the classes a tiny checkpoint's model_index.json names live (its "ltx2" ones are diffusers').
_LIBRARIES = {
    "diffusers": ("diffusers",),
    "transformers": ("transformers",),
    "ltx2": ("diffusers.pipelines.ltx2", "diffusers.pipelines.ltx2.vocoder"),
}


def _components(model_dir: Path) -> dict[str, Any]:
    """Return every module of the checkpoint, loaded with the class its model_index.json names."""
    loaded = {}
    for name, entry in json.loads((model_dir / "model_index.json").read_text()).items():
        if not isinstance(entry, list) or entry[0] is None or name.startswith(("tokenizer", "scheduler")):
            continue
        library, class_name = entry
        kind = next(
            getattr(module, class_name)
            for module in map(importlib.import_module, _LIBRARIES[library])
            if hasattr(module, class_name)
        )
        loaded[name] = kind.from_pretrained(model_dir / name)
    return loaded


@pytest.mark.parametrize("index", range(4), ids=["qwen_image", "wan22", "sd3", "ltx2"])
def test_in_every_tiny_pipeline_exactly_the_text_encoders_are_found(index: int) -> None:
    """The DiTs, VAEs, LTX-2's connectors and vocoder are not text encoders; Gemma 3's and Qwen2.5-VL's
    vision towers come first in their module order, yet their input is token ids."""
    components = _components(_tiny_checkpoints()[index])
    pipeline = torch.nn.Module()
    for name, module in components.items():
        pipeline.add_module(name, module)
    expected = [name for name in components if name.startswith("text_encoder")]  # the checkpoints' names
    assert expected and sorted(text_encoders(pipeline)) == sorted(expected)


def test_the_encoders_a_pipeline_declares_count_for_the_fingerprint_and_clearing_not_for_offload() -> None:
    """vLLM-Omni's ``_encoder_modules`` may name an image encoder a declared method runs: its weights shape what
    the cache keeps (fingerprint, clearing on a weight load), though it is no text encoder (not placed)."""
    from vllm_omni_prompt_cache.encoders.text_encoders import embedding_sources, text_encoders
    from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder

    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    pipeline.image_encoder = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 2))
    pipeline._encoder_modules = ("text_encoder", "image_encoder", "missing")
    assert list(text_encoders(pipeline)) == ["text_encoder"]
    assert sorted(embedding_sources(pipeline)) == ["image_encoder", "text_encoder"]


class _LabelEmbedding(torch.nn.Module):
    """diffusers' ``LabelEmbedding`` (``embeddings.py``): a class-label table alone in its module."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding_table = torch.nn.Embedding(1001, 16)


class _ClassConditionedDiT(torch.nn.Module):
    """A DiT's layout (diffusers' ``DiTTransformer2DModel``): patches in, a class-label table in its condition."""

    def __init__(self) -> None:
        super().__init__()
        self.pos_embed = torch.nn.Conv2d(4, 16, 2)
        self.class_embedder = _LabelEmbedding()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))


class _VectorQuantizer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(8192, 16)


class _VQModel(torch.nn.Module):
    """A VQ autoencoder's layout (diffusers' ``VQModel``, Kandinsky's ``movq``): a codebook between two convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Conv2d(3, 16, 2)
        self.quantize = _VectorQuantizer()
        self.decoder = torch.nn.Conv2d(16, 3, 2)


class _TextModel(torch.nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(rows, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))


class _VisionFirst(torch.nn.Module):
    """A vision-language encoder's layout (vLLM-Omni's ``MiniMaxH3Qwen3VLEncoder``): a vision tower registered first,
    with a position table, then a language model whose table leads its layers; no ``get_input_embeddings``."""

    def __init__(self, rows: int = 1024) -> None:
        super().__init__()
        self.vision = torch.nn.Sequential(torch.nn.Conv3d(3, 16, 2), torch.nn.Embedding(16, 16))
        self.text_model = _TextModel(rows)


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (_ClassConditionedDiT, False),
        (_VQModel, False),
        (lambda: _VisionFirst(rows=8), False),  # a condition type's few rows, not a vocabulary
        (_VisionFirst, True),
    ],
    ids=["DiT class-label table", "VQ codebook", "small table", "language model behind a vision tower"],
)
def test_a_table_deeper_inside_makes_a_text_encoder_only_where_text_enters(module: Any, expected: bool) -> None:
    from vllm_omni_prompt_cache.encoders.text_encoders import is_text_encoder

    assert is_text_encoder(module()) is expected
