"""Video pipelines' text stacks (Wan2.2, Helios, HunyuanVideo-1.5, SANA-Video, LingBot, LongCat, MAGI-2), built tiny.

MiniMax-H3 is listed, not built (its case says why).

Only the text path is built: each pipeline object is made without its ``__init__`` and given the
attributes that ``__init__`` sets and ``encode_prompt`` reads, nothing of its transformer or VAE.
The stacks (random weights from a fixed seed, tokenizers made here, nothing downloaded):

* UMT5 (Wan2.2 T2V / I2V / S2V / VACE and the DMD2 T2V / I2V, Helios, LongCat-Video-Avatar,
  LingBot-World): the encoder and T5 unigram tokenizer of the tiny Wan2.2 checkpoint
  (``tiny/wan22.py``), shared by all nine.
* HunyuanVideo-1.5 (T2V and I2V share it): a ``Qwen2_5_VLTextModel`` behind a byte-level BPE
  ``Qwen2Tokenizer`` with a Qwen chat template, and for quoted glyph text ``ByT5Tokenizer`` (no files)
  with vLLM-Omni's own tensor-parallel ``T5EncoderModel``, loaded from a random transformers T5 through
  its ``load_weights`` in a one-rank gloo group, as its loader would.
* SANA-Video (text- and image-to-video): a ``Gemma2Model`` behind a ``GemmaTokenizer`` built from a
  BPE trained here.
* LingBot-Video: a ``Qwen3VLForConditionalGeneration`` (one-block vision tower, never run on text)
  behind a ``Qwen3VLProcessor`` of the same BPE tokenizer and default image / video processors.
* MAGI-2: its ``Magi2Qwen35TextEncoder``, built by its own ``__init__`` from a tiny ``Qwen3_5TextModel``
  and the BPE tokenizer saved to a temporary directory.

The byte-level BPE is trained on a few sentences and every printable character, so any English
prompt tokenizes without unknowns. Prompts are texts, called with the keywords each forward passes.
"""

from __future__ import annotations

import collections
import functools
import json
import string
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from prompt_cache_coverage.harness import Case, NotBuilt, finish_vllm_loading, one_rank_process_group, seeded

PROMPTS = ("a red fox runs through the snow at dawn", "a lighthouse stands above a stormy sea")
#: HunyuanVideo-1.5 sends quoted text through its ByT5 glyph encoder: the first prompt quotes, the second does not.
GLYPH_PROMPTS = ('a neon sign that reads "open" above a wooden door', PROMPTS[1])
CPU = torch.device("cpu")
DTYPE = torch.float32  # the dtype each forward passes (its transformer's): fp32 here
SEED = 0
HIDDEN = 32

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
#: Qwen's chat format, enough for ``apply_chat_template`` with system and user turns.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: HunyuanVideo-1.5's system turn, written here in short; its crop index is measured on this tokenizer
#: (the stock 108 is the tokenized length of the stock system turn and user header).
HUNYUAN_SYSTEM_MESSAGE = (
    "You are a helpful assistant. Describe the video: its content and theme, the objects and their "
    "motion, the background, light and style, and the camera."
)
_TRAINING_TEXT = (
    *PROMPTS,
    *GLYPH_PROMPTS,
    HUNYUAN_SYSTEM_MESSAGE,
    "a small wooden cabin beside a mountain lake, reflections, golden hour",
    "blurry, low quality, distorted, watermark, text, bad anatomy, static, flicker",
    " ".join(string.printable.strip()),
)


def _bare(kind: type) -> Any:
    """Return a ``kind`` object made without its ``__init__``: a plain ``nn.Module`` so far."""
    pipeline = kind.__new__(kind)
    torch.nn.Module.__init__(pipeline)
    return pipeline


# --- UMT5: Wan2.2, Helios, LongCat ------------------------------------------------------------------


