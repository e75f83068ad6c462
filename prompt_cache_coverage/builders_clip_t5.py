"""CLIP / T5 text stacks (FLUX.1, FLUX.1-Kontext, SD3, SDXL, HiDream-I1, Stable Audio) and LTX-2's Gemma 3.

The encoders and tokenizers are the tiny ones of :mod:`vllm_omni_prompt_cache.tiny.text_stacks`
(real transformers classes, seeded random weights, tokenizers built locally), shared with the tiny
SD3.5 and LTX-2.3 checkpoints:

* CLIP: towers "L" and "G", each as ``CLIPTextModel`` or ``CLIPTextModelWithProjection`` as the
  pipeline loads it; the G tokenizer pads with ``!`` as SDXL's and SD3's second tokenizers do.
* T5: SD3, HiDream, Kontext and Stable Audio load it as transformers' ``T5EncoderModel``; FLUX.1
  builds vLLM-Omni's own ``T5EncoderModel`` (vLLM parallel layers, in a one-process gloo TP group,
  built here) and loads the same weights into it through its ``load_weights``.
* HiDream's fourth encoder: the Llama, padded with its EOS as the stock ``__init__`` sets.
* LTX-2: the Gemma 3 with its 128-position byte-fallback tokenizer.

Each pipeline object is made with ``Kind.__new__(Kind)`` + ``torch.nn.Module.__init__`` and given
the attributes its stock ``__init__`` sets that its ``encode_prompt`` reads; the encode callables
pass the keywords each ``forward`` passes, with the defaults a request without sampling overrides
gets (HiDream's guidance 5.0 and Stable Audio's 7.0 turn classifier-free guidance on; LTX-2's
recipe decides it, and its negative prompt).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from prompt_cache_coverage.harness import Case, NotBuilt, finish_vllm_loading, one_rank_process_group, seeded
from vllm_omni_prompt_cache.tiny.text_stacks import (
    CLIP_POSITIONS,
    DTYPE,
    PROMPTS,
    clip_encoder,
    clip_tokenizer,
    gemma3_encoder,
    gemma_tokenizer,
    llama_encoder,
    llama_tokenizer,
    t5_config,
    t5_encoder,
    t5_tokenizer,
)

CPU = torch.device("cpu")
STABLE_AUDIO_MAX_LENGTH = 128  # Stable Audio Open pads every prompt to its tokenizer's model_max_length


def _bare(kind: type) -> Any:
    """A pipeline object of ``kind`` with no attributes but torch.nn.Module's."""
    pipeline = kind.__new__(kind)
    torch.nn.Module.__init__(pipeline)
    return pipeline


# --- encoders vLLM-Omni builds itself ---------------------------------------------------------


@functools.cache
def _vllm_omni_t5() -> Any:
    """vLLM-Omni's ``T5EncoderModel`` (FLUX.1's ``text_encoder_2``) holding the tiny T5's weights.

    Built as ``FluxPipeline.__init__`` builds it (from the config, prefix ``text_encoder_2``), then
    loaded through its own ``load_weights`` and post-processed as vLLM's loader does. Its GELU is
    ``gelu_pytorch_tanh``: vLLM's ``gelu_new`` takes a compiled op that this CPU build lacks at
    construction; both are the tanh approximation.
    """
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm_omni.diffusion.models.t5_encoder import T5EncoderModel

    one_rank_process_group()  # vLLM's parallel layers need a TP group
    config = t5_config()
    config.dense_act_fn = "gelu_pytorch_tanh"
    with set_current_vllm_config(VllmConfig()):
        encoder = T5EncoderModel(config, prefix="text_encoder_2")
        encoder.load_weights((f"text_encoder_2.{name}", weight) for name, weight in t5_encoder().state_dict().items())
        finish_vllm_loading(encoder)
    return encoder.to(DTYPE).eval()


def _od_config() -> Any:
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    return OmniDiffusionConfig.from_kwargs(dtype=DTYPE)


# --- FLUX.1 -----------------------------------------------------------------------------------


def _flux(name: str = "FluxPipeline") -> Any:
    """FLUX.1 pipeline class ``name`` (``FluxPipeline`` or its DMD2 subclass) with CLIP-L and vLLM-Omni's T5."""
    from vllm_omni.diffusion.models.flux import pipeline_flux

    pipeline = _bare(getattr(pipeline_flux, name))
    pipeline.device = CPU
    pipeline.tokenizer, pipeline.text_encoder = clip_tokenizer(), clip_encoder("L", projection=False)
    pipeline.tokenizer_2, pipeline.text_encoder_2 = t5_tokenizer(), _vllm_omni_t5()
    pipeline.tokenizer_max_length = pipeline.tokenizer.model_max_length
    return pipeline


