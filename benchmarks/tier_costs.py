"""What a hit costs in each tier, against one encode of the demo model's text encoder.

    python benchmarks/tier_costs.py

Each row times ``encode_prompt`` calls through the real cache (key, lookup, witness check, copy
or file read, checksum), medians of repeated calls, all in one run on this machine's CPU:

* **device hit**: the entry is in the first tier (on this CPU-only machine "device" is host memory);
* **host hit**: the entry was moved to the host tier by ``release_device_memory`` (what sleep does)
  just before each call; on this machine no copy happens, on a GPU host it is one pinned
  host-to-device copy;
* **directory hit**: the entry is only in the directory tier (a fresh cache on the directory per
  call, as a restarted engine or another replica is);
* **encode**: no cache, the demo model's text encoder (Qwen2.5-VL text stack, hidden 384, 6
  layers, fp32, random weights) on one prompt of the demo.

A second table has a directory hit of an entry the size of a real Qwen-Image prompt embedding
(1 x 512 x 3584 bf16, 3.5 MiB), whose encoder (Qwen2.5-VL-7B) cannot run here, with and without a
signing key. A third times the
fingerprint the directory tier computes once per process (and after new encoder weights): the
demo pipeline's, and the weights digest of 1 GiB of bf16 weights in host memory.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.demo.command import DEMO_MODEL
from vllm_omni_prompt_cache.demo.machine import cpu_summary
from vllm_omni_prompt_cache.demo.rollout import DEFAULT_PROMPTS
from vllm_omni_prompt_cache.encoders.fingerprint import code_and_configuration, pipeline_fingerprint, weights_digest
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image, load_tokenizer, prompt_token_ids

REPEATS = 50


class DemoEncoderPipeline(torch.nn.Module):
    """The demo model's text encoder behind a token-ID ``encode_prompt``: the encoder run the demo's
    pipeline (``tiny/token_id_pipeline.py``) makes, without its template trimming and padding, which
    cost no encoder time. A benchmark harness, not a stand-in of user code."""

    def __init__(self, text_encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = text_encoder

    @torch.inference_mode()
    def encode_prompt(
        self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.text_encoder(input_ids=prompt_ids, attention_mask=attention_mask, output_hidden_states=True)
        return hidden.hidden_states[-1], attention_mask


class FixedOutputPipeline(torch.nn.Module):
    """Returns a Qwen-Image-sized embedding; its "encoder" is a module so the directory can fingerprint it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # every instance the same "checkpoint": one namespace
        self.text_encoder = torch.nn.Linear(4, 4)
        self.output = torch.randn(1, 512, 3584).to(torch.bfloat16)

    def encode_prompt(
        self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.output.clone(), attention_mask


def median_ms(call: Callable[[], object], before: Callable[[], object] = lambda: None) -> float:
    """Return the median of ``call``'s wall time in ms over :data:`REPEATS` calls, ``before`` run untimed."""
    before()
    call()  # warm
    times = []
    for _ in range(REPEATS):
        before()
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def tier_rows(make_pipeline: Callable[[], torch.nn.Module], ids: torch.Tensor, root: str) -> dict[str, float]:
    """Return the median ms of a device hit, a host hit, a directory hit and (uncached) one encode."""
    mask = torch.ones_like(ids)
    arguments = (ids, mask)
    plain = make_pipeline()
    encode_ms = median_ms(lambda: plain.encode_prompt(*arguments))

    cached = make_pipeline()
    cache = install_prompt_embed_cache(cached, settings=PromptEmbedCacheSettings(host_bytes=2**30, directory=root))
    cached.encode_prompt(*arguments)  # encoded once: in the device tier and written to the directory
    device_ms = median_ms(lambda: cached.encode_prompt(*arguments))
    host_ms = median_ms(lambda: cached.encode_prompt(*arguments), cache.release_device_memory)
    assert cache.snapshot().host_hits >= REPEATS, "the host tier did not serve the host-hit calls"

    directory_ms = directory_hit_ms(make_pipeline, arguments, root)
    return {"device hit": device_ms, "host hit": host_ms, "directory hit": directory_ms, "encode": encode_ms}


def directory_hit_ms(
    make_pipeline: Callable[[], torch.nn.Module], arguments: tuple, root: str, key: bytes | None = None
) -> float:
    """Return the median ms of a hit served from a file of ``root`` (signed and verified under ``key``)."""
    fresh: list = []

    def new_process() -> None:  # a new pipeline and cache on the directory, as a restarted engine has
        pipeline = make_pipeline()
        install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(directory=root, directory_key=key))
        pipeline.encode_prompt(*arguments)  # the first call fingerprints the weights: not timed
        pipeline._prompt_embed_cache.release_device_memory()
        fresh[:] = [pipeline]

    directory_ms = median_ms(lambda: fresh[0].encode_prompt(*arguments), new_process)
    stats = fresh[0]._prompt_embed_cache.snapshot()
    assert stats.dir_hits == 2 and not stats.dir_rejections, "the directory did not serve the timed call"
    return directory_ms