@functools.cache
def _umt5_stack() -> tuple[Any, Any]:
    """The tiny Wan2.2 checkpoint's T5 tokenizer and ``UMT5EncoderModel`` (d_model 32, 2 layers, tied embeddings)."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    from vllm_omni_prompt_cache.tiny.wan22 import ensure_tiny_wan22

    model_dir = ensure_tiny_wan22()
    tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer", local_files_only=True)
    encoder = UMT5EncoderModel.from_pretrained(model_dir / "text_encoder", dtype=DTYPE)
    return tokenizer, encoder.eval()


def _umt5_pipeline(kind: type) -> Any:
    pipeline = _bare(kind)
    pipeline.tokenizer, pipeline.text_encoder = _umt5_stack()
    pipeline.device = CPU
    return pipeline


def _wan22() -> Any:
    from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2 import Wan22Pipeline

    return _umt5_pipeline(Wan22Pipeline)


def _wan22_i2v() -> Any:
    from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2_i2v import Wan22I2VPipeline

    return _umt5_pipeline(Wan22I2VPipeline)


def _wan_t2v_dmd2() -> Any:
    from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2 import WanT2VDMD2Pipeline

    return _umt5_pipeline(WanT2VDMD2Pipeline)


def _wan_i2v_dmd2() -> Any:
    from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2_i2v import WanI2VDMD2Pipeline

    return _umt5_pipeline(WanI2VDMD2Pipeline)


def _wan22_vace() -> Any:
    from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2_vace import Wan22VACEPipeline

    return _umt5_pipeline(Wan22VACEPipeline)


def _lingbot_world() -> Any:
    from vllm_omni.diffusion.models.lingbot_world.pipeline import LingBotWorldCausalDMDPipeline

    pipeline = _umt5_pipeline(LingBotWorldCausalDMDPipeline)
    pipeline._prompt_embeds_cache = collections.OrderedDict()  # its own LRU of encodes, as __init__ makes it
    return pipeline


def _wan22_s2v() -> Any:
    from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2_s2v import Wan22S2VPipeline

    pipeline = _umt5_pipeline(Wan22S2VPipeline)
    pipeline._guidance_scale = 4.5  # forward's default, read back through do_classifier_free_guidance
    return pipeline


def _helios() -> Any:
    from vllm_omni.diffusion.models.helios.pipeline_helios import HeliosPipeline

    pipeline = _umt5_pipeline(HeliosPipeline)
    pipeline._guidance_scale = 5.0  # forward's default
    return pipeline


def _longcat() -> Any:
    from vllm_omni.diffusion.models.longcat_video.pipeline_longcat_video_avatar import LongCatVideoAvatarPipeline

    pipeline = _umt5_pipeline(LongCatVideoAvatarPipeline)
    # The default (distilled) request runs both guidance scales at 1.0: no negative prompt is encoded.
    pipeline._text_guidance_scale = pipeline._audio_guidance_scale = 1.0
    return pipeline


def _wan_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As Wan22Pipeline / Wan22I2VPipeline.forward call it: CFG on (default guidance), no negative prompt."""
    return pipeline.encode_prompt(
        prompt=list(prompts),
        negative_prompt=None,
        do_classifier_free_guidance=True,
        num_videos_per_prompt=1,
        max_sequence_length=512,
        device=pipeline.device,
        dtype=DTYPE,
    )


def _wan_dmd2_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As Wan22Pipeline / Wan22I2VPipeline.forward call it under DMD2: guidance forced to 1.0, so CFG off."""
    return pipeline.encode_prompt(
        prompt=list(prompts),
        negative_prompt=None,
        do_classifier_free_guidance=False,
        num_videos_per_prompt=1,
        max_sequence_length=512,
        device=pipeline.device,
        dtype=DTYPE,
    )


def _lingbot_world_call(pipeline: Any, prompts: Sequence[str]) -> tuple[Any, ...]:
    """As LingBotWorldCausalDMDPipeline.forward calls it: one prompt (a str) a request, 512 positions.

    Its encode_prompt takes no list, so a batch is one call per prompt, in order.
    """
    return tuple(pipeline.encode_prompt(prompt, max_sequence_length=512, dtype=DTYPE) for prompt in prompts)


def _s2v_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As Wan22S2VPipeline.forward calls it: one default (Chinese) negative prompt per request."""
    from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2_s2v import _S2V_DEFAULT_NEG_PROMPT

    return pipeline.encode_prompt(
        prompt=list(prompts),
        negative_prompt=[_S2V_DEFAULT_NEG_PROMPT] * len(prompts),
        do_classifier_free_guidance=pipeline.do_classifier_free_guidance,
        num_videos_per_prompt=1,
        max_sequence_length=512,
        device=pipeline.device,
        dtype=DTYPE,
    )


def _one_or_many(prompts: Sequence[str]) -> str | list[str]:
    """A one-request forward passes its prompt as a string; batches go to encode_prompt as a list."""
    return prompts[0] if len(prompts) == 1 else list(prompts)


