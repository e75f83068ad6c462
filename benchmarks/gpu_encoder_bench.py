"""Hit path against one encode of Qwen-Image's real-size text encoder, on a GPU; prints a Markdown table.

    python benchmarks/gpu_encoder_bench.py                                  # H200: 28 layers, bf16, cuda
    python benchmarks/gpu_encoder_bench.py --device cpu --tiny --layers 1   # smoke run on a CPU

The encoder is the Qwen2.5-VL-7B text stack that Qwen-Image uses (transformers
``Qwen2_5_VLTextModel``: hidden 3584, 28 layers, 28 heads, 4 KV heads,
intermediate 18944, vocab 152064, rope theta 1e6), built from a config with
random weights (nothing is downloaded) directly on the target device, wrapped in
``TokenIdTextPipeline`` with our cache installed. Token ids and mask live on the
device, as an RL adapter collates them. Rows:

* one encode (uncached)       the original ``encode_prompt``, synchronized
* key build                   ``CallKeyBuilder.build`` on device ids + mask (includes the copy to the host)
* whole wrapped call, a hit   ``pipeline.encode_prompt`` on fresh device tensors of a cached prompt

Times are medians after warm-up (a GPU's first calls pay for kernel selection and clocks).
"""

from __future__ import annotations

import argparse
import inspect
import platform
import statistics
import time
from collections.abc import Callable

import torch
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

from vllm_omni_prompt_cache import CallKeyBuilder, install_prompt_embed_cache
from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline

