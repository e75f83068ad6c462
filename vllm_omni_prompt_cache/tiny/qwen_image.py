"""A tiny Qwen-Image checkpoint: the real diffusers / transformers architectures, random weights.

:func:`ensure_tiny_qwen_image` builds it once per :class:`TinyQwenImageSpec` into a cache
directory and reuses it afterwards. Tests, benchmarks and the demo share it; the demo picks a
larger text encoder so that encoding costs what it does in real rollouts. Nothing is downloaded:
configs are written here, weights come from a fixed seed, and the tokenizer is a byte-level BPE
trained locally on a few sentences.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: The chat template Qwen-Image wraps every prompt in; its first 34 tokens are dropped after
#: encoding, so the template alone must tokenize to more than 34 tokens.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
    "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
    "<|im_end|>\n<|im_start|>assistant\n"
)
TEMPLATE_DROP_TOKENS = 34
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BUILD_FORMAT = 3  # bump when the layout written below changes

#: Prompts of the kind the tokenizer is trained on; the demo's rollout uses them too.
SAMPLE_PROMPTS = (
    "a red fox sitting in a snowy forest at dawn, soft light, detailed fur",
    "a watercolor painting of a lighthouse on a cliff above a stormy sea",
    "a bowl of ramen with a soft boiled egg, steam rising, studio photograph",
    "an astronaut riding a horse across a desert of glass, cinematic lighting",
    "a small wooden cabin beside a mountain lake, reflections, golden hour",
    "a robot reading a book in a library full of plants, isometric illustration",
    "a street market at night with paper lanterns and rain on the stones",
    "a glass teapot with blooming tea flowers on a wooden table, macro photo",
    "a snow leopard on a rocky ridge under the milky way",
    "an old map of an imaginary archipelago with sea monsters, ink drawing",
    "a field of sunflowers under a thunderstorm, dramatic clouds",
    "a cozy reading nook with a cat asleep on a pile of books",
)
SAMPLE_NEGATIVE_PROMPT = "blurry, low quality, distorted, watermark, text, bad anatomy"
# Enough text for merges that make prompts a few dozen tokens long.
_TRAINING_TEXT = [PROMPT_TEMPLATE, *SAMPLE_PROMPTS, SAMPLE_NEGATIVE_PROMPT]


@dataclass(frozen=True)
class TinyQwenImageSpec:
    """Sizes of the tiny checkpoint; every field changes the cache directory it is built in."""

    text_hidden_size: int = 64
    text_layers: int = 2
    text_heads: int = 4
    text_intermediate_size: int = 128
    vocab_size: int = 512
    transformer_layers: int = 2
    transformer_heads: int = 2
    transformer_head_dim: int = 32
    vae_base_dim: int = 16
    seed: int = 0
    #: The weights' dtype, which the engine must be given too (see :func:`checkpoint_dtype`).
    dtype: str = dataclasses.field(default_factory=lambda: native_dtype())

    def digest(self) -> str:
        """Return a short stable name for this spec (used as the directory name)."""
        return spec_digest(self, BUILD_FORMAT)


def native_dtype() -> str:
    """Return the dtype small models run in here: bf16 on a GPU, fp32 on a CPU.

    Many CPUs (AVX2-only ones, most laptops) have no bf16 units: there bf16 convolutions and
    matmuls are emulated, ~100x slower than fp32 (a 512x512 VAE decode: ~2 min against ~2 s).
    """
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def checkpoint_dtype(model_dir: str | os.PathLike) -> str | None:
    """Return the dtype a diffusers checkpoint's text encoder was saved in, or None if it says none.

    vLLM-Omni builds the denoiser in bf16 unless told otherwise; an engine for an fp32 checkpoint
    must be given ``dtype="float32"`` or its matmuls fail with mismatched dtypes.
    """
    config_path = Path(model_dir) / "text_encoder" / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    dtype = config.get("torch_dtype") or config.get("dtype")
    return dtype if isinstance(dtype, str) else None


def default_cache_dir() -> Path:
    """Return where built models are kept: $VLLM_OMNI_PROMPT_CACHE_HOME or ~/.cache/vllm-omni-prompt-cache."""
    explicit = os.environ.get("VLLM_OMNI_PROMPT_CACHE_HOME")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm-omni-prompt-cache"


def ensure_tiny_qwen_image(spec: TinyQwenImageSpec | None = None, cache_dir: Path | None = None) -> Path:
    """Return the directory of the tiny checkpoint for ``spec``, building it on first use."""
    spec = spec or TinyQwenImageSpec()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_once(root / "models" / f"tiny-qwen-image-{spec.digest()}", lambda out: _build(spec, out))


def spec_digest(spec: Any, build_format: int, **extra: Any) -> str:
    """Return a short stable name for ``spec`` built by layout ``build_format`` (its directory's name)."""
    payload = json.dumps({"format": build_format, **extra, **dataclasses.asdict(spec)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def write_model_index(out: Path, pipeline_class: str, components: dict[str, Any], spec: Any) -> None:
    """Write the checkpoint's ``model_index.json`` (diffusers' component list) and the spec it was built from."""
    import diffusers

    index = {"_class_name": pipeline_class, "_diffusers_version": diffusers.__version__, **components}
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    (out / "tiny_spec.json").write_text(json.dumps(dataclasses.asdict(spec), indent=2))


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Return ``target``, a model directory ``build`` writes into a staging folder renamed into place."""
    if (target / "model_index.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)  # atomic: concurrent builders race, one wins, all see a whole model
        except OSError:
            if not (target / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def register_one_stage_pipeline(key: str) -> None:
    """Register a one-stage Qwen-Image diffusion pipeline under ``key`` (once per process).

    vLLM-Omni applies a deploy config's stages only to a registered pipeline, and a tiny model's
    directory names none, so tests and stand-ins that hand it a deploy config register one first.
    """
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, register_pipeline
    from vllm_omni.config.stage_config import PipelineConfig, StageExecutionType, StagePipelineConfig

    if key in OMNI_PIPELINES:
        return
    stage = StagePipelineConfig(
        stage_id=0,
        model_stage="diffusion",
        execution_type=StageExecutionType.DIFFUSION,
        final_output=True,
        final_output_type="image",
        model_arch="QwenImagePipeline",
    )
    register_pipeline(PipelineConfig(model_type=key, model_arch="QwenImagePipeline", stages=(stage,)))


def check_model_dir(path: str | os.PathLike) -> Path:
    """Return ``path`` if it holds a readable diffusers Qwen-Image checkpoint; raise a clear error if not."""
    directory = Path(path)
    if not directory.exists():
        raise FileNotFoundError(f"model directory {str(directory)!r} does not exist")
    if not directory.is_dir():
        raise NotADirectoryError(f"model path {str(directory)!r} is not a directory")
    index = directory / "model_index.json"
    if not os.access(directory, os.R_OK | os.X_OK) or (index.exists() and not os.access(index, os.R_OK)):
        raise PermissionError(f"model directory {str(directory)!r} is not readable")
    if not index.is_file():
        raise FileNotFoundError(
            f"model directory {str(directory)!r} has no model_index.json: not a diffusers pipeline checkpoint"
        )
    missing = [
        name
        for name in ("text_encoder", "tokenizer", "transformer", "vae", "scheduler")
        if not (directory / name).is_dir()
    ]
    if missing:
        raise FileNotFoundError(f"model directory {str(directory)!r} lacks the sub-folders {missing}")
    return directory


def _build(spec: TinyQwenImageSpec, out: Path) -> None:
    """Write the whole tiny Qwen-Image checkpoint for ``spec`` into ``out``."""
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
        "QwenImagePipeline",
        {
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
            "tokenizer": ["transformers", "Qwen2Tokenizer"],
            "transformer": ["diffusers", "QwenImageTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKLQwenImage"],
        },
        spec,
    )


def _text_encoder_config(spec: TinyQwenImageSpec, tokenizer: Any) -> Any:
    """Build the Qwen2.5-VL config of the text encoder, sized to ``spec`` and ``tokenizer``."""
    from transformers import Qwen2_5_VLConfig

    head_dim = spec.text_hidden_size // spec.text_heads
    rope_half = head_dim // 2  # mrope sections split the rotary half-dimension into (t, h, w)
    mrope = [rope_half - 2 * (rope_half * 3 // 8), rope_half * 3 // 8, rope_half * 3 // 8]
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.text_hidden_size,
        "intermediate_size": spec.text_intermediate_size,
        "num_hidden_layers": spec.text_layers,
        "num_attention_heads": spec.text_heads,
        "num_key_value_heads": max(1, spec.text_heads // 2),
        "max_position_embeddings": 4096,
        "rope_scaling": {"type": "mrope", "mrope_section": mrope},
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope},
        "torch_dtype": spec.dtype,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": spec.text_hidden_size,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "fullatt_block_indexes": [0],
        "window_size": 112,
    }
    return Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, **text_config)


def _write_text_encoder(spec: TinyQwenImageSpec, tokenizer: Any, dtype: torch.dtype, out: Path) -> None:
    """Build and write the Qwen2.5-VL text encoder in ``dtype``."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = _text_encoder_config(spec, tokenizer)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).to(dtype)
    text_encoder.save_pretrained(out / "text_encoder", safe_serialization=True)


def _write_transformer(spec: TinyQwenImageSpec, dtype: torch.dtype, out: Path) -> None:
    """Build and write the Qwen-Image denoising transformer in ``dtype``."""
    from diffusers import QwenImageTransformer2DModel

    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=spec.transformer_layers,
        attention_head_dim=spec.transformer_head_dim,
        num_attention_heads=spec.transformer_heads,
        joint_attention_dim=spec.text_hidden_size,
        axes_dims_rope=(8, 12, 12),
    ).to(dtype)
    transformer.save_pretrained(out / "transformer", safe_serialization=True)


def _write_vae(spec: TinyQwenImageSpec, dtype: torch.dtype, out: Path) -> None:
    """Build and write the Qwen-Image VAE in ``dtype``."""
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage(
        base_dim=spec.vae_base_dim,
        z_dim=4,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    ).to(dtype)
    vae.save_pretrained(out / "vae", safe_serialization=True)


def _write_scheduler(out: Path) -> None:
    """Write the flow-matching scheduler config with Qwen-Image's exponential dynamic shifting."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    ).save_pretrained(out / "scheduler")


def _build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_TRAINING_TEXT, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.padding_side = "right"
    return tokenizer


def load_tokenizer(model_dir: str | os.PathLike):
    """Return the checkpoint's tokenizer (what an RL client uses to build prompt token ids)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(model_dir) / "tokenizer", local_files_only=True)


def prompt_token_ids(tokenizer, prompt: str) -> list[int]:
    """Return the token ids of ``prompt`` wrapped in Qwen-Image's template, as verl-omni sends them."""
    return tokenizer(PROMPT_TEMPLATE.format(prompt), add_special_tokens=False)["input_ids"]