def _helios_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As HeliosPipeline.forward calls it (one prompt, a string); batched calls pass the list."""
    return pipeline.encode_prompt(
        prompt=_one_or_many(prompts),
        negative_prompt=None,
        do_classifier_free_guidance=pipeline.do_classifier_free_guidance,
        num_videos_per_prompt=1,
        max_sequence_length=226,
        device=pipeline.device,
        dtype=DTYPE,
    )


def _longcat_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As LongCatVideoAvatarPipeline's generate steps call it: the default negative prompt, CFG off."""
    from vllm_omni.diffusion.models.longcat_video.pipeline_longcat_video_avatar import _DEFAULT_NEGATIVE_PROMPT

    return pipeline.encode_prompt(
        prompt=_one_or_many(prompts),
        negative_prompt=_DEFAULT_NEGATIVE_PROMPT,
        do_classifier_free_guidance=pipeline.do_classifier_free_guidance,
        max_sequence_length=512,
        device=pipeline.device,
        dtype=DTYPE,
    )


# --- the byte-level BPE shared by the Qwen-family encoders -------------------------------------------


@functools.cache
def _qwen_tokenizer() -> Any:
    """A ``Qwen2Tokenizer`` over a 400-token byte-level BPE trained here, with Qwen's special tokens and chat format."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_TRAINING_TEXT, trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=trained["vocab"],
        merges=[tuple(pair) for pair in trained["merges"]],
        extra_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    tokenizer.padding_side = "right"
    return tokenizer


def _mrope_section(head_dim: int) -> list[int]:
    """Split the rotary half of ``head_dim`` into (t, h, w) sections, as Qwen's multimodal rope wants."""
    half = head_dim // 2
    return [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]


# --- HunyuanVideo-1.5 ---------------------------------------------------------------------------------


@functools.cache
def _hunyuan_text_stack() -> tuple[Any, Any, Any, Any, int]:
    """(Qwen tokenizer, Qwen2.5-VL text model, ByT5 tokenizer, vLLM T5 encoder, template crop index)."""
    import transformers
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm_omni.diffusion.models.hunyuan_video.pipeline_hunyuan_video_1_5 import format_text_input
    from vllm_omni.diffusion.models.t5_encoder import T5EncoderModel

    tokenizer = _qwen_tokenizer()
    seeded(SEED)
    heads = 4
    qwen_config = transformers.Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=3,  # forward takes hidden_states[-3]: the first layer's output, not the embeddings
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": _mrope_section(HIDDEN // heads)},
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        dtype=DTYPE,
    )
    text_encoder = transformers.Qwen2_5_VLTextModel(qwen_config).eval()

    tokenizer_2 = transformers.ByT5Tokenizer()
    # ByT5's gated GELU is the tanh approximation; named so, vLLM gives it torch's kernel, not its CUDA one.
    t5_config = transformers.T5Config(
        vocab_size=len(tokenizer_2),
        d_model=HIDDEN,
        d_kv=HIDDEN // heads,
        d_ff=2 * HIDDEN,
        num_layers=2,
        num_heads=heads,
        relative_attention_num_buckets=32,
        feed_forward_proj="gated-gelu_pytorch_tanh",
        is_encoder_decoder=False,
    )
    reference_t5 = transformers.T5EncoderModel(t5_config)
    one_rank_process_group()  # vLLM's parallel layers need a TP group
    with set_current_vllm_config(VllmConfig()):
        text_encoder_2 = T5EncoderModel(t5_config, prefix="text_encoder_2")
    text_encoder_2.load_weights(reference_t5.state_dict().items())
    finish_vllm_loading(text_encoder_2)

    header = tokenizer.apply_chat_template(format_text_input(["\x00"], HUNYUAN_SYSTEM_MESSAGE)[0], tokenize=False)
    crop = len(tokenizer(header[: header.index("\x00")]).input_ids)
    return tokenizer, text_encoder, tokenizer_2, text_encoder_2.eval(), crop


def _hunyuan_pipeline(kind: type) -> Any:
    pipeline = _bare(kind)
    pipeline.tokenizer, pipeline.text_encoder, pipeline.tokenizer_2, pipeline.text_encoder_2, crop = (
        _hunyuan_text_stack()
    )
    pipeline.device = CPU
    pipeline.system_message = HUNYUAN_SYSTEM_MESSAGE
    pipeline.prompt_template_encode_start_idx = crop
    pipeline.tokenizer_max_length = 1000
    pipeline.tokenizer_2_max_length = 256
    return pipeline


