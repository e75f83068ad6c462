"""CLIP / T5 text stacks (FLUX.1, FLUX.1-Kontext, SD3, SDXL, HiDream-I1, Stable Audio) and LTX-2's Gemma 3.

Every text stack here is the real transformers (or vLLM-Omni) encoder class, built tiny from a
config with seeded random weights; every tokenizer is built here, nothing is downloaded:

* CLIP: two towers, "L" (hidden 16) and "G" (hidden 32, as bigG is wider than L), each as
  ``CLIPTextModel`` or ``CLIPTextModelWithProjection`` as the pipeline loads it, over one
  byte-level ``CLIPTokenizer`` whose vocabulary is the 256 byte symbols with and without ``</w>``
  (no merges: one token a character; 77 positions). The G tokenizer pads with ``!`` as SDXL's and
  SD3's second tokenizers do.
* T5: one ``T5Config`` (d_model 64 so that SD3's CLIP L+G width, 48, pads up into it; gated GELU,
  as T5 v1.1), a unigram ``T5Tokenizer`` trained here on a few sentences. SD3, HiDream, Kontext and
  Stable Audio load it as transformers' ``T5EncoderModel``; FLUX.1 builds vLLM-Omni's own
  ``T5EncoderModel`` (vLLM parallel layers, in a one-process gloo TP group) and loads the same
  weights into it through its ``load_weights``.
* HiDream's fourth encoder: a ``LlamaForCausalLM`` (hidden 32) over a byte-level BPE
  ``PreTrainedTokenizerFast`` that adds a BOS, padded with its EOS as the stock ``__init__`` sets.
* LTX-2: a ``Gemma3ForConditionalGeneration`` (text hidden 32, a one-layer SigLIP tower it does not
  use for text) over a byte-fallback ``GemmaTokenizer`` with 128 positions.

Each pipeline object is made with ``Kind.__new__(Kind)`` + ``torch.nn.Module.__init__`` and given
the attributes its stock ``__init__`` sets that its ``encode_prompt`` reads; the encode callables
pass the keywords each ``forward`` passes, with the defaults a request without sampling overrides
gets (HiDream's guidance 5.0 and Stable Audio's 7.0 turn classifier-free guidance on; LTX-2's
recipe decides it, and its negative prompt).
"""

from __future__ import annotations

import functools
import string
from collections.abc import Sequence
from typing import Any

import torch

from vllm_omni_prompt_cache.coverage.harness import Case, NotBuilt, finish_vllm_loading, one_rank_process_group, seeded

PROMPTS = ("a red fox in the snow", "a lighthouse above a stormy sea")
CPU = torch.device("cpu")
DTYPE = torch.float32
CLIP_POSITIONS = 77
T5_MAX_LENGTH = 512  # the T5 tokenizers' model_max_length in FLUX.1, SD3 and HiDream checkpoints
STABLE_AUDIO_MAX_LENGTH = 128  # Stable Audio Open pads every prompt to its tokenizer's model_max_length
GEMMA_MAX_LENGTH = 128  # LTX-2 pads to tokenizer_max_length; kept short here

_TRAINING_TEXT = [
    *PROMPTS,
    "a bowl of ramen with a soft boiled egg, steam rising",
    "an astronaut riding a horse across a desert of glass",
    " ".join(string.printable.strip()),
]
_CLIP_SPECIAL = ("<|startoftext|>", "<|endoftext|>")
_T5_SPECIAL = ["<pad>", "</s>", "<unk>"]  # T5's order: pad 0, eos 1, unk 2
_LLAMA_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>")


def _bare(kind: type) -> Any:
    """A pipeline object of ``kind`` with no attributes but torch.nn.Module's."""
    pipeline = kind.__new__(kind)
    torch.nn.Module.__init__(pipeline)
    return pipeline


def _byte_symbols() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet())


# --- tokenizers -------------------------------------------------------------------------------


@functools.cache
def _clip_tokenizer(pad_token: str = "<|endoftext|>") -> Any:
    """CLIP's byte-level BPE with no merges: every character is one token (``</w>`` on a word's last)."""
    from transformers import CLIPTokenizer

    symbols = _byte_symbols()
    vocab = {symbol: index for index, symbol in enumerate(symbols)}
    vocab.update({f"{symbol}</w>": len(symbols) + index for index, symbol in enumerate(symbols)})
    for token in _CLIP_SPECIAL:
        vocab[token] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], pad_token=pad_token, model_max_length=CLIP_POSITIONS)


@functools.cache
def _t5_vocab() -> tuple[tuple[str, float], ...]:
    """A unigram vocabulary trained on a few sentences, T5's specials first."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=_T5_SPECIAL, unk_token="<unk>")
    unigram.train_from_iterator(_TRAINING_TEXT, trainer=trainer)
    return tuple((piece, score) for piece, score in json.loads(unigram.to_str())["model"]["vocab"])


@functools.cache
def _t5_tokenizer(model_max_length: int = T5_MAX_LENGTH) -> Any:
    from transformers import T5Tokenizer

    tokenizer = T5Tokenizer(vocab=list(_t5_vocab()), extra_ids=0, model_max_length=model_max_length)
    tokenizer.padding_side = "right"
    return tokenizer


@functools.cache
def _llama_tokenizer() -> Any:
    """Llama 3's shape: byte-level BPE (no merges here), a BOS added in front, no pad token of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    symbols = _byte_symbols()
    vocab = {symbol: index for index, symbol in enumerate(symbols)}
    for token in _LLAMA_SPECIAL:
        vocab[token] = len(vocab)
    bos, eos = _LLAMA_SPECIAL
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, model_max_length=131072)


