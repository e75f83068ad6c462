"""Image pipelines whose text stacks are LLMs, each built tiny from a config with random weights.

Families and what each shares (nothing is downloaded; every tokenizer is trained here):

* Qwen3 (FLUX.2-klein, Z-Image, Ovis-Image, Anima): one ``Qwen3ForCausalLM``; Ovis and Anima use
  its inner ``Qwen3Model``. One byte-level BPE ``Qwen2Tokenizer`` with a Qwen-style chat template
  (``enable_thinking`` honoured) serves every Qwen family here.
* Qwen2.5-VL (LongCat-Image, LongCat-Image-Edit, OmniGen2): one ``Qwen2_5_VLForConditionalGeneration``
  with a one-block vision tower, and a ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor`` around the
  same tokenizer.
* Qwen3-VL (Boogu-Image and its Turbo, Krea 2): one ``Qwen3VLModel`` and a ``Qwen3VLProcessor``; Krea 2
  gets a copy without the vision tower, as its ``__init__`` deletes it.
* Mistral (FLUX.2, ERNIE-Image): one ``Mistral3Config``; FLUX.2 builds vLLM-Omni's own
  ``MistralEncoderModel`` (vLLM parallel layers, inside a one-process gloo TP group) behind a
  ``PixtralProcessor``, ERNIE-Image the transformers ``Mistral3Model``; both share one BPE tokenizer.
* T5: GLM-Image's glyph encoder, a ``T5EncoderModel`` over the byte-level ``ByT5Tokenizer``;
  Anima's second tokenizer, a unigram ``T5Tokenizer`` trained here.
* None (Ming-flash-omni image generation, Ming-Image): Z-Image subclasses whose ``encode_prompt`` hands
  back the conditioning their forward computed from another stage's hidden states.

Each pipeline object is made with ``Kind.__new__(Kind)`` + ``torch.nn.Module.__init__`` and given the
attributes its stock ``__init__`` (or ``load_weights``) sets that its ``encode_prompt`` reads. Layer
taps that name deep layers (FLUX.2's (10, 20, 30), Krea 2's twelve) are set the way the stock code
lets a checkpoint set them (the encoder config, ``model_index.json``), to layers the tiny encoder has.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import string
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from prompt_cache_coverage.harness import Case, NotBuilt, finish_vllm_loading, one_rank_process_group, seeded

PROMPTS = ("a red fox in the snow", "a lighthouse above a stormy sea")
#: GLM-Image encodes only the quoted text of a prompt (the glyphs to render).
GLYPH_PROMPTS = ('a shop sign that says "OPEN LATE"', 'a poster reading "SUMMER SALE" in red')
CPU = torch.device("cpu")
SEED = 0

QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
]
#: A Qwen-style chat template: string or typed-list contents, images as vision pads, and the empty
#: think block Qwen3 emits when ``enable_thinking`` is false.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
MISTRAL_SPECIAL_TOKENS = [
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
]
#: Mistral Small 3's layout: ``<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]``.
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '[INST]' + text + '[/INST]' -}}"
    "{%- else -%}{{- text + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)
# Text the tokenizers are trained on: the pipelines' own system prompts and templates are among
# what they tokenize, so merges cover them; every printable character avoids unknown tokens.
_TRAINING_TEXT = [
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of "
    "the objects and background:",
    "As an image captioning expert, generate a descriptive text prompt based on an image content, suitable for "
    "input to a text-to-image model.",
    "As an image editing expert, first analyze the content and attributes of the input image(s).",
    "You are a helpful assistant that generates high-quality images based on user instructions.",
    "You are an AI that reasons about image descriptions. You give structured responses focusing on object "
    "relationships, object attribution and actions without speculation.",
    "user assistant system",
    "a red fox sitting in a snowy forest at dawn, soft light, detailed fur",
    "a watercolor painting of a lighthouse on a cliff above a stormy sea",
    "a shop sign that says open late, a poster reading summer sale in red",
    " ".join(string.printable.strip()),
]


# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------


def _byte_level_bpe(vocab_size: int, special_tokens: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a byte-level BPE on the sample text; return its vocab and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(_TRAINING_TEXT, trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in model["merges"]]
    return model["vocab"], merges


@functools.cache
def _qwen_tokenizer() -> Any:
    """A ``Qwen2Tokenizer`` (Qwen's pre-tokenizer) over a locally trained BPE, with Qwen's special tokens."""
    from transformers import Qwen2Tokenizer

    vocab, merges = _byte_level_bpe(400, QWEN_SPECIAL_TOKENS)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    tokenizer.padding_side = "right"
    return tokenizer


def _blank(kind: type) -> Any:
    """A pipeline object of ``kind`` with no attributes but those ``nn.Module`` needs."""
    pipeline = kind.__new__(kind)
    torch.nn.Module.__init__(pipeline)
    return pipeline


# ---------------------------------------------------------------------------------------------
# Qwen3: FLUX.2-klein, Z-Image, Ovis-Image, Anima
# ---------------------------------------------------------------------------------------------

#: FLUX.2-klein taps three hidden states ((9, 18, 27) of 36 layers); the tiny encoder's config names
#: three of its own, which the stock ``__init__`` prefers to the default.
KLEIN_OUT_LAYERS = (0, 1, 2)


@functools.cache
def _qwen3() -> Any:
    """A two-layer ``Qwen3ForCausalLM`` (hidden 32) over the shared Qwen tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _qwen_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.text_encoder_out_layers = list(KLEIN_OUT_LAYERS)
    seeded(SEED)
    return Qwen3ForCausalLM(config).eval()


def _flux2_klein() -> Any:
    from vllm_omni.diffusion.models.flux2_klein.pipeline_flux2_klein import Flux2KleinPipeline

    pipeline = _blank(Flux2KleinPipeline)
    pipeline._execution_device = CPU
    pipeline.text_encoder = _qwen3()
    pipeline.tokenizer = _qwen_tokenizer()
    pipeline.tokenizer_max_length = 512
    pipeline.text_encoder_out_layers = pipeline.text_encoder.config.text_encoder_out_layers
    return pipeline


def _flux2_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As Flux2Pipeline.forward and Flux2KleinPipeline.forward call it (keywords, no embeddings)."""
    return pipeline.encode_prompt(
        prompt=list(prompts),
        prompt_embeds=None,
        device=pipeline._execution_device,
        num_images_per_prompt=1,
        max_sequence_length=512,
    )


def _z_image() -> Any:
    from vllm_omni.diffusion.models.z_image.pipeline_z_image import ZImagePipeline

    pipeline = _blank(ZImagePipeline)
    pipeline._execution_device = CPU
    pipeline.text_encoder = _qwen3()
    pipeline.tokenizer = _qwen_tokenizer()
    return pipeline


def _z_image_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As ZImagePipeline.forward calls it: CFG on (guidance > 0), no negative prompt given."""
    return pipeline.encode_prompt(
        prompt=list(prompts),
        negative_prompt=None,
        do_classifier_free_guidance=True,
        prompt_embeds=None,
        negative_prompt_embeds=None,
        device=pipeline._execution_device,
        max_sequence_length=512,
    )


def _ovis_image() -> Any:
    from vllm_omni.diffusion.models.ovis_image.pipeline_ovis_image import OvisImagePipeline

    pipeline = _blank(OvisImagePipeline)
    pipeline._execution_device = CPU
    pipeline.text_encoder = _qwen3().model  # Ovis-Image loads a bare Qwen3Model
    pipeline.tokenizer = _qwen_tokenizer()
    pipeline.system_prompt = (
        "Describe the image by detailing the color, quantity, text, shape, size, texture, spatial\n"
        "        relationships of the objects and background: "
    )
    pipeline.user_prompt_begin_id = 28
    pipeline.tokenizer_max_length = 256 + pipeline.user_prompt_begin_id
    return pipeline


def _ovis_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As OvisImagePipeline.forward calls it for the positive prompts."""
    return pipeline.encode_prompt(
        prompt=list(prompts), prompt_embeds=None, device=pipeline._execution_device, num_images_per_prompt=1
    )


@functools.cache
def _t5_tokenizer() -> Any:
    """The unigram ``T5Tokenizer`` this project trains for its tiny Wan2.2 (Anima tokenizes with one)."""
    from vllm_omni_prompt_cache.tiny.wan22 import TinyWan22Spec, _build_tokenizer

    return _build_tokenizer(TinyWan22Spec().vocab_size)


def _anima() -> Any:
    from vllm_omni.diffusion.models.anima.pipeline_anima import AnimaPipeline

    pipeline = _blank(AnimaPipeline)
    pipeline.device = CPU
    # Set by load_weights, not __init__: the text path's half of _load_outer_components.
    pipeline.text_encoder = _qwen3().model
    pipeline.tokenizer = _qwen_tokenizer()
    pipeline.t5_tokenizer = _t5_tokenizer()
    return pipeline


def _anima_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As AnimaPipeline.forward calls it: guidance 4 > 1 prepares the unconditional half.

    The dict it returns is handed on as its values in key order: ``compare_outputs`` has no dict
    case (``==`` on two dicts of tensors raises).
    """
    encoded = pipeline.encode_prompt(
        prompt=list(prompts),
        negative_prompt=None,
        prepare_unconditional_embeds=True,
        max_sequence_length=512,
        device=pipeline.device,
        dtype=pipeline.text_encoder.dtype,
    )
    return tuple(encoded.values())


# ---------------------------------------------------------------------------------------------
# Qwen2.5-VL: LongCat-Image, LongCat-Image-Edit, OmniGen2
# ---------------------------------------------------------------------------------------------

#: The VL image processor's pixel budget: a 56 x 56 condition image is a 4 x 4 patch grid, four
#: merged image tokens.
VL_PIXELS = {"min_pixels": 28 * 28, "max_pixels": 56 * 56}
EDIT_IMAGE_SIZE = 56


def _qwen_vl_token_ids() -> dict[str, int]:
    tokenizer = _qwen_tokenizer()
    names = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}
    names |= {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
    return {key: tokenizer.convert_tokens_to_ids(token) for key, token in names.items()}


@functools.cache
def _qwen2_5_vl() -> Any:
    """A two-layer Qwen2.5-VL (hidden 32, mrope) with a one-block vision tower (hidden 16)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = _qwen_tokenizer()
    mrope = [2, 1, 1]  # (t, h, w) halves of the rotary dimension: head 8 -> 4
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_scaling": {"type": "mrope", "mrope_section": mrope},
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope},
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": 32,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "fullatt_block_indexes": [0],
        "window_size": 112,
    }
    config = Qwen2_5_VLConfig(
        text_config=text_config, vision_config=vision_config, **text_config, **_qwen_vl_token_ids()
    )
    seeded(SEED)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


@functools.cache
def _qwen2_vl_processor() -> Any:
    """LongCat-Image's ``Qwen2VLProcessor``: the VL image processor (small pixel budget) and the tokenizer."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**VL_PIXELS),
        tokenizer=_qwen_tokenizer(),
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=QWEN_CHAT_TEMPLATE,
    )


