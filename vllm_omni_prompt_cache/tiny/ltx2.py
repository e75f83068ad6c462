"""A tiny LTX-2.3 text-to-audio-video checkpoint: the real diffusers / transformers architectures, random weights.

:func:`ensure_tiny_ltx2` builds it once per :class:`TinyLTX2Spec` into a cache directory and reuses it
afterwards. It is laid out as the diffusers LTX-2.3 checkpoint is (``LTX2Pipeline`` model index), so
vLLM-Omni 0.30 detects version 2.3 (from the vocoder class) and loads it as its ``LTX2Pipeline``: the
one-stage 2.3 recipe (CFG, STG and modality guidance on) and the 2.3 component profile. Every part
the pipeline loads is here:

* the Gemma 3 text stack and its tokenizer of :mod:`.text_stacks` (the coverage matrix's LTX-2
  ones: hidden 32, two layers, a byte-fallback
  ``GemmaTokenizer`` with 128 positions), so the packed text features are 32 x 3 wide; the tokenizer
  is saved adding ``<bos>`` as Gemma 3's does, which verl-omni's LTX agent loop relies on;
* ``LTX2TextConnectors`` as 2.3 has them (per-modality projections, gated attention, learnable
  registers), projecting straight to the transformer's cross-attention widths;
* diffusers' ``LTX2VideoTransformer3DModel`` with 2.3's switches (gated attention, cross-attention
  modulation, perturbed attention, no caption projection); vLLM-Omni builds its own transformer
  from this config and loads these weights into it;
* ``AutoencoderKLLTX2Video`` (4x4 patchify and one spatio-temporal level: 8x spatial, 2x temporal),
  ``AutoencoderKLLTX2Audio``, ``LTX2VocoderWithBWE`` (16 kHz vocoder, 48 kHz bandwidth extension);
* a ``FlowMatchEulerDiscreteScheduler`` config with LTX's dynamic shifting and terminal shift (vLLM-Omni
  refuses a regular checkpoint without them).

Nothing is downloaded: configs are written here, weights come from fixed seeds. Weights are saved in
the spec's dtype (fp32 on a CPU, see ``qwen_image.native_dtype``); vLLM-Omni loads every LTX component
in the engine's dtype, so give it ``dtype="float32"`` on a CPU.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_omni_prompt_cache.tiny.qwen_image import (
    build_once,
    default_cache_dir,
    native_dtype,
    spec_digest,
    write_model_index,
)

if TYPE_CHECKING:
    import torch

BUILD_FORMAT = 1  # bump when the layout written below, or text_stacks' Gemma 3, changes

#: The video VAE's compression (4x4 patchify, then one spatio-temporal 2x level).
VAE_SCALE_FACTOR_SPATIAL = 8
VAE_SCALE_FACTOR_TEMPORAL = 2
#: The request the tests send. The smallest the pipeline accepts is 32x32 (LTX's check wants height and
#: width divisible by 32), one frame (num_frames = temporal factor x k + 1) and two steps (fewer are
#: raised to two); that runs too. Five frames are three latent frames and 5/24 s of audio is five audio
#: latent frames, so the temporal VAE path runs as well, for about the same cost.
TINY_HEIGHT = 32
TINY_WIDTH = 32
TINY_FRAMES = 5
TINY_FRAME_RATE = 24.0


@dataclass(frozen=True)
class TinyLTX2Spec:
    """Sizes of the tiny checkpoint; every field changes the cache directory it is built in."""

    heads: int = 2
    head_dim: int = 8  # video inner width 16: the video cross-attention width the connectors project to
    audio_heads: int = 2
    audio_head_dim: int = 4  # audio inner width 8
    transformer_layers: int = 2
    connector_layers: int = 1
    learnable_registers: int = 32  # must divide the padded prompt length (the tokenizer's 128)
    latent_channels: int = 4
    vae_channels: int = 8
    seed: int = 0
    #: The weights' dtype, which the engine must be given too (see ``qwen_image.checkpoint_dtype``).
    dtype: str = dataclasses.field(default_factory=lambda: native_dtype())

    def digest(self) -> str:
        """Return a short stable name for this spec (used as the directory name)."""
        return spec_digest(self, BUILD_FORMAT)


def ensure_tiny_ltx2(spec: TinyLTX2Spec | None = None, cache_dir: Path | None = None) -> Path:
    """Return the directory of the tiny LTX-2.3 checkpoint for ``spec``, building it on first use."""
    spec = spec or TinyLTX2Spec()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_once(root / "models" / f"tiny-ltx2-{spec.digest()}", lambda out: _build(spec, out))


def _build(spec: TinyLTX2Spec, out: Path) -> None:
    """Write the whole tiny LTX-2.3 checkpoint for ``spec`` into ``out``."""
    import torch

    dtype = getattr(torch, spec.dtype)
    text_config = _write_text_stack(dtype, out)
    video_width = spec.heads * spec.head_dim
    audio_width = spec.audio_heads * spec.audio_head_dim

    # The seeded weights are drawn in this order: connectors, audio VAE, transformer, video VAE, vocoder.
    torch.manual_seed(spec.seed)
    _write_connectors(spec, text_config, video_width, audio_width, dtype, out)
    audio_vae = _audio_vae()
    audio_latent_width = audio_vae.config.latent_channels * (
        audio_vae.config.mel_bins // audio_vae.mel_compression_ratio
    )
    _write_transformer(spec, text_config, video_width, audio_width, audio_latent_width, dtype, out)
    _save(_video_vae(spec), dtype, out / "vae")
    _save(audio_vae, dtype, out / "audio_vae")
    _write_vocoder(audio_vae, dtype, out)
    _write_scheduler(out)

    write_model_index(
        out,
        "LTX2Pipeline",
        {
            "audio_vae": ["diffusers", "AutoencoderKLLTX2Audio"],
            "connectors": ["ltx2", "LTX2TextConnectors"],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"],
            "tokenizer": ["transformers", "GemmaTokenizer"],
            "transformer": ["diffusers", "LTX2VideoTransformer3DModel"],
            "vae": ["diffusers", "AutoencoderKLLTX2Video"],
            "vocoder": ["ltx2", "LTX2VocoderWithBWE"],
        },
        spec,
    )


def _write_text_stack(dtype: torch.dtype, out: Path) -> Any:
    """Write the shared Gemma 3 tokenizer and text encoder; return the encoder's text config."""
    from vllm_omni_prompt_cache.tiny.text_stacks import gemma3_encoder, gemma_tokenizer

    # Gemma 3's own tokenizer puts <bos> first; verl-omni's LTX agent loop relies on it (add_special_tokens).
    tokenizer = copy.deepcopy(gemma_tokenizer())
    tokenizer.add_bos_token = True
    tokenizer.save_pretrained(out / "tokenizer")
    text_encoder = gemma3_encoder()
    _save(text_encoder, dtype, out / "text_encoder")
    return text_encoder.config.text_config