def main() -> None:
    model_dir = ensure_tiny_qwen_image(DEMO_MODEL)
    encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir / "text_encoder", torch_dtype=torch.float32)
    encoder.eval()
    ids = torch.tensor([prompt_token_ids(load_tokenizer(model_dir), DEFAULT_PROMPTS[0])])
    print(f"CPU: {cpu_summary()}, torch {torch.__version__}, {torch.get_num_threads()} threads; median of {REPEATS}")
    with tempfile.TemporaryDirectory() as root:
        demo = tier_rows(lambda: DemoEncoderPipeline(encoder), ids, root)
    with tempfile.TemporaryDirectory() as root:
        qwen_sized = tier_rows(FixedOutputPipeline, ids, root)
    with tempfile.TemporaryDirectory() as root:  # files signed under a key, verified on each read
        signed_ms = directory_hit_ms(FixedOutputPipeline, (ids, torch.ones_like(ids)), root, key=b"k" * 32)
    print(f"\nDemo model's encoder, one prompt of {ids.shape[1]} tokens (entry: {ids.shape[1]} x 384 fp32):\n")
    print("| served by | median ms | vs one encode |")
    print("|---|---:|---:|")
    for name, ms in demo.items():
        print(f"| {name} | {ms:.3f} | {ms / demo['encode']:.4f}x |")
    print("\nAn entry the size of a Qwen-Image prompt embedding (1 x 512 x 3584 bf16, 3.5 MiB):\n")
    print("| served by | median ms |")
    print("|---|---:|")
    for name in ("device hit", "host hit", "directory hit"):
        print(f"| {name} | {qwen_sized[name]:.3f} |")
    print(f"| directory hit, signed (HMAC-SHA256 verified) | {signed_ms:.3f} |")
    demo_pipeline = DemoEncoderPipeline(encoder)
    demo_pipeline.tokenizer = load_tokenizer(model_dir)
    started = time.perf_counter()
    pipeline_fingerprint(demo_pipeline, code_and_configuration(demo_pipeline, demo_pipeline.encode_prompt, "demo"))
    demo_s = time.perf_counter() - started
    big = torch.nn.Linear(16384, 32768, bias=False, dtype=torch.bfloat16)  # 1 GiB of weights
    started = time.perf_counter()
    weights_digest(big)
    big_s = time.perf_counter() - started
    print("\nThe directory tier's fingerprint (once per process, and after new encoder weights):\n")
    print("| what | seconds |")
    print("|---|---:|")
    print(
        f"| the demo pipeline (encoder {sum(p.numel() for p in encoder.parameters()) / 1e6:.1f} M fp32, tokenizer) "
        f"| {demo_s:.3f} |"
    )
    print(f"| weights digest of 1 GiB of bf16 weights in host memory | {big_s:.3f} |")


if __name__ == "__main__":
    main()
