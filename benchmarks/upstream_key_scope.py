"""What keying a value costs in the upstream series' PR 1, by kind of value: the numbers that decide its scope.

    python benchmarks/upstream_key_scope.py [--rounds 200] [--write FILE]

PR 1 keys tensors, numpy arrays and PIL images by dtype (mode), shape and a blake3 digest of their CPU bytes,
and an entry's key keeps a copy of those bytes (its witness, compared on every hit). For each value below it
keys an ``encode_prompt`` call taking that value as a hit does (``_build_key`` on fresh values, as a rollout's
siblings send them, then the dict lookup that finds the stored entry by comparing the witness) and reports
the median time, the peak of host bytes Python allocated during it (``tracemalloc``: the copies the key and
the compare make; a tensor's copy from a GPU is torch's and not counted) and the host bytes an entry keeps.
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
    """Key each value's call as a hit: build its key from fresh values and find the stored entry (the lookup
    compares the witness: the caller's bytes against the entry's copy)."""
    import tracemalloc

    def encode_prompt(prompt_ids=None, attention_mask=None, image=None, num_images_per_prompt=1):
        return None

    signature = inspect.signature(encode_prompt)
    rows = []
    for name, make in _values(device).items():

        def call_of(first: Any, second: Any) -> dict[str, Any]:
            kwargs = {"image": first} if not isinstance(first, torch.Tensor) else {"prompt_ids": first}
            if second is not None:
                kwargs["attention_mask"] = second
            return kwargs

        kwargs = call_of(*make())
        key = module._build_key(signature, "m", (), kwargs)
        assert key is not None, name
        stored = {key.copied(): "entry"}
        kept = sum(len(part) for part in next(iter(stored)).witness)
        times, copied = [], []
        for _ in range(rounds):
            call = call_of(*make())
            if device != "cpu":
                torch.cuda.synchronize()
            started = time.perf_counter()
            found = stored.get(module._build_key(signature, "m", (), call))
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
            assert found == "entry", name
        for _ in range(min(rounds, 20)):  # apart from the timing: tracing allocations slows every call
            call = call_of(*make())
            tracemalloc.start()
            stored.get(module._build_key(signature, "m", (), call))
            copied.append(tracemalloc.get_traced_memory()[1])  # the peak of Python-allocated bytes (host copies)
            tracemalloc.stop()
        input_bytes = sum(
            v.numel() * v.element_size() if isinstance(v, torch.Tensor) else len(v.tobytes()) for v in kwargs.values()
        )
        rows.append(
            {
                "value": name,
                "device": device,
                "input_bytes": input_bytes,
                "hit_us": statistics.median(times) * 1e6,
                "copied_per_call": statistics.median(copied),
                "kept_per_entry": kept,
            }
        )
    return rows


def _size(count: float) -> str:
    return f"{count / 2**20:.2f} MiB" if count >= 2**20 else f"{count / 2**10:.1f} KiB"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| value | on | its bytes | key and lookup of a hit (median) | host bytes allocated per hit (peak) "
        "| host bytes kept per entry |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['value']} | {row['device']} | {_size(row['input_bytes'])} | {row['hit_us']:.0f} us "
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