def _write_connectors(
    spec: TinyLTX2Spec, text_config: Any, video_width: int, audio_width: int, dtype: torch.dtype, out: Path
) -> None:
    """Build and write the 2.3 text connectors, projecting straight to the cross-attention widths."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    connectors = LTX2TextConnectors(
        caption_channels=text_config.hidden_size,
        text_proj_in_factor=text_config.num_hidden_layers + 1,  # every layer's states, and the embeddings
        video_connector_num_attention_heads=spec.heads,
        video_connector_attention_head_dim=spec.head_dim,
        video_connector_num_layers=spec.connector_layers,
        video_connector_num_learnable_registers=spec.learnable_registers,
        video_gated_attn=True,
        audio_connector_num_attention_heads=spec.audio_heads,
        audio_connector_attention_head_dim=spec.audio_head_dim,
        audio_connector_num_layers=spec.connector_layers,
        audio_connector_num_learnable_registers=spec.learnable_registers,
        audio_gated_attn=True,
        rope_type="split",
        per_modality_projections=True,
        video_hidden_dim=video_width,
        audio_hidden_dim=audio_width,
        proj_bias=True,
    )
    _save(connectors, dtype, out / "connectors")


def _audio_vae() -> Any:
    """Build the tiny audio VAE (unsaved: the transformer and vocoder are sized from it first)."""
    from diffusers import AutoencoderKLLTX2Audio

    return AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        mel_bins=8,
    )


def _write_transformer(
    spec: TinyLTX2Spec,
    text_config: Any,
    video_width: int,
    audio_width: int,
    audio_latent_width: int,
    dtype: torch.dtype,
    out: Path,
) -> None:
    """Build and write the audio-video transformer with 2.3's switches."""
    from diffusers import LTX2VideoTransformer3DModel

    transformer = LTX2VideoTransformer3DModel(
        in_channels=spec.latent_channels,
        out_channels=spec.latent_channels,
        num_attention_heads=spec.heads,
        attention_head_dim=spec.head_dim,
        cross_attention_dim=video_width,
        vae_scale_factors=(VAE_SCALE_FACTOR_TEMPORAL, VAE_SCALE_FACTOR_SPATIAL, VAE_SCALE_FACTOR_SPATIAL),
        gated_attn=True,
        cross_attn_mod=True,
        audio_in_channels=audio_latent_width,
        audio_out_channels=audio_latent_width,
        audio_num_attention_heads=spec.audio_heads,
        audio_attention_head_dim=spec.audio_head_dim,
        audio_cross_attention_dim=audio_width,
        audio_gated_attn=True,
        audio_cross_attn_mod=True,
        num_layers=spec.transformer_layers,
        caption_channels=text_config.hidden_size,
        rope_type="split",
        use_prompt_embeddings=False,  # 2.3: the connectors project to the cross-attention widths
        perturbed_attn=True,
    )
    _save(transformer, dtype, out / "transformer")


