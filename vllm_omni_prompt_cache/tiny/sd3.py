"""A tiny Stable Diffusion 3.5 Medium checkpoint: the real diffusers / transformers architectures, random weights.

:func:`ensure_tiny_sd3` builds it once per :class:`TinySD3Spec` into a cache directory and reuses it
afterwards. It is laid out as the diffusers ``stabilityai/stable-diffusion-3.5-medium`` checkpoint
is, so vLLM-Omni loads it as a ``StableDiffusion3Pipeline``: two ``CLIPTextModelWithProjection``
towers (CLIP-L, CLIP-G) with their ``CLIPTokenizer`` s, a ``T5EncoderModel`` with its
``T5Tokenizer``, an ``SD3Transformer2DModel`` with SD3.5 Medium's MMDiT-X traits (a dual-attention
first block, RMS q/k norm), a 16-channel ``AutoencoderKL`` with SD3's scaling and shift, and a
``FlowMatchEulerDiscreteScheduler`` with SD3's shift of 3.

The three text stacks and their tokenizers are :mod:`.text_stacks`' (the ones the coverage matrix
builds SD3 on: CLIP-L hidden 16, CLIP-G hidden 32, so the
pooled projection is 48 wide; T5 d_model 64, which the transformer's joint attention takes). The
CLIP tokenizers give one token per character over 77 positions; CLIP-G's pads with ``!`` as SD3's
second tokenizer does. Everything is fp32: on CPUs without bf16 units bf16 is emulated, ~100x
slower. Nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni_prompt_cache.tiny.qwen_image import build_once, default_cache_dir, spec_digest, write_model_index

BUILD_FORMAT = 1  # bump when the layout written below, or the text stacks it reuses, change

#: The VAE's four blocks downsample 2x three times, and the transformer patchifies 2x2: requested
#: heights and widths must be multiples of 16.
VAE_SCALE_FACTOR = 8
TRANSFORMER_PATCH_SIZE = 2
SIZE_MULTIPLE = VAE_SCALE_FACTOR * TRANSFORMER_PATCH_SIZE
#: SD3's latent normalisation (the real VAE's config values).
VAE_SCALING_FACTOR = 1.5305
VAE_SHIFT_FACTOR = 0.0609
#: The T5 length SD3 pads prompts to by default, and the CLIP tokenizers' length.
MAX_SEQUENCE_LENGTH = 256
CLIP_MAX_LENGTH = 77
DTYPE = "float32"


@dataclass(frozen=True)
class TinySD3Spec:
    """Sizes of the tiny denoiser and VAE; every field changes the cache directory it is built in."""

    transformer_layers: int = 2
    transformer_heads: int = 2
    transformer_head_dim: int = 16
    #: Room for a 1024x1024 request (64x64 patches); the engine's warm-up is 512x512.
    pos_embed_max_size: int = 64
    vae_channels: tuple[int, ...] = (8, 16, 16, 16)
    seed: int = 0

    def digest(self) -> str:
        """Return a short stable name for this spec (used as the directory name)."""
        return spec_digest(self, BUILD_FORMAT, dtype=DTYPE)


def ensure_tiny_sd3(spec: TinySD3Spec | None = None, cache_dir: Path | None = None) -> Path:
    """Return the directory of the tiny SD3.5 Medium checkpoint for ``spec``, building it on first use."""
    spec = spec or TinySD3Spec()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_once(root / "models" / f"tiny-sd3-{spec.digest()}", lambda out: _build(spec, out))


def _build(spec: TinySD3Spec, out: Path) -> None:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    from vllm_omni_prompt_cache.tiny.text_stacks import clip_encoder, clip_tokenizer, t5_encoder, t5_tokenizer

    # The text stacks: the tokenizers carry the lengths the pipeline pads to (CLIP's 77, T5's 512).
    clip_tokenizer().save_pretrained(out / "tokenizer")
    clip_tokenizer("!").save_pretrained(out / "tokenizer_2")
    t5_tokenizer().save_pretrained(out / "tokenizer_3")
    clip_l = clip_encoder("L", projection=True)
    clip_g = clip_encoder("G", projection=True)
    t5 = t5_encoder()
    for name, encoder in (("text_encoder", clip_l), ("text_encoder_2", clip_g), ("text_encoder_3", t5)):
        encoder.save_pretrained(out / name, safe_serialization=True)

    torch.manual_seed(spec.seed)
    inner_dim = spec.transformer_heads * spec.transformer_head_dim
    SD3Transformer2DModel(
        sample_size=64,
        patch_size=TRANSFORMER_PATCH_SIZE,
        in_channels=16,
        out_channels=16,
        num_layers=spec.transformer_layers,
        attention_head_dim=spec.transformer_head_dim,
        num_attention_heads=spec.transformer_heads,
        joint_attention_dim=t5.config.d_model,
        caption_projection_dim=inner_dim,  # SD3 embeds the text straight into the joint width
        pooled_projection_dim=clip_l.config.projection_dim + clip_g.config.projection_dim,
        pos_embed_max_size=spec.pos_embed_max_size,
        dual_attention_layers=(0,),  # SD3.5 Medium's MMDiT-X: the first blocks attend twice
        qk_norm="rms_norm",
    ).save_pretrained(out / "transformer", safe_serialization=True)

    blocks = len(spec.vae_channels)
    AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=spec.vae_channels,
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=min(spec.vae_channels),
        sample_size=64,
        scaling_factor=VAE_SCALING_FACTOR,
        shift_factor=VAE_SHIFT_FACTOR,
        use_quant_conv=False,  # SD3's VAE has neither quant conv
        use_post_quant_conv=False,
    ).save_pretrained(out / "vae", safe_serialization=True)

    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0).save_pretrained(out / "scheduler")

    write_model_index(
        out,
        "StableDiffusion3Pipeline",
        {
            "feature_extractor": [None, None],
            "image_encoder": [None, None],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
            "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
            "text_encoder_3": ["transformers", "T5EncoderModel"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "tokenizer_2": ["transformers", "CLIPTokenizer"],
            "tokenizer_3": ["transformers", "T5TokenizerFast"],
            "transformer": ["diffusers", "SD3Transformer2DModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        },
        spec,
    )


def load_tokenizers(model_dir: str | Path) -> tuple[Any, Any]:
    """Return the checkpoint's CLIP-L and T5 tokenizers: what verl-omni's ``extra_tokenizers`` name for SD3."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    clip = AutoTokenizer.from_pretrained(model_dir / "tokenizer", local_files_only=True)
    t5 = AutoTokenizer.from_pretrained(model_dir / "tokenizer_3", local_files_only=True)
    return clip, t5