def _hunyuan_video() -> Any:
    from vllm_omni.diffusion.models.hunyuan_video.pipeline_hunyuan_video_1_5 import HunyuanVideo15Pipeline

    return _hunyuan_pipeline(HunyuanVideo15Pipeline)


def _hunyuan_video_i2v() -> Any:
    from vllm_omni.diffusion.models.hunyuan_video.pipeline_hunyuan_video_1_5_i2v import HunyuanVideo15I2VPipeline

    return _hunyuan_pipeline(HunyuanVideo15I2VPipeline)


def _hunyuan_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As HunyuanVideo15(I2V)Pipeline.forward calls it: no negative prompt, CFG on (default guidance 6.0)."""
    return pipeline.encode_prompt(
        prompt=_one_or_many(prompts),
        device=pipeline.device,
        dtype=DTYPE,
        negative_prompt=None,
        do_classifier_free_guidance=True,
    )


# --- SANA-Video ----------------------------------------------------------------------------------------


@functools.cache
def _gemma_stack() -> tuple[Any, Any]:
    """A ``GemmaTokenizer`` over a BPE trained here (Gemma's ▁ spaces, 400 tokens) and a 2-layer ``Gemma2Model``."""
    import transformers
    from tokenizers import Tokenizer, models, normalizers, trainers
    from vllm_omni.diffusion.models.sana_video.pipeline_sana_video import SANA_VIDEO_COMPLEX_HUMAN_INSTRUCTION

    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=[*string.printable.strip(), "▁"]
    )
    bpe.train_from_iterator([*_TRAINING_TEXT, *SANA_VIDEO_COMPLEX_HUMAN_INSTRUCTION], trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]
    tokenizer = transformers.GemmaTokenizer(vocab=trained["vocab"], merges=[tuple(pair) for pair in trained["merges"]])
    seeded(SEED)
    config = transformers.Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HIDDEN // 4,
        max_position_embeddings=2048,
        sliding_window=64,  # the first layer attends in windows, shorter than a prompt with its instruction
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype=DTYPE,
    )
    return tokenizer, transformers.Gemma2Model(config).eval()


def _sana_video(name: str = "SanaVideoPipeline") -> Any:
    """SANA-Video pipeline class ``name`` (text-to-video, or its image-to-video subclass) on the Gemma 2 stack."""
    from vllm_omni.diffusion.models import sana_video

    pipeline = _bare(getattr(sana_video, name))
    pipeline.tokenizer, pipeline.text_encoder = _gemma_stack()
    pipeline.device = CPU
    pipeline._guidance_scale = 6.0  # forward's default, read back through do_classifier_free_guidance
    return pipeline


def _sana_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As SanaVideoPipeline._generate calls it: positional prompt and CFG flag, the complex human instruction."""
    from vllm_omni.diffusion.models.sana_video.pipeline_sana_video import SANA_VIDEO_COMPLEX_HUMAN_INSTRUCTION

    return pipeline.encode_prompt(
        _one_or_many(prompts),
        pipeline.do_classifier_free_guidance,
        negative_prompt="",
        num_videos_per_prompt=1,
        device=pipeline.device,
        prompt_embeds=None,
        negative_prompt_embeds=None,
        prompt_attention_mask=None,
        negative_prompt_attention_mask=None,
        clean_caption=False,
        max_sequence_length=300,
        complex_human_instruction=list(SANA_VIDEO_COMPLEX_HUMAN_INSTRUCTION),
    )


def _sana_i2v_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As SanaImageToVideoPipeline._generate_i2v calls it: an empty negative prompt, its own instruction."""
    from vllm_omni.diffusion.models.sana_video.pipeline_sana_video_i2v import SANA_VIDEO_I2V_COMPLEX_HUMAN_INSTRUCTION

    return pipeline.encode_prompt(
        _one_or_many(prompts),
        pipeline.do_classifier_free_guidance,
        negative_prompt="",
        num_videos_per_prompt=1,
        device=pipeline.device,
        clean_caption=False,
        max_sequence_length=300,
        complex_human_instruction=list(SANA_VIDEO_I2V_COMPLEX_HUMAN_INSTRUCTION),
    )


# --- LingBot-Video ---------------------------------------------------------------------------------------


