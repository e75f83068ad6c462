"""Tiny text stacks: CLIP, T5, Llama and Gemma 3 encoders with the tokenizers they read, built here.

Every encoder is the real transformers class, built from a config with seeded random weights; every
tokenizer is built here, nothing is downloaded. The tiny SD3.5 Medium (:mod:`.sd3`) and LTX-2.3
(:mod:`.ltx2`) checkpoints save them, and the coverage matrix (``prompt_cache_coverage``) builds
vLLM-Omni's pipelines on them:

* CLIP: two towers, "L" (hidden 16) and "G" (hidden 32, as bigG is wider than L), each as
  ``CLIPTextModel`` or ``CLIPTextModelWithProjection``, over one byte-level ``CLIPTokenizer`` whose
  vocabulary is the 256 byte symbols with and without ``</w>`` (no merges: one token a character;
  77 positions). SDXL's and SD3's second tokenizers pad with ``!``: ``clip_tokenizer("!")``.
* T5: one ``T5Config`` (d_model 64 so that SD3's CLIP L+G width, 48, pads up into it; gated GELU,
  as T5 v1.1) as transformers' ``T5EncoderModel``, over a unigram ``T5Tokenizer`` trained here on a
  few sentences.
* Llama: a ``LlamaForCausalLM`` (hidden 32) over a byte-level BPE ``PreTrainedTokenizerFast`` that
  adds a BOS (HiDream-I1's fourth encoder).
* Gemma 3: a ``Gemma3ForConditionalGeneration`` (text hidden 32, a one-layer SigLIP tower it does not
  use for text) over a byte-fallback ``GemmaTokenizer`` with 128 positions (LTX-2's).

Each builder is cached: one process shares one encoder of each kind. Changing a seed, a config or a
vocabulary changes the tiny checkpoints built from them (bump their ``BUILD_FORMAT``).
"""

from __future__ import annotations

import functools
import json
import string
from typing import Any

import torch

#: Two prompts the T5 vocabulary is trained on, so their words are whole pieces; the coverage cases encode them.
PROMPTS = ("a red fox in the snow", "a lighthouse above a stormy sea")
DTYPE = torch.float32
CLIP_POSITIONS = 77
T5_MAX_LENGTH = 512  # the T5 tokenizers' model_max_length in FLUX.1, SD3 and HiDream checkpoints
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
_CLIP_TOWERS = {
    # tower: (hidden, heads, activation, seed)
    "L": (16, 2, "quick_gelu", 1),
    "G": (32, 4, "gelu", 2),
}
_T5_SEED, _LLAMA_SEED, _GEMMA3_SEED = 3, 4, 5


def _byte_symbols() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet())


def _seed_weights(seed: int) -> None:
    """Seed torch's global generator, which ``Model(config)`` draws its random weights from."""
    torch.manual_seed(seed)


# --- tokenizers -------------------------------------------------------------------------------


@functools.cache
def clip_tokenizer(pad_token: str = "<|endoftext|>") -> Any:
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
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=_T5_SPECIAL, unk_token="<unk>")
    unigram.train_from_iterator(_TRAINING_TEXT, trainer=trainer)
    return tuple((piece, score) for piece, score in json.loads(unigram.to_str())["model"]["vocab"])


@functools.cache
def t5_tokenizer(model_max_length: int = T5_MAX_LENGTH) -> Any:
    """T5's unigram tokenizer over the trained vocabulary, padding on the right."""
    from transformers import T5Tokenizer

    tokenizer = T5Tokenizer(vocab=list(_t5_vocab()), extra_ids=0, model_max_length=model_max_length)
    tokenizer.padding_side = "right"
    return tokenizer


@functools.cache
def llama_tokenizer() -> Any:
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
def gemma_tokenizer() -> Any:
    """Gemma's byte-fallback BPE (no merges here): specials, the 256 byte tokens, then ASCII characters."""
    from transformers import GemmaTokenizer

    vocab = {token: index for index, token in enumerate(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"))}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for symbol in ["▁", *string.ascii_letters, *string.digits, *string.punctuation]:
        vocab.setdefault(symbol, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[], model_max_length=GEMMA_MAX_LENGTH)


# --- encoders ---------------------------------------------------------------------------------


@functools.cache
def clip_encoder(tower: str, projection: bool) -> Any:
    """CLIP tower ``tower`` ("L" or "G") as ``CLIPTextModelWithProjection`` (``projection``) or ``CLIPTextModel``."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    hidden, heads, activation, seed = _CLIP_TOWERS[tower]
    tokenizer = clip_tokenizer()
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
    _seed_weights(seed)
    kind = CLIPTextModelWithProjection if projection else CLIPTextModel
    return kind(config).to(DTYPE).eval()


def t5_config() -> Any:
    """The tiny T5's config (a fresh object: callers may adjust it for their own encoder class)."""
    from transformers import T5Config

    tokenizer = t5_tokenizer()
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
def t5_encoder() -> Any:
    """The tiny T5 encoder, as transformers' ``T5EncoderModel``."""
    from transformers import T5EncoderModel

    _seed_weights(_T5_SEED)
    return T5EncoderModel(t5_config()).to(DTYPE).eval()


@functools.cache
def llama_encoder() -> Any:
    """The tiny Llama, as ``LlamaForCausalLM`` (HiDream-I1 reads its hidden states)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = llama_tokenizer()
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
    _seed_weights(_LLAMA_SEED)
    return LlamaForCausalLM(config).to(DTYPE).eval()


@functools.cache
def gemma3_encoder() -> Any:
    """The tiny Gemma 3, as ``Gemma3ForConditionalGeneration`` (LTX-2 reads every layer's hidden states)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = gemma_tokenizer()
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
    _seed_weights(_GEMMA3_SEED)
    return Gemma3ForConditionalGeneration(config).to(DTYPE).eval()