def _flux_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As FluxPipeline.forward calls it: no prompt_2, no precomputed embeddings, 512 T5 positions."""
    return pipeline.encode_prompt(
        prompt=list(prompts),
        prompt_2=None,
        prompt_embeds=None,
        pooled_prompt_embeds=None,
        num_images_per_prompt=1,
        max_sequence_length=512,
    )


def _flux_kontext() -> Any:
    from vllm_omni.diffusion.models.flux.pipeline_flux_kontext import FluxKontextPipeline

    pipeline = _bare(FluxKontextPipeline)
    pipeline._execution_device = CPU
    pipeline.tokenizer, pipeline.text_encoder = clip_tokenizer(), clip_encoder("L", projection=False)
    pipeline.tokenizer_2, pipeline.text_encoder_2 = t5_tokenizer(), t5_encoder()
    pipeline.tokenizer_max_length = pipeline.tokenizer.model_max_length
    return pipeline


def _flux_kontext_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As FluxKontextPipeline.forward calls it (one prompt, a str); a batch is passed as a list."""
    return pipeline.encode_prompt(
        prompt=prompts[0] if len(prompts) == 1 else list(prompts),
        prompt_2=None,
        device=pipeline._execution_device,
        num_images_per_prompt=1,
        prompt_embeds=None,
        pooled_prompt_embeds=None,
        max_sequence_length=512,
    )


# --- Stable Diffusion 3 / XL ------------------------------------------------------------------


def _sd3() -> Any:
    from vllm_omni.diffusion.models.sd3.pipeline_sd3 import StableDiffusion3Pipeline

    pipeline = _bare(StableDiffusion3Pipeline)
    pipeline.od_config = _od_config()
    pipeline.device = CPU
    pipeline.tokenizer, pipeline.text_encoder = clip_tokenizer(), clip_encoder("L", projection=True)
    pipeline.tokenizer_2, pipeline.text_encoder_2 = clip_tokenizer("!"), clip_encoder("G", projection=True)
    pipeline.tokenizer_3, pipeline.text_encoder_3 = t5_tokenizer(), t5_encoder()
    pipeline.tokenizer_max_length = pipeline.tokenizer.model_max_length
    return pipeline


def _sd3_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As StableDiffusion3Pipeline.forward calls it: prompt_2 and prompt_3 empty (so the prompt), 256 T5."""
    return pipeline.encode_prompt(
        prompt=list(prompts),
        prompt_2="",
        prompt_3="",
        prompt_embeds=None,
        pooled_prompt_embeds=None,
        max_sequence_length=256,
    )


def _sdxl() -> Any:
    from vllm_omni.diffusion.models.sdxl.pipeline_sdxl import StableDiffusionXLPipeline

    pipeline = _bare(StableDiffusionXLPipeline)
    pipeline.od_config = _od_config()
    pipeline.device = CPU
    pipeline.tokenizer, pipeline.text_encoder = clip_tokenizer(), clip_encoder("L", projection=False)
    pipeline.tokenizer_2, pipeline.text_encoder_2 = clip_tokenizer("!"), clip_encoder("G", projection=True)
    pipeline.tokenizer_max_length = CLIP_POSITIONS
    return pipeline


def _sdxl_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As StableDiffusionXLPipeline.forward calls it."""
    return pipeline.encode_prompt(prompt=list(prompts), num_images_per_prompt=1)


# --- HiDream-I1 -------------------------------------------------------------------------------


def _hidream() -> Any:
    from vllm_omni.diffusion.models.hidream_image.pipeline_hidream_image import HiDreamImagePipeline

    pipeline = _bare(HiDreamImagePipeline)
    pipeline.device = CPU
    pipeline.tokenizer, pipeline.text_encoder = clip_tokenizer(), clip_encoder("L", projection=True)
    pipeline.tokenizer_2, pipeline.text_encoder_2 = clip_tokenizer(), clip_encoder("G", projection=True)
    pipeline.tokenizer_3, pipeline.text_encoder_3 = t5_tokenizer(), t5_encoder()
    pipeline.tokenizer_4, pipeline.text_encoder_4 = llama_tokenizer(), llama_encoder()
    pipeline.tokenizer_4.pad_token = pipeline.tokenizer_4.eos_token
    return pipeline