@functools.cache
def _lingbot_stack() -> tuple[Any, Any]:
    """A ``Qwen3VLProcessor`` (the BPE tokenizer, default image and video processors) and a tiny Qwen3-VL."""
    import transformers

    tokenizer = _qwen_tokenizer()
    processor = transformers.Qwen3VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(),
        tokenizer=tokenizer,
        video_processor=transformers.Qwen3VLVideoProcessor(),
    )
    seeded(SEED)
    heads = 4
    head_dim = HIDDEN // heads
    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in ("image_pad", "video_pad")}
    ids |= {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in ("vision_start", "vision_end")}
    config = transformers.Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": HIDDEN,
            "intermediate_size": 2 * HIDDEN,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": heads // 2,
            "head_dim": head_dim,
            "max_position_embeddings": 2048,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5e5,
                "mrope_section": _mrope_section(head_dim),
                "mrope_interleaved": True,
            },
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": HIDDEN,
            "intermediate_size": 2 * HIDDEN,
            "num_heads": 2,
            "out_hidden_size": HIDDEN,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
    )
    return processor, transformers.Qwen3VLForConditionalGeneration(config).to(DTYPE).eval()


def _lingbot_video() -> Any:
    from vllm_omni.diffusion.models.lingbot_video.pipeline_lingbot_video import (
        HIDDEN_STATE_SKIP_LAYER,
        IMG_PROMPT_TEMPLATE,
        PROMPT_TEMPLATE,
        TOKEN_LENGTH,
        LingBotVideoPipeline,
    )

    pipeline = _bare(LingBotVideoPipeline)
    pipeline.processor, pipeline.text_encoder = _lingbot_stack()
    pipeline.device = CPU
    pipeline.token_length = TOKEN_LENGTH
    pipeline.hidden_state_skip_layer = HIDDEN_STATE_SKIP_LAYER
    pipeline.prompt_template = PROMPT_TEMPLATE
    pipeline.img_prompt_template = IMG_PROMPT_TEMPLATE
    pipeline._crop_start = None
    return pipeline