def rollout_request(tokenizers: tuple[Any, Any], text: str, negative: str | None = None) -> dict[str, Any]:
    """Return the request verl-omni's agent loop and server send for ``text`` (and ``negative``, if any).

    Each tokenizer runs once per text, with special tokens, unpadded, cut to its length (CLIP 77,
    T5 :data:`MAX_SEQUENCE_LENGTH`, as verl-omni's SD3 scripts configure them). The primary ids
    (SD3's first tokenizer's) travel too; the adapter reads only the per-encoder ones. Without a
    negative (verl-omni's SD3 datasets have none) the adapter encodes "" as text under CFG.
    """
    request = _token_fields(tokenizers, text, "prompt_token_ids", "extra_prompt_ids")
    if negative is not None:
        request.update(_token_fields(tokenizers, negative, "negative_prompt_ids", "negative_extra_prompt_ids"))
    return request


def _token_fields(tokenizers: tuple[Any, Any], text: str, primary: str, per_encoder: str) -> dict[str, Any]:
    clip, t5 = tokenizers
    clip_ids = clip(text, add_special_tokens=True, truncation=True, max_length=CLIP_MAX_LENGTH)["input_ids"]
    t5_ids = t5(text, add_special_tokens=True, truncation=True, max_length=MAX_SEQUENCE_LENGTH)["input_ids"]
    return {primary: list(clip_ids), per_encoder: {"clip": list(clip_ids), "t5": list(t5_ids)}}