def _hidream_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As HiDreamImagePipeline.forward calls it: guidance 5.0 (CFG on), no negative prompt, 128 positions."""
    return pipeline.encode_prompt(
        prompt=list(prompts),
        prompt_2=None,
        prompt_3=None,
        prompt_4=None,
        negative_prompt=None,
        negative_prompt_2=None,
        negative_prompt_3=None,
        negative_prompt_4=None,
        do_classifier_free_guidance=True,
        prompt_embeds_t5=None,
        prompt_embeds_llama3=None,
        negative_prompt_embeds_t5=None,
        negative_prompt_embeds_llama3=None,
        pooled_prompt_embeds=None,
        negative_pooled_prompt_embeds=None,
        num_images_per_prompt=1,
        max_sequence_length=128,
        lora_scale=None,
    )


# --- Stable Audio Open ------------------------------------------------------------------------


@functools.cache
def _stable_audio_projection() -> Any:
    """StableAudioProjectionModel; text_encoder_dim == conditioning_dim makes its text projection Identity."""
    from diffusers.pipelines.stable_audio.modeling_stable_audio import StableAudioProjectionModel

    width = t5_config().d_model
    seeded(6)
    return StableAudioProjectionModel(text_encoder_dim=width, conditioning_dim=width, min_value=0, max_value=512)


def _stable_audio() -> Any:
    from vllm_omni.diffusion.models.stable_audio.pipeline_stable_audio import StableAudioPipeline

    pipeline = _bare(StableAudioPipeline)
    pipeline.device = CPU
    pipeline.tokenizer, pipeline.text_encoder = t5_tokenizer(STABLE_AUDIO_MAX_LENGTH), t5_encoder()
    pipeline.projection_model = _stable_audio_projection()
    return pipeline


def _stable_audio_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As StableAudioPipeline.forward calls it: positional, guidance 7.0 (CFG on), no negative prompt."""
    return pipeline.encode_prompt(list(prompts), pipeline.device, True, None, None, None)


# --- LTX-2 ------------------------------------------------------------------------------------


def _ltx2(name: str) -> Any:
    """LTX-2 pipeline class ``name`` with its Gemma 3 text stack and the recipe of an LTX-2 (2.0) checkpoint."""
    from vllm_omni.diffusion.models import ltx2
    from vllm_omni.diffusion.models.ltx2.ltx2_guidance import LTXGuidancePlan
    from vllm_omni.diffusion.models.ltx2.ltx2_recipes import resolve_ltx_pipeline_recipe

    kind = getattr(ltx2, name)
    pipeline = _bare(kind)
    pipeline.device = CPU
    pipeline.tokenizer, pipeline.text_encoder = gemma_tokenizer(), gemma3_encoder()
    pipeline.tokenizer_max_length = pipeline.tokenizer.model_max_length
    pipeline.pipeline_recipe = resolve_ltx_pipeline_recipe(kind.pipeline_kind, "2")
    pipeline._guidance_plan = LTXGuidancePlan.build(pipeline.pipeline_recipe.request_guidance)
    return pipeline


def _ltx2_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As LTXTextConditioningMixin._prepare_prompt_context calls it, with the recipe's negative prompt per row."""
    return pipeline.encode_prompt(
        prompt=list(prompts),
        negative_prompt=[pipeline.pipeline_recipe.negative_prompt] * len(prompts),
        do_classifier_free_guidance=pipeline.do_classifier_free_guidance,
        num_videos_per_prompt=1,
        prompt_embeds=None,
        negative_prompt_embeds=None,
        prompt_attention_mask=None,
        negative_prompt_attention_mask=None,
        max_sequence_length=pipeline.tokenizer_max_length,
        device=pipeline.device,
    )


_LTX2_CLASSES = {
    "LTX2Pipeline": "one-stage recipe: CFG on, the default negative prompt",
    "LTX2TwoStagePipeline": "stage 1 guidance of the one-stage recipe: CFG on, the default negative prompt",
    "LTX2DistilledOneStagePipeline": "distilled recipe: positive only",
    "LTX2DistilledTwoStagePipeline": "distilled recipe: positive only",
    "LTX2DistilledPipeline": "an alias of LTX2DistilledTwoStagePipeline; distilled recipe: positive only",
    "LTX2T2VDMD2Pipeline": "DMD2 recipe: positive only",
    "LTX2I2VDMD2Pipeline": "DMD2 recipe: positive only (the image conditions latents, not the text)",
}

CASES: list[Case | NotBuilt] = [
    Case("FluxPipeline", _flux, _flux_call, PROMPTS, note="vLLM-Omni's T5EncoderModel in a one-rank gloo group"),
    Case(
        "FluxDMD2Pipeline",
        functools.partial(_flux, "FluxDMD2Pipeline"),
        _flux_call,
        PROMPTS,
        note="DMD2 strips the negative prompt and true CFG: positive only, the call of FluxPipeline's case",
    ),
    Case(
        "FluxKontextPipeline",
        _flux_kontext,
        _flux_kontext_call,
        PROMPTS,
        note="forward encodes one prompt (a str); the batched calls pass a list",
    ),
    Case("StableDiffusion3Pipeline", _sd3, _sd3_call, PROMPTS),
    Case("StableDiffusionXLPipeline", _sdxl, _sdxl_call, PROMPTS),
    Case("HiDreamImagePipeline", _hidream, _hidream_call, PROMPTS, note="CFG on: the empty negative prompt too"),
    Case("StableAudioPipeline", _stable_audio, _stable_audio_call, PROMPTS, note="CFG on, no negative prompt"),
    *(
        Case(name, functools.partial(_ltx2, name), _ltx2_call, PROMPTS, note=note)
        for name, note in _LTX2_CLASSES.items()
    ),
]