def _lingbot_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As LingBotVideoPipeline._generate calls it for text-to-video: no images."""
    return pipeline.encode_prompt(_one_or_many(prompts), images=None, device=pipeline.device)


# --- MAGI-2 ------------------------------------------------------------------------------------------------


@functools.cache
def _magi2_text_encoder() -> Any:
    """MAGI-2's own ``Magi2Qwen35TextEncoder``, built by its ``__init__`` from a directory saved here and removed after.

    Inside: the BPE tokenizer and a ``Qwen3_5TextModel`` of 4 layers (linear, full, linear, full attention).
    """
    import transformers
    from vllm_omni.diffusion.models.magi2.conditioning import Magi2Qwen35TextEncoder

    tokenizer = _qwen_tokenizer()
    seeded(SEED)
    heads, head_dim = 4, HIDDEN // 4
    config = transformers.Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=4,  # MAGI-2 takes hidden_states[-3]: after one linear- and one full-attention layer
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=head_dim,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=2048,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.5,
            "mrope_section": _mrope_section(head_dim // 2),
            "mrope_interleaved": True,
        },
        pad_token_id=tokenizer.pad_token_id,
        dtype=DTYPE,
    )
    with tempfile.TemporaryDirectory(prefix="coverage-magi2-text-encoder-") as directory:
        tokenizer.save_pretrained(directory)
        transformers.Qwen3_5TextModel(config).save_pretrained(directory)
        return Magi2Qwen35TextEncoder(directory, dtype=DTYPE)


def _magi2() -> Any:
    from vllm_omni.diffusion.models.magi2.parallel import Magi2ParallelGroup
    from vllm_omni.diffusion.models.magi2.pipeline_magi2 import Magi2Pipeline, _Magi2StagedComponent

    pipeline = _bare(Magi2Pipeline)
    pipeline.dtype = DTYPE
    pipeline.device_str = "cpu"
    pipeline._parallel_group = Magi2ParallelGroup(None, 1, 0)  # what a process with no process group gets
    pipeline._is_output_rank = True
    pipeline._offload_aux_after_use = True
    pipeline.text_encoder = _Magi2StagedComponent(_magi2_text_encoder(), "cpu", pin_memory=False)
    return pipeline


def _magi2_call(pipeline: Any, prompts: Sequence[str]) -> Any:
    """As Magi2Pipeline._evaluate_preview encodes: ``_encode_prompts((prompt, negative))``, never encode_prompt."""
    from vllm_omni.diffusion.models.magi2.pipeline_magi2 import DEFAULT_NEGATIVE_PROMPT

    return pipeline._encode_prompts((*prompts, DEFAULT_NEGATIVE_PROMPT))


ONE_PROMPT = "its forward takes one prompt a request; the batched calls pass a list"
DMD2_CFG_OFF = "DMD2 forces guidance 1.0: CFG off, no negative encoded"

CASES: list[Case | NotBuilt] = [
    Case("Wan22Pipeline", _wan22, _wan_call, PROMPTS),
    Case("Wan22I2VPipeline", _wan22_i2v, _wan_call, PROMPTS, note="text path only (the image goes to encode_image)"),
    Case(
        "Wan22S2VPipeline",
        _wan22_s2v,
        _s2v_call,
        PROMPTS,
        note="text path only (audio and reference image are encoded apart)",
    ),
    Case("HeliosPipeline", _helios, _helios_call, PROMPTS, note=ONE_PROMPT),
    Case(
        "HunyuanVideo15Pipeline",
        _hunyuan_video,
        _hunyuan_call,
        GLYPH_PROMPTS,
        note=f"{ONE_PROMPT}; prompt A quotes glyph text (ByT5 runs), B does not (zeros)",
    ),
    Case(
        "HunyuanVideo15I2VPipeline",
        _hunyuan_video_i2v,
        _hunyuan_call,
        GLYPH_PROMPTS,
        note=f"{ONE_PROMPT}; text path only (the image goes to SigLIP apart)",
    ),
    Case("SanaVideoPipeline", _sana_video, _sana_call, PROMPTS, note=ONE_PROMPT),
    Case("LingBotVideoPipeline", _lingbot_video, _lingbot_call, PROMPTS, note=f"{ONE_PROMPT}; text-to-video mode"),
    Case(
        "LongCatVideoAvatarPipeline",
        _longcat,
        _longcat_call,
        PROMPTS,
        note=f"{ONE_PROMPT}; the default distilled request (guidance 1.0: no negative encoded)",
    ),
    Case(
        "Magi2Pipeline",
        _magi2,
        _magi2_call,
        PROMPTS,
        note="its forward encodes through _encode_prompts((prompt, negative)), which an engine finds by watching the "
        "encoder (declared here: the matrix runs no forward); "
        "encode_prompt (one string) is a wrapper no forward calls; the batched calls pass (A, B, negative)",
        method="_encode_prompts",
    ),
    Case("WanT2VDMD2Pipeline", _wan_t2v_dmd2, _wan_dmd2_call, PROMPTS, note=DMD2_CFG_OFF),
    Case(
        "WanI2VDMD2Pipeline",
        _wan_i2v_dmd2,
        _wan_dmd2_call,
        PROMPTS,
        note=f"{DMD2_CFG_OFF}; text path only (the image goes to encode_image)",
    ),
    Case(
        "Wan22VACEPipeline",
        _wan22_vace,
        _wan_call,
        PROMPTS,
        note="text-to-video mode, default guidance 5.0: CFG on; reference images and videos are encoded apart",
    ),
    Case(
        "SanaImageToVideoPipeline",
        functools.partial(_sana_video, "SanaImageToVideoPipeline"),
        _sana_i2v_call,
        PROMPTS,
        note=f"{ONE_PROMPT}; its own complex human instruction; the image is encoded apart",
    ),
    Case(
        "LingBotWorldCausalDMDPipeline",
        _lingbot_world,
        _lingbot_world_call,
        PROMPTS,
        note="encode_prompt takes one str (no rows): a batch here is one call per prompt; it already keeps its "
        "own 4-entry LRU of encodes, keyed by normalised text, length and dtype, in front of which the cache sits",
    ),
    NotBuilt(
        "MiniMaxH3Pipeline",
        "its encode_prompt takes one PreparedEncoderInputs (prompt, task, condition labels, images, videos and "
        "their timestamps), a dataclass the key builder refuses (unsupported type), so every rank-0 call would "
        "bypass; the pipeline is not built here (its encoder, MiniMaxH3Qwen3VLEncoder, is: built tiny by "
        "vllm_omni_prompt_cache/tiny/minimax_h3_encoder.py and proven in tests/test_minimax_h3_encoder.py). "
        "It reads no per-request hidden state (the request is all in "
        "`prepared`; self holds the tokenizer, processor, encoder and its TP group), but on DiT ranks other than 0 "
        "it is called with prepared=None and gets the ids by broadcast from rank 0, so a hit there would skip rank "
        "0's collectives: every rank sees them on its first call and refuses the method (tests/test_ranks.py)",
    ),
]
