"""A tiny Wan2.2 text-to-video checkpoint: the real diffusers / transformers architectures, random weights.

:func:`ensure_tiny_wan22` builds it once per :class:`TinyWan22Spec` into a cache directory and reuses
it afterwards. It is laid out as the diffusers Wan2.2-TI2V-5B checkpoint is, so vLLM-Omni loads it
as a ``WanPipeline`` (its ``Wan22Pipeline``): ``expand_timesteps`` on, one transformer (no
``transformer_2``), a ``UMT5EncoderModel`` text encoder, the Wan2.2 VAE (residual, patchified,
16x spatial and 4x temporal compression) and a UniPC scheduler config. Nothing is downloaded:
configs are written here, weights come from a fixed seed, and the tokenizer is a unigram model
trained locally on a few sentences and saved as transformers' ``T5Tokenizer``.
"""

from __future__ import annotations

import dataclasses
import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_omni_prompt_cache.tiny.qwen_image import (
    SAMPLE_NEGATIVE_PROMPT,
    SAMPLE_PROMPTS,
    build_once,
    default_cache_dir,
    native_dtype,
    spec_digest,
    write_model_index,
)

if TYPE_CHECKING:
    import torch

BUILD_FORMAT = 1  # bump when the layout written below changes

#: The VAE's compression, as its config states it (the pipeline reads these two fields).
VAE_SCALE_FACTOR_SPATIAL = 16  # three 2x downsamples times the 2x2 patchify of the Wan2.2 VAE
VAE_SCALE_FACTOR_TEMPORAL = 4  # two 2x temporal downsamples
TRANSFORMER_PATCH_SIZE = (1, 2, 2)

#: The smallest request the pipeline accepts: it floors height and width to multiples of
#: VAE spatial factor x patch (16 x 2 = 32), and frames to 4k + 1.
TINY_HEIGHT = VAE_SCALE_FACTOR_SPATIAL * TRANSFORMER_PATCH_SIZE[1]
TINY_WIDTH = VAE_SCALE_FACTOR_SPATIAL * TRANSFORMER_PATCH_SIZE[2]
#: Five frames are two latent frames: the smallest video that exercises the temporal VAE path
#: (one frame is accepted too, and decodes to a still).
TINY_FRAMES = VAE_SCALE_FACTOR_TEMPORAL + 1
#: The tokenizer's model_max_length, and the padded length Wan2.2's encode_prompt uses by default.
MAX_SEQUENCE_LENGTH = 512

SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]  # T5's order: pad 0, eos 1, unk 2
# Every printable ASCII character, so that any English prompt tokenizes without <unk>.
_TRAINING_TEXT = [*SAMPLE_PROMPTS, SAMPLE_NEGATIVE_PROMPT, " ".join(string.printable.strip())]


@dataclass(frozen=True)
class TinyWan22Spec:
    """Sizes of the tiny checkpoint; every field changes the cache directory it is built in."""

    text_d_model: int = 32
    text_layers: int = 2
    text_heads: int = 4
    text_d_ff: int = 64
    vocab_size: int = 256  # the trainer's target; the encoder is sized to what it produces
    transformer_layers: int = 2
    transformer_heads: int = 2
    #: Wan's 3-D rope splits the head into (t, h, w) thirds of even size: a multiple of 6.
    transformer_head_dim: int = 12
    transformer_ffn_dim: int = 48
    z_dim: int = 4
    vae_base_dim: int = 8
    seed: int = 0
    #: The weights' dtype, which the engine must be given too (see ``qwen_image.checkpoint_dtype``).
    dtype: str = dataclasses.field(default_factory=lambda: native_dtype())

    def digest(self) -> str:
        """Return a short stable name for this spec (used as the directory name)."""
        return spec_digest(self, BUILD_FORMAT)


def ensure_tiny_wan22(spec: TinyWan22Spec | None = None, cache_dir: Path | None = None) -> Path:
    """Return the directory of the tiny Wan2.2 checkpoint for ``spec``, building it on first use."""
    spec = spec or TinyWan22Spec()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_once(root / "models" / f"tiny-wan22-{spec.digest()}", lambda out: _build(spec, out))