@functools.cache
def _gemma_tokenizer() -> Any:
    """Gemma's byte-fallback BPE (no merges here): specials, the 256 byte tokens, then ASCII characters."""
    from transformers import GemmaTokenizer

    vocab = {token: index for index, token in enumerate(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"))}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for symbol in ["▁", *string.ascii_letters, *string.digits, *string.punctuation]:
        vocab.setdefault(symbol, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[], model_max_length=GEMMA_MAX_LENGTH)


# --- encoders ---------------------------------------------------------------------------------

_CLIP_TOWERS = {
    # tower: (hidden, heads, activation, seed)
    "L": (16, 2, "quick_gelu", 1),
    "G": (32, 4, "gelu", 2),
}


@functools.cache
def _clip(tower: str, projection: bool) -> Any:
    """CLIP tower ``tower`` as ``CLIPTextModelWithProjection`` (``projection``) or ``CLIPTextModel``."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    hidden, heads, activation, seed = _CLIP_TOWERS[tower]
    tokenizer = _clip_tokenizer()
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        max_position_embeddings=CLIP_POSITIONS,
        hidden_act=activation,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    seeded(seed)
    kind = CLIPTextModelWithProjection if projection else CLIPTextModel
    return kind(config).to(DTYPE).eval()


def _t5_config() -> Any:
    from transformers import T5Config

    tokenizer = _t5_tokenizer()
    return T5Config(
        vocab_size=len(tokenizer),
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )


@functools.cache
def _t5() -> Any:
    """The tiny T5 encoder, as transformers' ``T5EncoderModel``."""
    from transformers import T5EncoderModel

    seeded(3)
    return T5EncoderModel(_t5_config()).to(DTYPE).eval()


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
    config = _t5_config()
    config.dense_act_fn = "gelu_pytorch_tanh"
    with set_current_vllm_config(VllmConfig()):
        encoder = T5EncoderModel(config, prefix="text_encoder_2")
        encoder.load_weights((f"text_encoder_2.{name}", weight) for name, weight in _t5().state_dict().items())
        finish_vllm_loading(encoder)
    return encoder.to(DTYPE).eval()


@functools.cache
def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _llama_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500000.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    seeded(4)
    return LlamaForCausalLM(config).to(DTYPE).eval()


@functools.cache
def _gemma3() -> Any:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = _gemma_tokenizer()
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 256,
        "sliding_window": 64,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    vision_config = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    config = Gemma3Config(text_config=text_config, vision_config=vision_config, mm_tokens_per_image=1)
    seeded(5)
    return Gemma3ForConditionalGeneration(config).to(DTYPE).eval()


def _od_config() -> Any:
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    return OmniDiffusionConfig.from_kwargs(dtype=DTYPE)


# --- FLUX.1 -----------------------------------------------------------------------------------


def _flux(name: str = "FluxPipeline") -> Any:
    """FLUX.1 pipeline class ``name`` (``FluxPipeline`` or its DMD2 subclass) with CLIP-L and vLLM-Omni's T5."""
    from vllm_omni.diffusion.models.flux import pipeline_flux

    pipeline = _bare(getattr(pipeline_flux, name))
    pipeline.device = CPU
    pipeline.tokenizer, pipeline.text_encoder = _clip_tokenizer(), _clip("L", projection=False)
    pipeline.tokenizer_2, pipeline.text_encoder_2 = _t5_tokenizer(), _vllm_omni_t5()
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
    pipeline.tokenizer, pipeline.text_encoder = _clip_tokenizer(), _clip("L", projection=False)
    pipeline.tokenizer_2, pipeline.text_encoder_2 = _t5_tokenizer(), _t5()
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
    pipeline.tokenizer, pipeline.text_encoder = _clip_tokenizer(), _clip("L", projection=True)
    pipeline.tokenizer_2, pipeline.text_encoder_2 = _clip_tokenizer("!"), _clip("G", projection=True)
    pipeline.tokenizer_3, pipeline.text_encoder_3 = _t5_tokenizer(), _t5()
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
    pipeline.tokenizer, pipeline.text_encoder = _clip_tokenizer(), _clip("L", projection=False)
    pipeline.tokenizer_2, pipeline.text_encoder_2 = _clip_tokenizer("!"), _clip("G", projection=True)
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
    pipeline.tokenizer, pipeline.text_encoder = _clip_tokenizer(), _clip("L", projection=True)
    pipeline.tokenizer_2, pipeline.text_encoder_2 = _clip_tokenizer(), _clip("G", projection=True)
    pipeline.tokenizer_3, pipeline.text_encoder_3 = _t5_tokenizer(), _t5()
    pipeline.tokenizer_4, pipeline.text_encoder_4 = _llama_tokenizer(), _llama()
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

    width = _t5_config().d_model
    seeded(6)
    return StableAudioProjectionModel(text_encoder_dim=width, conditioning_dim=width, min_value=0, max_value=512)


def _stable_audio() -> Any:
    from vllm_omni.diffusion.models.stable_audio.pipeline_stable_audio import StableAudioPipeline

    pipeline = _bare(StableAudioPipeline)
    pipeline.device = CPU
    pipeline.tokenizer, pipeline.text_encoder = _t5_tokenizer(STABLE_AUDIO_MAX_LENGTH), _t5()
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
    pipeline.tokenizer, pipeline.text_encoder = _gemma_tokenizer(), _gemma3()
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
