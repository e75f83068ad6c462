"""Key-build and hit-path micro benchmarks, side by side in one run; prints a Markdown table.

    python benchmarks/bench_keys.py [--quick]

Each key variant starts from the same bound arguments of an ``encode_prompt``
call and ends with the Python hash a dict lookup needs:

* ours          ``CallKeyBuilder.build_from_arguments`` (xxh3-128 digest + witness) + hash
* raw bytes     ``(dtype, shape, device, tensor.cpu().numpy().tobytes())`` per tensor + hash
* list          the adapter workaround: ``tensor.tolist()`` turned into tuples + hash
* bare xxh3     ``xxh3_128_digest`` of each tensor's bytes, nothing else: the floor

Times are the best of several repeats (least disturbed by other load on the machine).
"""

from __future__ import annotations

import argparse
import inspect
import platform
import timeit
from collections.abc import Callable

import torch
import xxhash

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.keys import CallKeyBuilder
from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder


def encode_prompt(
    prompt_ids,
    attention_mask=None,
    num_images_per_prompt=1,
    max_sequence_length=512,
    device=None,
    dtype=None,
):
    """The shape of verl-omni's token-ID encode_prompt call (signature only)."""


def raw_bytes_key(arguments: dict) -> int:
    parts = []
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            value = (value.dtype, tuple(value.shape), str(value.device), value.cpu().numpy().tobytes())
        parts.append((name, value))
    return hash(tuple(parts))


def list_key(arguments: dict) -> int:
    parts = []
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            value = tuple(map(tuple, value.tolist()))
        parts.append((name, value))
    return hash(tuple(parts))


def bare_xxh3(arguments: dict) -> list[bytes]:
    return [xxhash.xxh3_128_digest(v.numpy()) for v in arguments.values() if isinstance(v, torch.Tensor)]


def best_microseconds(function: Callable[[], object], repeat: int, number: int) -> float:
    return min(timeit.repeat(function, number=number, repeat=repeat)) / number * 1e6


def bound_call(batch: int, length: int) -> dict:
    ids = torch.randint(1, 150_000, (batch, length), dtype=torch.int64)
    arguments = inspect.signature(encode_prompt).bind(ids, ids != 0, 1, length, torch.device("cpu"), torch.bfloat16)
    arguments.apply_defaults()
    return dict(arguments.arguments)


def key_rows(quick: bool) -> list[tuple[str, str, float, str]]:
    signature = inspect.signature(encode_prompt)
    builder = CallKeyBuilder(signature, "QwenImagePipeline")
    repeat = 3 if quick else 7
    rows = []
    for batch, length in ((1, 512), (16, 1024)):
        arguments = bound_call(batch, length)
        number = 2000 if batch == 1 else 200
        if quick:
            number //= 10
        variants = {
            "ours (xxh3-128 + witness)": lambda a=arguments: hash(builder.build_from_arguments(a).identity),
            "raw-bytes tuple key": lambda a=arguments: raw_bytes_key(a),
            "list workaround (.tolist())": lambda a=arguments: list_key(a),
            "bare xxh3-128 over the bytes": lambda a=arguments: bare_xxh3(a),
        }
        times = {name: best_microseconds(fn, repeat, number) for name, fn in variants.items()}
        ours = times["ours (xxh3-128 + witness)"]
        for name, micros in times.items():
            ratio = "1.0x" if name.startswith("ours") else f"ours is {micros / ours:.2f}x faster"
            if name.startswith("bare"):
                ratio = f"ours takes {ours / micros:.2f}x as long"
            rows.append((f"[{batch},{length}] ids+mask", name, micros, ratio))
        bind = best_microseconds(lambda a=arguments: signature.bind(*a.values()), repeat, number)
        rows.append((f"[{batch},{length}] ids+mask", "(signature bind, same for all)", bind, ""))
    return rows


def hit_rows(quick: bool) -> list[tuple[str, str, float, str]]:
    encoder = build_qwen2_encoder(vocab_size=32_000, hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6)
    parameters = sum(p.numel() for p in encoder.parameters())
    pipeline = TokenIdTextPipeline(encoder)
    install_prompt_embed_cache(pipeline, max_size=8)
    ids = torch.randint(1, 32_000, (1, 512))
    mask = ids != 0
    pipeline.encode_prompt(ids, mask)  # fill the cache
    original = pipeline._prompt_embed_cache_original_fn
    repeat = 3 if quick else 5
    encode = best_microseconds(lambda: original(ids.clone(), mask.clone()), repeat, 2 if quick else 5)
    hit = best_microseconds(lambda: pipeline.encode_prompt(ids.clone(), mask.clone()), repeat, 200)
    label = f"[1,512] {parameters / 1e6:.1f}M-param Qwen2 encoder"
    return [
        (label, "one encode (uncached)", encode, ""),
        (label, "whole wrapper call on a hit", hit, f"{hit / encode:.3%} of an encode"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (for a smoke run)")
    quick = parser.parse_args().quick
    torch.set_num_threads(torch.get_num_threads())
    print(
        f"torch {torch.__version__}, xxhash {xxhash.VERSION}, Python {platform.python_version()}, "
        f"{torch.get_num_threads()} threads, {platform.machine()}"
    )
    print()
    print("| input | variant | best time (us) | comparison |")
    print("|---|---|---:|---|")
    for row in key_rows(quick) + hit_rows(quick):
        print(f"| {row[0]} | {row[1]} | {row[2]:,.2f} | {row[3]} |")


if __name__ == "__main__":
    main()