def _video_vae(spec: TinyLTX2Spec) -> Any:
    """Build the video VAE: 4x4 patchify and one spatio-temporal level (8x spatial, 2x temporal)."""
    from diffusers import AutoencoderKLLTX2Video

    return AutoencoderKLLTX2Video(
        latent_channels=spec.latent_channels,
        block_out_channels=(spec.vae_channels,),
        decoder_block_out_channels=(spec.vae_channels,),
        layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatiotemporal",),
        upsample_type=("spatiotemporal",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        patch_size=VAE_SCALE_FACTOR_SPATIAL // 2,
        patch_size_t=1,
        decoder_causal=False,
    )


def _write_vocoder(audio_vae: Any, dtype: torch.dtype, out: Path) -> None:
    """Build and write the 16 kHz vocoder with its 48 kHz bandwidth extension, sized from ``audio_vae``."""
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    bwe_mel_bins = 8  # the mel spectrogram the bandwidth extension computes from the 16 kHz waveform
    vocoder = LTX2VocoderWithBWE(
        in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins,
        hidden_channels=8,
        upsample_kernel_sizes=[8, 11, 16],
        upsample_factors=[4, 5, 8],  # 160 samples a mel frame: the audio VAE's hop at 16 kHz
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        bwe_in_channels=audio_vae.config.output_channels * bwe_mel_bins,
        bwe_hidden_channels=8,
        bwe_upsample_kernel_sizes=[12, 11, 16],
        bwe_upsample_factors=[6, 5, 8],  # 240 = the BWE hop (80) x the 48k / 16k ratio
        bwe_resnet_kernel_sizes=[3],
        bwe_resnet_dilations=[[1, 3, 5]],
        num_mel_channels=bwe_mel_bins,
    )
    _save(vocoder, dtype, out / "vocoder")


def _write_scheduler(out: Path) -> None:
    """Write the flow-matching scheduler config with LTX's dynamic shifting and terminal shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    ).save_pretrained(out / "scheduler")


def _save(module, dtype, target: Path) -> None:
    """Write a module's weights in ``dtype``; a copy is cast, as text_stacks shares its encoders."""
    import torch

    (module if dtype == torch.float32 else copy.deepcopy(module).to(dtype)).save_pretrained(target)