#: Qwen-Image's text encoder (Qwen2.5-VL-7B-Instruct's text stack), as in its config.json.
QWEN_IMAGE = {"hidden": 3584, "intermediate": 18944, "heads": 28, "kv_heads": 4, "vocab": 152064, "layers": 28}
#: A few-MB stand-in with the same architecture, for smoke runs on a CPU.
TINY = {"hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2, "vocab": 4096, "layers": 2}


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="where the encoder and the token tensors live (default cuda)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--tiny", action="store_true", help=f"small defaults for the sizes not given: {TINY}")
    for name in QWEN_IMAGE:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=None, help=f"default {QWEN_IMAGE[name]} ({TINY[name]} with --tiny)")
    parser.add_argument("--tokens", type=int, default=512, help="prompt length in tokens (default 512)")
    parser.add_argument("--repeats", type=int, default=20, help="timed encodes (default 20); key and hit get 10x")
    parser.add_argument("--warmup", type=int, default=3, help="untimed encodes first (default 3)")
    arguments = parser.parse_args()
    preset = TINY if arguments.tiny else QWEN_IMAGE
    for name, value in preset.items():
        if getattr(arguments, name) is None:
            setattr(arguments, name, value)
    if arguments.hidden % arguments.heads or (arguments.hidden // arguments.heads) % 2:
        parser.error("--hidden must be a multiple of --heads with an even head size")
    return arguments


def build_text_encoder(arguments: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Return a random-weight Qwen2.5-VL text stack, created on ``device`` in ``dtype`` (no CPU detour)."""
    rope_half = arguments.hidden // arguments.heads // 2
    # Qwen2.5-VL splits the rotary half-dimension (t, h, w) as 16/24/24 of 64; scale that.
    mrope = [rope_half - 2 * (rope_half * 3 // 8), rope_half * 3 // 8, rope_half * 3 // 8]
    config = Qwen2_5_VLTextConfig(
        vocab_size=arguments.vocab,
        hidden_size=arguments.hidden,
        intermediate_size=arguments.intermediate,
        num_hidden_layers=arguments.layers,
        num_attention_heads=arguments.heads,
        num_key_value_heads=arguments.kv_heads,
        max_position_embeddings=128000,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope},
        dtype=dtype,
        bos_token_id=None,  # Qwen's special-token ids lie outside a --tiny vocabulary; no tokenizer here
        eos_token_id=None,
    )
    config._attn_implementation = "sdpa"  # what vLLM-Omni's transformers text encoder runs with
    torch.manual_seed(0)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # 15 GB of weights: allocate and initialise them on the GPU, not on the CPU first.
        with device:
            encoder = Qwen2_5_VLTextModel(config)
    finally:
        torch.set_default_dtype(previous_dtype)
    return encoder.eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(function: Callable[[], object], count: int, device: torch.device) -> list[float]:
    """Return the seconds each of ``count`` synchronized calls took."""
    seconds = []
    for _ in range(count):
        synchronize(device)
        start = time.perf_counter()
        function()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def milliseconds(seconds: list[float]) -> tuple[float, float]:
    """Return (median, min) in milliseconds."""
    return statistics.median(seconds) * 1e3, min(seconds) * 1e3


def main() -> None:
    arguments = parse_arguments()
    device = torch.device(arguments.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device (use --device cpu --tiny for a smoke run)")
    dtype = getattr(torch, arguments.dtype)

    start = time.perf_counter()
    encoder = build_text_encoder(arguments, device, dtype)
    synchronize(device)
    build_seconds = time.perf_counter() - start
    parameters = sum(p.numel() for p in encoder.parameters())

    pipeline = TokenIdTextPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=8)
    encode = pipeline._prompt_embed_cache_original_fn  # the uncached encode_prompt
    key_builder = CallKeyBuilder(inspect.signature(encode), type(pipeline).__name__)

    generator = torch.Generator().manual_seed(1)
    ids_cpu = torch.randint(1, arguments.vocab, (1, arguments.tokens), generator=generator)
    mask_cpu = ids_cpu != 0
    ids, mask = ids_cpu.to(device), mask_cpu.to(device)

    for _ in range(arguments.warmup):
        encode(ids, mask)
    encode_seconds = time_calls(lambda: encode(ids, mask), arguments.repeats, device)
    reference = encode(ids, mask)

    calls = 10 * arguments.repeats
    key_seconds = time_calls(lambda: key_builder.build((ids, mask), {}), calls, device)
    key_cpu_seconds = time_calls(lambda: key_builder.build((ids_cpu, mask_cpu), {}), calls, device)

    first = pipeline.encode_prompt(ids, mask)  # the one miss: fills the cache
    # Every RL sibling request collates fresh tensors; make them before the clock starts.
    fresh = [(ids.clone(), mask.clone()) for _ in range(calls)]
    synchronize(device)
    hits = iter(fresh)
    hit_seconds = time_calls(lambda: pipeline.encode_prompt(*next(hits)), calls, device)
    hit = pipeline.encode_prompt(ids.clone(), mask.clone())

    stats = cache.stats()
    exact = torch.equal(hit[0], reference[0]) and torch.equal(hit[1], reference[1])
    same_storage = hit[0].untyped_storage().data_ptr() == first[0].untyped_storage().data_ptr()

    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
    else:
        where = f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    print(
        f"{where}; torch {torch.__version__}, Python {platform.python_version()}; "
        f"Qwen2_5_VLTextModel {parameters / 1e6:,.1f}M params (layers {arguments.layers}, hidden {arguments.hidden}, "
        f"vocab {arguments.vocab}), {arguments.dtype}, random weights built on {device.type} in {build_seconds:.1f} s; "
        f"[1,{arguments.tokens}] int64 ids + bool mask on {device.type}"
    )
    print()
    encode_median, encode_min = milliseconds(encode_seconds)
    key_median, key_min = milliseconds(key_seconds)
    key_cpu_median, key_cpu_min = milliseconds(key_cpu_seconds)
    hit_median, hit_min = milliseconds(hit_seconds)
    print("| measurement | median (ms) | min (ms) | calls |")
    print("|---|---:|---:|---:|")
    print(f"| one encode, uncached | {encode_median:.3f} | {encode_min:.3f} | {len(encode_seconds)} |")
    if device.type != "cpu":
        label = f"key build, {device.type} ids+mask (device-to-host copy included)"
        print(f"| {label} | {key_median:.4f} | {key_min:.4f} | {calls} |")
    print(f"| key build, cpu ids+mask (no copy) | {key_cpu_median:.4f} | {key_cpu_min:.4f} | {calls} |")
    print(f"| whole wrapped call, a hit | {hit_median:.4f} | {hit_min:.4f} | {calls} |")
    print(f"| hit / encode (medians) | {hit_median / encode_median:.3%} | | |")
    print()
    print(
        f"cache: {stats['hits']} hits, {stats['misses']} miss, {stats['bypassed']} bypassed; "
        f"hit equal to the uncached encode: {exact}; hit shares the first result's storage: {same_storage}; "
        f"hit on {hit[0].device}"
    )
    if not (exact and same_storage and stats["misses"] == 1 and stats["bypassed"] == 0):
        raise SystemExit("error: the hit path did not behave as the cache promises (see the line above)")


if __name__ == "__main__":
    main()
