"""What keying a value costs in the upstream series' PR 1, by kind of value: the numbers that decide its scope.

    python benchmarks/upstream_key_scope.py [--rounds 200] [--write FILE]

PR 1 keys tensors, numpy arrays and PIL images by dtype (mode), shape and a blake3 digest of their CPU bytes,
and an entry's key keeps a copy of those bytes (its witness, compared on every hit). For each value below it
builds the key of an ``encode_prompt`` call taking that value (``_build_key``, fresh values each call, as a
rollout's siblings send them) and reports the median time, the bytes copied to the host per call (a value
on a GPU is copied once; on the CPU a contiguous value is read in place) and the host bytes an entry keeps.
On a machine with CUDA the tensors are also keyed from the GPU. The module is PR 1's, applied to a copy of
the installed vLLM-Omni's (``upstream/check/run_series.py``). Values:

* int64 token ids ``[1, 512]`` and their bool mask: what rollout adapters pass (verl-omni's Qwen-Image);
* a float tensor of a latent's size, ``[1, 16, 1, 128, 128]`` (Qwen-Image at 1024x1024), fp32 and bf16;
* a 1024x1024 RGB PIL image: the input image-edit pipelines pass to ``encode_prompt`` (Qwen-Image-Edit).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent


def _pr1_module() -> Any:
    spec = importlib.util.spec_from_file_location("upstream_run_series", ROOT / "upstream" / "check" / "run_series.py")
    series = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = series
    spec.loader.exec_module(series)
    package = Path(importlib.util.find_spec("vllm_omni").origin).parent
    path = series.step_module(package, Path(tempfile.mkdtemp(prefix="pr1-")), 1)
    spec = importlib.util.spec_from_file_location("upstream_pr1_prompt_embed_cache", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _values(device: str) -> dict[str, Callable[[], Any]]:
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 150_000, (1, 512), generator=generator)
    latent = torch.randn(1, 16, 1, 128, 128, generator=generator)
    values: dict[str, Callable[[], Any]] = {
        "int64 ids [1,512] + bool mask": lambda: (ids.to(device, copy=True), (ids != 0).to(device)),
        "fp32 latent [1,16,1,128,128]": lambda: (latent.to(device, copy=True), None),
        "bf16 latent [1,16,1,128,128]": lambda: (latent.to(device, torch.bfloat16, copy=True), None),
    }
    if device == "cpu":
        pixels = torch.randint(0, 256, (1024, 1024, 3), dtype=torch.uint8, generator=generator).numpy()
        values["RGB PIL image 1024x1024"] = lambda: (Image.fromarray(pixels.copy()), None)
    return values


def measure(module: Any, rounds: int, device: str) -> list[dict[str, Any]]:
    def encode_prompt(prompt_ids=None, attention_mask=None, image=None, num_images_per_prompt=1):
        return None

    signature = inspect.signature(encode_prompt)
    rows = []
    for name, make in _values(device).items():
        first, second = make()
        kwargs = {"image": first} if not isinstance(first, torch.Tensor) else {"prompt_ids": first}
        if second is not None:
            kwargs["attention_mask"] = second
        key = module._build_key(signature, "m", (), kwargs)
        assert key is not None, name
        kept = sum(len(part) for part in key.copied().witness)
        times = []
        for _ in range(rounds):
            fresh_first, fresh_second = make()
            call = {k: (fresh_first if k in ("image", "prompt_ids") else fresh_second) for k in kwargs}
            if device != "cpu":
                torch.cuda.synchronize()
            started = time.perf_counter()
            module._build_key(signature, "m", (), call)
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        input_bytes = sum(
            v.numel() * v.element_size() if isinstance(v, torch.Tensor) else len(v.tobytes()) for v in kwargs.values()
        )
        rows.append(
            {
                "value": name,
                "device": device,
                "input_bytes": input_bytes,
                "key_us": statistics.median(times) * 1e6,
                # a GPU value is copied to the host; a PIL image's pixels are read out with tobytes()
                "copied_per_call": input_bytes if device != "cpu" or "image" in kwargs else 0,
                "kept_per_entry": kept,
            }
        )
    return rows


def _size(count: int) -> str:
    return f"{count / 2**20:.2f} MiB" if count >= 2**20 else f"{count / 2**10:.0f} KiB" if count else "0"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| value | on | its bytes | key time (median) | host copy per call | host bytes kept per entry |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['value']} | {row['device']} | {_size(row['input_bytes'])} | {row['key_us']:.0f} us "
            f"| {_size(row['copied_per_call'])} | {_size(row['kept_per_entry'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="keys built per value (default: %(default)s)")
    parser.add_argument("--write", type=Path, help="also write the table to this file")
    arguments = parser.parse_args()
    if arguments.rounds < 1:
        parser.error(f"--rounds must be a whole number >= 1, got {arguments.rounds}")
    from vllm_omni_prompt_cache.demo.machine import cpu_summary

    module = _pr1_module()
    rows = measure(module, arguments.rounds, "cpu")
    where = f"CPU: {cpu_summary()}"
    if torch.cuda.is_available():
        rows += measure(module, arguments.rounds, "cuda")
        where += f"; GPU: {torch.cuda.get_device_name()}"
    text = f"PR 1's keys, {arguments.rounds} calls per value, fresh values each call. {where}.\n\n{table(rows)}\n"
    print(text)
    if arguments.write:
        arguments.write.write_text(text)


if __name__ == "__main__":
    main()