def _longcat_text_stack(pipeline: Any) -> Any:
    pipeline.device = CPU
    pipeline.text_encoder = _qwen2_5_vl()
    pipeline.text_processor = _qwen2_vl_processor()
    pipeline.tokenizer = _qwen_tokenizer()
    pipeline.tokenizer_max_length = 512
    pipeline.prompt_template_encode_suffix = "<|im_end|>\n<|im_start|>assistant\n"
    return pipeline


def _longcat_image() -> Any:
    from vllm_omni.diffusion.models.longcat_image.pipeline_longcat_image import LongCatImagePipeline

    pipeline = _longcat_text_stack(_blank(LongCatImagePipeline))
    pipeline.prompt_template_encode_prefix = (
        "<|im_start|>system\n"
        "As an image captioning expert, generate a descriptive text prompt based on an image content,"
        " suitable for input to a text-to-image model.<|im_end|>\n"
        "<|im_start|>user\n"
    )
    return pipeline


def _longcat_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As LongCatImagePipeline.forward calls it (after its optional rewrite, which only changes the text)."""
    return pipeline.encode_prompt(prompt=list(prompts), prompt_embeds=None, num_images_per_prompt=1)


def _longcat_image_edit() -> Any:
    from vllm_omni.diffusion.models.longcat_image.pipeline_longcat_image_edit import LongCatImageEditPipeline

    pipeline = _longcat_text_stack(_blank(LongCatImageEditPipeline))
    pipeline.image_processor_vl = pipeline.text_processor.image_processor
    pipeline.image_token = "<|image_pad|>"
    pipeline.prompt_template_encode_prefix = (
        "<|im_start|>system\n"
        "As an image editing expert, first analyze the content and attributes of the input image(s). "
        "Then, based on the user's editing instructions, clearly and precisely determine how to modify "
        "the given image(s), "
        "ensuring that only the specified parts are altered and all other aspects remain consistent "
        "with the original(s)."
        "<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
    )
    return pipeline


@functools.cache
def _condition_image() -> Any:
    """A fixed RGB condition image (a gradient), the ``prompt_image`` the edit pre-process hands forward."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 255, EDIT_IMAGE_SIZE).astype(np.int64)
    rows, columns = np.meshgrid(ramp, ramp, indexing="ij")
    pixels = np.stack([(rows + columns) // 2, columns, rows], axis=-1)
    return Image.fromarray(pixels.astype(np.uint8), "RGB")


def _longcat_edit_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As LongCatImageEditPipeline.forward calls it: the instruction with the condition image."""
    return pipeline.encode_prompt(
        prompt=list(prompts), image=_condition_image(), prompt_embeds=None, num_images_per_prompt=1
    )


def _omnigen2() -> Any:
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor
    from vllm_omni.diffusion.models.omnigen2.pipeline_omnigen2 import OmniGen2Pipeline

    pipeline = _blank(OmniGen2Pipeline)
    pipeline.device = CPU
    pipeline.mllm = _qwen2_5_vl()
    pipeline.processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**VL_PIXELS),
        tokenizer=_qwen_tokenizer(),
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    pipeline.transformer = None  # read only when the mllm is None
    return pipeline


def _omnigen2_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As OmniGen2Pipeline.forward calls it: text guidance 4 > 1 (CFG on), its 1024-token limit."""
    return pipeline.encode_prompt(
        list(prompts),
        True,
        negative_prompt=None,
        num_images_per_prompt=1,
        device=pipeline.device,
        prompt_embeds=None,
        negative_prompt_embeds=None,
        prompt_attention_mask=None,
        negative_prompt_attention_mask=None,
        max_sequence_length=1024,
    )


# ---------------------------------------------------------------------------------------------
# Qwen3-VL: Boogu-Image, Krea 2
# ---------------------------------------------------------------------------------------------

#: Krea 2 stacks twelve hidden states ((2, 5, ..., 35) of 36 layers); ``model_index.json``'s
#: ``text_encoder_select_layers`` overrides them, as here to the tiny encoder's two layers.
KREA2_SELECT_LAYERS = (1, 2)


@functools.cache
def _qwen3_vl() -> Any:
    """A two-layer ``Qwen3VLModel`` (hidden 32, interleaved mrope) with a one-block vision tower (hidden 16)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = _qwen_tokenizer()
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 1, 1]},
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": 32,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
    }
    config = Qwen3VLConfig(text_config=text_config, vision_config=vision_config, **_qwen_vl_token_ids())
    seeded(SEED)
    # Boogu-Image loads the conditional-generation model and keeps its inner model, as here.
    return Qwen3VLForConditionalGeneration(config).model.eval()


@functools.cache
def _qwen3_vl_text_only() -> Any:
    """Krea 2's encoder: the same Qwen3-VL with its vision tower deleted, as its ``__init__`` does."""
    encoder = copy.deepcopy(_qwen3_vl())
    del encoder.visual
    return encoder


def _krea2() -> Any:
    from vllm_omni.diffusion.models.krea2.pipeline_krea2 import Krea2Pipeline

    pipeline = _blank(Krea2Pipeline)
    pipeline.device = CPU
    pipeline.text_encoder = _qwen3_vl_text_only()
    pipeline.tokenizer = _qwen_tokenizer()
    pipeline.text_encoder_select_layers = KREA2_SELECT_LAYERS
    pipeline.is_distilled = False
    pipeline.patch_size = 2
    pipeline.prompt_template_encode_prefix = (
        "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
        "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
    )
    pipeline.prompt_template_encode_suffix = "<|im_end|>\n<|im_start|>assistant\n"
    pipeline.prompt_template_encode_start_idx = 34
    pipeline.prompt_template_encode_num_suffix_tokens = 5
    return pipeline


def _krea2_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As Krea2Pipeline.forward calls it for the positive prompts."""
    return pipeline.encode_prompt(
        prompt=list(prompts), device=pipeline.device, num_images_per_prompt=1, max_sequence_length=512
    )


# ---------------------------------------------------------------------------------------------
# vLLM layers on the CPU
# ---------------------------------------------------------------------------------------------


def _silu_and_mul(result: torch.Tensor, gate_up: torch.Tensor) -> None:
    half = gate_up.shape[-1] // 2
    result.copy_(torch.nn.functional.silu(gate_up[..., :half]) * gate_up[..., half:])


@contextlib.contextmanager
def _vllm_layers() -> Iterator[None]:
    """Build vLLM parallel layers here: a current vLLM config, the TP group, and ``_C::silu_and_mul``.

    vLLM's ``SiluAndMul.__init__`` looks up ``torch.ops._C.silu_and_mul`` on a CPU platform, which
    this wheel (built for CUDA, without ``vllm._C_AVX2``) lacks; its CPU forward never calls it (it
    runs the native formula). The op is registered, with that formula, only while layers are built.
    """
    from vllm.config import VllmConfig, set_current_vllm_config

    one_rank_process_group()  # vLLM's parallel layers need a TP group
    library = None
    if not hasattr(torch.ops._C, "silu_and_mul"):
        library = torch.library.Library("_C", "FRAGMENT")
        library.define("silu_and_mul(Tensor! result, Tensor input) -> ()")
        library.impl("silu_and_mul", _silu_and_mul, "CPU")
    try:
        with set_current_vllm_config(VllmConfig()):
            yield
    finally:
        if library is not None:
            library._destroy()


def _randomize_vllm_module(module: torch.nn.Module) -> torch.nn.Module:
    """Give vLLM layers (allocated empty) seeded random weights, then post-process them as its loader does."""
    for parameter in module.parameters():
        if parameter.dim() == 1:
            torch.nn.init.ones_(parameter)  # norm scales
        else:
            torch.nn.init.normal_(parameter, std=0.02)
    return finish_vllm_loading(module).eval()


# ---------------------------------------------------------------------------------------------
# Mistral: FLUX.2, ERNIE-Image
# ---------------------------------------------------------------------------------------------

#: FLUX.2 taps hidden states (10, 20, 30) of Mistral Small 3; the tiny config names three of its own.
FLUX2_OUT_LAYERS = (0, 1, 2)


@functools.cache
def _mistral_tokenizer() -> Any:
    """A byte-level BPE with Mistral's special tokens; ``<s>`` is prepended when special tokens are added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab, merges = _byte_level_bpe(400, MISTRAL_SPECIAL_TOKENS)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=MISTRAL_SPECIAL_TOKENS[4:],
        model_max_length=32768,
    )
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    tokenizer.padding_side = "right"
    return tokenizer


@functools.cache
def _mistral3_config() -> Any:
    """A ``Mistral3Config``: a two-layer Mistral text model (hidden 32) and a one-layer Pixtral tower (hidden 16)."""
    from transformers import Mistral3Config

    tokenizer = _mistral_tokenizer()
    text_config = {
        "model_type": "mistral",
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 4096,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    vision_config = {
        "model_type": "pixtral",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 8,
        "patch_size": 16,
        "image_size": 64,
    }
    config = Mistral3Config(
        text_config=text_config,
        vision_config=vision_config,
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
    )
    config.text_config.text_encoder_out_layers = list(FLUX2_OUT_LAYERS)
    return config


@functools.cache
def _flux2_text_stack() -> tuple[Any, Any]:
    """vLLM-Omni's ``MistralEncoderModel`` (vLLM parallel layers, random weights) and its ``PixtralProcessor``."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE_UPSAMPLING_I2I, SYSTEM_MESSAGE_UPSAMPLING_T2I
    from transformers import PixtralImageProcessor, PixtralProcessor
    from vllm_omni.diffusion.models.mistral_encoder import MistralEncoderModel

    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(),
        tokenizer=_mistral_tokenizer(),
        patch_size=16,
        spatial_merge_size=2,
        chat_template=MISTRAL_CHAT_TEMPLATE,
    )
    seeded(SEED)
    with _vllm_layers():
        encoder = MistralEncoderModel(_mistral3_config(), prefix="text_encoder")
    _randomize_vllm_module(encoder)
    encoder.set_processor(
        processor, system_message_t2i=SYSTEM_MESSAGE_UPSAMPLING_T2I, system_message_i2i=SYSTEM_MESSAGE_UPSAMPLING_I2I
    )
    return encoder, processor


def _flux2() -> Any:
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from vllm_omni.diffusion.models.flux2.pipeline_flux2 import Flux2Pipeline

    pipeline = _blank(Flux2Pipeline)
    pipeline._execution_device = CPU
    pipeline.text_encoder, pipeline.tokenizer = _flux2_text_stack()
    pipeline.tokenizer_max_length = 512
    pipeline.system_message = SYSTEM_MESSAGE
    config = pipeline.text_encoder.config
    pipeline.text_encoder_out_layers = tuple(getattr(config, "text_encoder_out_layers", (10, 20, 30)))
    return pipeline


@functools.cache
def _mistral3_model() -> Any:
    """ERNIE-Image's text encoder: a transformers ``Mistral3Model`` from the shared config."""
    from transformers import Mistral3Model

    seeded(SEED)
    return Mistral3Model(_mistral3_config()).eval()


def _ernie_image() -> Any:
    from vllm_omni.diffusion.models.ernie_image.pipeline_ernie_image import ErnieImagePipeline

    pipeline = _blank(ErnieImagePipeline)
    pipeline._execution_device = CPU
    pipeline.text_encoder = _mistral3_model()
    pipeline.tokenizer = _mistral_tokenizer()
    pipeline.pe_model, pipeline.pe_tokenizer, pipeline.use_pe = None, None, False  # no ``pe/`` folder
    pipeline.tokenizer_max_length = 512
    return pipeline


def _ernie_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As ErnieImagePipeline.forward calls it: positionally, at its default 1024 x 1024."""
    return pipeline.encode_prompt(list(prompts), pipeline._execution_device, 1, width=1024, height=1024, apply_pe=True)


@functools.cache
def _qwen3_vl_processor() -> Any:
    """Boogu-Image's ``Qwen3VLProcessor``: the VL image and video processors (patch 16) and the tokenizer."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2, min_pixels=32 * 32, max_pixels=64 * 64),
        tokenizer=_qwen_tokenizer(),
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=QWEN_CHAT_TEMPLATE,
    )


@functools.cache
def _boogu_transformer() -> Any:
    """A one-layer Boogu-Image transformer (hidden 32): ``encode_prompt`` reads its ``instruction_feature_configs``."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig, TransformerConfig
    from vllm_omni.diffusion.models.boogu_image.boogu_image_transformer import BooguImageTransformer2DModel

    config = {
        "in_channels": 4,
        "hidden_size": 32,
        "num_layers": 1,
        "num_double_stream_layers": 1,
        "num_refiner_layers": 1,
        "num_attention_heads": 2,
        "num_kv_heads": 2,
        "multiple_of": 16,
        "axes_dim_rope": (4, 6, 6),
        "axes_lens": (64, 64, 64),
        # The stock default but for the feature width, which is the tiny encoder's.
        "instruction_feature_configs": {"instruction_feat_dim": 32, "reduce_type": "mean"},
    }
    od_config = OmniDiffusionConfig(model="tiny-boogu-image", tf_model_config=TransformerConfig.from_dict(config))
    seeded(SEED)
    with _vllm_layers():
        transformer = BooguImageTransformer2DModel(od_config=od_config, prefix="transformer")
    return _randomize_vllm_module(transformer)


def _boogu_image(name: str = "BooguImagePipeline") -> Any:
    """Boogu-Image pipeline class ``name`` (the base or Turbo) on the tiny Qwen3-VL and Boogu transformer."""
    from vllm_omni.diffusion.models.boogu_image import pipeline_boogu_image as boogu

    pipeline = _blank(getattr(boogu, name))
    pipeline._execution_device = CPU
    pipeline.mllm = _qwen3_vl()
    pipeline.processor = _qwen3_vl_processor()
    pipeline.transformer = _boogu_transformer()
    pipeline.default_sample_size = 128
    pipeline.SYSTEM_PROMPT_4_T2I = boogu.SYSTEM_PROMPT_4_T2I_UNIFIED
    pipeline.SYSTEM_PROMPT_DROP = boogu.SYSTEM_PROMPT_4_TI2I_UNIFIED
    pipeline.SYSTEM_PROMPT_4_TI2I = boogu.SYSTEM_PROMPT_4_TI2I_UNIFIED
    pipeline.SYSTEM_PROMPT_4_I2I = boogu.SYSTEM_PROMPT_4_TI2I_UNIFIED
    return pipeline


def _boogu_call(pipeline: Any, prompts: Sequence[str], *, guidance: bool = True) -> Any:
    """As Boogu's forward calls it for text-to-image, no reference images: BooguImagePipeline's text
    guidance 4 > 1 (``guidance``); BooguImageTurboPipeline's must be 1.0, so no negative instruction."""
    return pipeline.encode_prompt(
        list(prompts),
        do_classifier_free_guidance=guidance,
        negative_prompt=None,
        num_images_per_prompt=1,
        device=pipeline._execution_device,
        max_sequence_length=1280,
        input_images=None,
    )


# ---------------------------------------------------------------------------------------------
# Ming: Z-Image pipelines whose conditioning comes from another stage
# ---------------------------------------------------------------------------------------------


def _ming_condition(prompt: str) -> torch.Tensor:
    """The conditioning one request brings to a Ming diffusion stage: random, fixed by ``prompt``.

    It stands for what Ming's forward computes from the thinker stage's hidden states (its condition
    encoder's output), which its encode_prompt only hands back.
    """
    generator = torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
    return torch.randn(8, 32, generator=generator)


def _ming_call(pipeline: Any, prompts: Sequence[str], *, guidance: bool) -> tuple[Any, ...]:
    """As Ming's forward runs, one request per forward: stash its conditioning, then call as ZImagePipeline.forward.

    Ming's inner request always has the prompt "", so every request's call has the same arguments.
    """
    served = []
    for prompt in prompts:
        pipeline._pending_prompt_embeds = [_ming_condition(prompt)]
        pipeline._pending_negative_prompt_embeds = [torch.zeros(8, 32)]
        served.append(
            pipeline.encode_prompt(
                prompt=[""],
                negative_prompt=None,
                do_classifier_free_guidance=guidance,
                prompt_embeds=None,
                negative_prompt_embeds=None,
                device=CPU,
                max_sequence_length=512,
            )
        )
        pipeline._pending_prompt_embeds = pipeline._pending_negative_prompt_embeds = None  # forward's finally
    return tuple(served)


def _ming_image() -> Any:
    from vllm_omni.diffusion.models.ming_flash_omni.pipeline_ming_imagegen import MingImagePipeline

    return _blank(MingImagePipeline)


def _ming_image_diffusion() -> Any:
    from vllm_omni.diffusion.models.ming_image.pipeline import MingImageDiffusionPipeline

    return _blank(MingImageDiffusionPipeline)


#: Why the Ming rows are not covered: what encode_prompt returns depends on none of its arguments.
MING_HIDDEN_INPUT = (
    "encode_prompt returns self._pending_prompt_embeds, which forward sets from the request's thinker hidden "
    'states before each call, and forward calls it with prompt [""] for every request: its output depends on '
    "no argument. One request a forward; random conditioning stands in for the condition encoder's output"
)


# ---------------------------------------------------------------------------------------------
# T5: GLM-Image's glyph encoder
# ---------------------------------------------------------------------------------------------


@functools.cache
def _glyph_encoder() -> tuple[Any, Any]:
    """A two-layer ByT5-style ``T5EncoderModel`` (d_model 32, gated GELU) over the byte-level ``ByT5Tokenizer``."""
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tokenizer = ByT5Tokenizer()
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    seeded(SEED)
    return T5EncoderModel(config).eval(), tokenizer


def _glm_image() -> Any:
    from vllm_omni.diffusion.models.glm_image.pipeline_glm_image import GlmImagePipeline

    pipeline = _blank(GlmImagePipeline)
    pipeline.device = CPU
    pipeline.text_encoder, pipeline.tokenizer = _glyph_encoder()
    return pipeline


def _glm_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As GlmImagePipeline.forward calls it: guidance > 1, in the dtype of the (unbuilt) transformer, fp32 here."""
    return pipeline.encode_prompt(
        list(prompts),
        do_classifier_free_guidance=True,
        num_images_per_prompt=1,
        prompt_embeds=None,
        device=pipeline.device,
        dtype=torch.float32,
    )


CASES: list[Case | NotBuilt] = [
    Case(
        "Flux2Pipeline",
        _flux2,
        _flux2_call,
        PROMPTS,
        note="vLLM-Omni's MistralEncoderModel on vLLM layers; taps (0, 1, 2) set in the encoder config",
    ),
    Case("Flux2KleinPipeline", _flux2_klein, _flux2_call, PROMPTS, note="taps (0, 1, 2) set in the encoder config"),
    Case(
        "ZImagePipeline",
        _z_image,
        _z_image_call,
        PROMPTS,
        note="plain transformers Qwen3 (the stock swaps its nn.Linear for vLLM replicated linears)",
    ),
    Case("OvisImagePipeline", _ovis_image, _ovis_call, PROMPTS),
    Case(
        "LongCatImagePipeline",
        _longcat_image,
        _longcat_call,
        PROMPTS,
        note="forward's optional prompt rewrite (VL generation) only changes the text; not run",
    ),
    Case(
        "LongCatImageEditPipeline",
        _longcat_image_edit,
        _longcat_edit_call,
        PROMPTS,
        inputs="text + image",
        note="one 56x56 condition image; stock encode_prompt encodes prompt[0] only (forward passes one prompt)",
    ),
    Case(
        "GlmImagePipeline",
        _glm_image,
        _glm_call,
        GLYPH_PROMPTS,
        inputs="text (quoted glyphs)",
        note="stock encode_prompt encodes prompt[0]'s glyphs only (forward passes one prompt)",
    ),
    Case("OmniGen2Pipeline", _omnigen2, _omnigen2_call, PROMPTS),
    Case("ErnieImagePipeline", _ernie_image, _ernie_call, PROMPTS, note="no prompt-enhancer (pe/) model"),
    Case(
        "BooguImagePipeline",
        _boogu_image,
        _boogu_call,
        PROMPTS,
        note="a one-layer Boogu transformer built for its instruction_feature_configs",
    ),
    Case(
        "BooguImageTurboPipeline",
        functools.partial(_boogu_image, "BooguImageTurboPipeline"),
        functools.partial(_boogu_call, guidance=False),
        PROMPTS,
        note="Turbo: guidance 1.0, no negative instruction; one request a forward, the batched calls pass a list",
    ),
    Case(
        "MingImagePipeline",
        _ming_image,
        functools.partial(_ming_call, guidance=True),
        PROMPTS,
        inputs="thinker conditioning",
        note=f"Ming-flash-omni image generation, CFG on; {MING_HIDDEN_INPUT}",
    ),
    Case(
        "MingImageDiffusionPipeline",
        _ming_image_diffusion,
        functools.partial(_ming_call, guidance=False),
        PROMPTS,
        inputs="thinker conditioning",
        note=f"Ming-Image, default guidance 1.0: CFG off; {MING_HIDDEN_INPUT}",
    ),
    Case(
        "AnimaPipeline",
        _anima,
        _anima_call,
        PROMPTS,
        note="its dict output compared as values in key order",
    ),
    Case("Krea2Pipeline", _krea2, _krea2_call, PROMPTS, note="taps (1, 2) set as model_index.json can"),
]