def _build(spec: TinyWan22Spec, out: Path) -> None:
    """Write the whole tiny Wan2.2 checkpoint for ``spec`` into ``out``."""
    import torch

    # The seeded weights are drawn in this order: text encoder, transformer, VAE.
    torch.manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    tokenizer = _build_tokenizer(spec.vocab_size)
    tokenizer.save_pretrained(out / "tokenizer")
    _write_text_encoder(spec, tokenizer, dtype, out)
    _write_transformer(spec, dtype, out)
    _write_vae(spec, dtype, out)
    _write_scheduler(out)

    write_model_index(
        out,
        "WanPipeline",
        {
            "boundary_ratio": None,
            "expand_timesteps": True,
            "scheduler": ["diffusers", "UniPCMultistepScheduler"],
            "text_encoder": ["transformers", "UMT5EncoderModel"],
            "tokenizer": ["transformers", "T5Tokenizer"],
            "transformer": ["diffusers", "WanTransformer3DModel"],
            "transformer_2": [None, None],
            "vae": ["diffusers", "AutoencoderKLWan"],
        },
        spec,
    )


def _write_text_encoder(spec: TinyWan22Spec, tokenizer: Any, dtype: torch.dtype, out: Path) -> None:
    """Build and write the UMT5 text encoder, its vocabulary sized to ``tokenizer``."""
    from transformers import UMT5Config, UMT5EncoderModel

    text_config = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=spec.text_d_model,
        d_kv=spec.text_d_model // spec.text_heads,
        d_ff=spec.text_d_ff,
        num_layers=spec.text_layers,
        num_heads=spec.text_heads,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    _cast(UMT5EncoderModel(text_config), dtype).save_pretrained(out / "text_encoder", safe_serialization=True)


def _write_transformer(spec: TinyWan22Spec, dtype: torch.dtype, out: Path) -> None:
    """Build and write the Wan2.2 denoising transformer (one, as TI2V-5B has)."""
    from diffusers import WanTransformer3DModel

    transformer = WanTransformer3DModel(
        patch_size=TRANSFORMER_PATCH_SIZE,
        num_attention_heads=spec.transformer_heads,
        attention_head_dim=spec.transformer_head_dim,
        in_channels=spec.z_dim,  # TI2V blends the image latent in, so in = out = z_dim
        out_channels=spec.z_dim,
        text_dim=spec.text_d_model,
        freq_dim=256,
        ffn_dim=spec.transformer_ffn_dim,
        num_layers=spec.transformer_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    )
    _cast(transformer, dtype).save_pretrained(out / "transformer", safe_serialization=True)


def _write_vae(spec: TinyWan22Spec, dtype: torch.dtype, out: Path) -> None:
    """Build and write the Wan2.2 VAE: residual, patchified, 16x spatial and 4x temporal compression."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(
        base_dim=spec.vae_base_dim,
        decoder_base_dim=spec.vae_base_dim,
        z_dim=spec.z_dim,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * spec.z_dim,
        latents_std=[1.0] * spec.z_dim,
        is_residual=True,
        in_channels=12,  # RGB after the 2x2 patchify
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=VAE_SCALE_FACTOR_SPATIAL,
        scale_factor_temporal=VAE_SCALE_FACTOR_TEMPORAL,
    )
    _cast(vae, dtype).save_pretrained(out / "vae", safe_serialization=True)


def _write_scheduler(out: Path) -> None:
    """Write the UniPC flow-prediction scheduler config."""
    from diffusers import UniPCMultistepScheduler

    # The stock pipeline builds its own UniPC scheduler in code; RL adapters load this one.
    UniPCMultistepScheduler(
        num_train_timesteps=1000,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=5.0,
    ).save_pretrained(out / "scheduler")


def _cast(module, dtype):
    """Return ``module`` in ``dtype``; fp32 modules are left alone (diffusers warns on every cast)."""
    import torch

    return module if dtype == torch.float32 else module.to(dtype)


def _build_tokenizer(vocab_size: int):
    """Train a unigram tokenizer as T5's is (metaspace, pad/eos/unk first) and wrap it as T5Tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5Tokenizer

    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, unk_token="<unk>")
    unigram.train_from_iterator(_TRAINING_TEXT, trainer=trainer)
    vocab = [(piece, score) for piece, score in json.loads(unigram.to_str())["model"]["vocab"]]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=MAX_SEQUENCE_LENGTH)
    tokenizer.padding_side = "right"
    return tokenizer
