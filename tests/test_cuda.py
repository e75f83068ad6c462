"""What the cache claims for CUDA tensors, checked on a GPU; every test skips without one.

An RL adapter collates token ids on the worker's GPU, so the ids and mask that reach
``encode_prompt`` are CUDA tensors. These tests pin down what :mod:`.call_key` and
:mod:`.wrapper` promise for them: the device never enters the key, a hit returns the
encoder's own (CUDA) output object unchanged, and bf16 values are keyed by their bytes.
Run them with ``benchmarks/gpu_check.sh`` on a CUDA machine.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from vllm_omni_prompt_cache import Bypass, CallKeyBuilder, install_prompt_embed_cache
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")

LENGTH = 512
VOCAB = 1024  # build_qwen2_encoder's default vocabulary


@pytest.fixture(scope="module")
def cuda_encoder() -> torch.nn.Module:
    return build_qwen2_encoder(vocab_size=VOCAB).to("cuda")


def cuda_ids_and_mask(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded int64 ids tensor [1, 512] and its bool mask, collated on the GPU as an RL adapter does."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros(1, LENGTH, dtype=torch.int64)
    ids[0, :300] = torch.randint(1, VOCAB, (300,), generator=generator)
    ids = ids.to("cuda")
    return ids, ids != 0


def test_cuda_ids_and_their_cpu_copies_share_one_entry(cuda_encoder) -> None:
    pipeline = TokenIdTextPipeline(cuda_encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=8)
    ids, mask = cuda_ids_and_mask()
    assert (ids.device.type, ids.dtype, tuple(ids.shape), mask.dtype) == ("cuda", torch.int64, (1, LENGTH), torch.bool)

    first_embeds, _ = pipeline.encode_prompt(ids, mask)  # a miss: the encoder runs on the GPU
    # The CPU copies would fail inside a CUDA encoder; a hit never reaches it.
    cpu_embeds, _ = pipeline.encode_prompt(ids.cpu(), mask.cpu())
    fresh_embeds, _ = pipeline.encode_prompt(ids.clone(), mask.clone())  # a sibling's fresh CUDA tensors

    assert pipeline.encoder_runs == 1
    stats = cache.stats()
    assert (stats["size"], stats["hits"], stats["misses"], stats["bypassed"]) == (1, 2, 1, 0)
    assert cpu_embeds is fresh_embeds  # both hits return the stored value
    assert cpu_embeds.untyped_storage().data_ptr() == first_embeds.untyped_storage().data_ptr()


def test_other_ids_on_cuda_get_their_own_entry(cuda_encoder) -> None:
    pipeline = TokenIdTextPipeline(cuda_encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=8)
    ids, mask = cuda_ids_and_mask(seed=0)
    other_ids = ids.clone()
    other_ids[0, 0] = (other_ids[0, 0] % (VOCAB - 1)) + 1  # one token differs
    pipeline.encode_prompt(ids, mask)
    pipeline.encode_prompt(other_ids, mask)
    assert pipeline.encoder_runs == 2
    assert (cache.stats()["hits"], cache.stats()["misses"]) == (0, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_hit_returns_the_encoders_cuda_output_itself(dtype) -> None:
    encoder = build_qwen2_encoder(vocab_size=VOCAB).to("cuda", dtype)
    reference = TokenIdTextPipeline(encoder)
    pipeline = TokenIdTextPipeline(encoder)
    install_prompt_embed_cache(pipeline, max_size=8)
    ids, mask = cuda_ids_and_mask(seed=1)

    expected_embeds, expected_mask = reference.encode_prompt(ids, mask)
    first_embeds, first_mask = pipeline.encode_prompt(ids, mask)
    hit_embeds, hit_mask = pipeline.encode_prompt(ids.clone(), mask.clone())

    assert pipeline.encoder_runs == 1
    assert hit_embeds.device.type == "cuda" and hit_mask.device.type == "cuda"
    assert hit_embeds.dtype == dtype
    assert torch.equal(hit_embeds, expected_embeds)  # bit-identical to an uncached encode
    assert torch.equal(hit_mask, expected_mask)
    # The cache keeps the first result itself (detached, never cloned): same GPU storage.
    assert hit_embeds.untyped_storage().data_ptr() == first_embeds.untyped_storage().data_ptr()
    assert hit_mask.untyped_storage().data_ptr() == first_mask.untyped_storage().data_ptr()


def encode_prompt(prompt_ids, image_latents=None, guidance_scale=1.0):
    """A signature with a float tensor argument that is not a precomputed-embedding one."""


def build_key(*args, **kwargs):
    return CallKeyBuilder(inspect.signature(encode_prompt), "bf16-test").build(args, kwargs)


def test_cuda_bf16_arguments_are_keyed_by_content() -> None:
    generator = torch.Generator().manual_seed(2)
    values = torch.randn(2, 64, 96, generator=generator).to(torch.bfloat16)
    ids = torch.arange(1, 17).unsqueeze(0)
    on_cuda = build_key(ids.cuda(), values.cuda())
    on_cpu = build_key(ids, values)
    assert type(on_cuda) is not Bypass and type(on_cpu) is not Bypass
    assert on_cuda.identity == on_cpu.identity
    assert [bytes(part) for part in on_cuda.witness] == [bytes(part) for part in on_cpu.witness]
    assert "cuda" not in repr(on_cuda.identity)  # the device never enters the key

    # A non-contiguous CUDA view keys like its contiguous CPU copy.
    transposed = values.cuda().transpose(1, 2)
    assert not transposed.is_contiguous()
    assert build_key(ids, transposed).identity == build_key(ids, transposed.cpu().contiguous()).identity

    # One bf16 value changed on the GPU: another key. So is the same shape in fp16.
    changed = values.cuda()
    changed[0, 0, 0] += 1
    assert build_key(ids, changed).identity != on_cpu.identity
    assert build_key(ids, values.cuda().half()).identity != on_cpu.identity


def test_a_batched_cuda_call_encodes_each_distinct_row_once_and_stays_on_the_gpu(cuda_encoder) -> None:
    """Row-level caching with CUDA ids: rows are keyed from one CPU copy, encoded alone on the GPU,
    and assembled on the GPU, bit-identical to encoding each row alone."""
    from vllm_omni_prompt_cache.calls.layouts import TOKEN_IDS
    from vllm_omni_prompt_cache.tiny.text_encoder import QwenStyleTokenPipeline

    pipeline = QwenStyleTokenPipeline(cuda_encoder)
    reference = QwenStyleTokenPipeline(cuda_encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=8, settings=PromptEmbedCacheSettings(row_layout=TOKEN_IDS))
    rows = [cuda_ids_and_mask(seed) for seed in (0, 1, 0, 1, 0)]
    ids, mask = torch.cat([row for row, _ in rows]), torch.cat([row_mask for _, row_mask in rows])
    embeds, embeds_mask = pipeline.encode_prompt(ids, mask)
    assert (embeds.device.type, embeds_mask.device.type) == ("cuda", "cuda")
    assert pipeline.encoder_rows == 2 and cache.snapshot().row_hits == 3
    alone = [reference.encode_prompt(row, row_mask) for row, row_mask in rows]
    assert torch.equal(embeds, torch.cat([a for a, _ in alone])) and torch.equal(
        embeds_mask, torch.cat([m for _, m in alone])
    )


def test_an_entry_leaving_gpu_memory_waits_in_pinned_host_memory_and_comes_back_to_the_gpu(
    cuda_encoder, tmp_path
) -> None:
    pipeline = TokenIdTextPipeline(cuda_encoder)
    cache = install_prompt_embed_cache(
        pipeline, max_size=8, settings=PromptEmbedCacheSettings(host_bytes=64 * 2**20, directory=tmp_path)
    )
    ids, mask = cuda_ids_and_mask()
    encoded, _ = pipeline.encode_prompt(ids, mask)
    device, expected = encoded.device, encoded.cpu()
    del encoded  # the caller's reference to the stored value: the cache's own is what sleep must free
    allocated = torch.cuda.memory_allocated()
    assert cache.release_device_memory() == 1  # what level-1 sleep does
    (host_entry,) = cache.host.held()
    assert host_entry.value[0].is_pinned() and host_entry.devices[0].type == "cuda"
    del host_entry
    assert torch.cuda.memory_allocated() < allocated  # the cache holds no GPU memory while asleep
    again, _ = pipeline.encode_prompt(ids.clone(), mask.clone())
    assert pipeline.encoder_runs == 1 and cache.snapshot().host_hits == 1
    assert again.device == device and torch.equal(again.cpu(), expected)
    # The directory's file, read by a fresh process-like cache, lands on this GPU too.
    reader = TokenIdTextPipeline(cuda_encoder)
    install_prompt_embed_cache(reader, settings=PromptEmbedCacheSettings(directory=tmp_path))
    from_file, _ = reader.encode_prompt(ids.clone(), mask.clone())
    assert reader.encoder_runs == 0 and from_file.device == device and torch.equal(from_file.cpu(), expected)


def test_the_encoder_on_a_miss_holds_no_gpu_memory_between_calls_and_encodes_the_same() -> None:
    """prompt_embed_cache_encoder_on_miss on a GPU: the encoder's bytes leave the GPU at install (one
    pinned host copy), come back for the miss's forward only, and the outputs equal a resident encoder's."""
    from vllm_omni_prompt_cache.calls.wrapper import PLACEMENT_ATTRIBUTE
    from vllm_omni_prompt_cache.settings.resolved import resolve_settings
    from vllm_omni_prompt_cache.vllm_omni import runner

    reference = TokenIdTextPipeline(build_qwen2_encoder(vocab_size=VOCAB).to("cuda"))
    pipeline = TokenIdTextPipeline(build_qwen2_encoder(vocab_size=VOCAB).to("cuda"))
    encoder_bytes = sum(t.nbytes for t in (*pipeline.text_encoder.parameters(), *pipeline.text_encoder.buffers()))
    before = torch.cuda.memory_allocated()
    settings = resolve_settings(
        {"enable_prompt_embed_cache": True, "prompt_embed_cache_encoder_on_miss": True}, environ={}
    )
    cache = runner.install_for_stage(pipeline, settings, "tiny")
    placement = getattr(pipeline, PLACEMENT_ATTRIBUTE)
    assert before - torch.cuda.memory_allocated() >= encoder_bytes
    assert all(t.device.type == "cpu" and t.is_pinned() for t in pipeline.text_encoder.parameters())
    during: list[int] = []
    pipeline.text_encoder.register_forward_hook(lambda *_: during.append(torch.cuda.memory_allocated()))
    idle = torch.cuda.memory_allocated()
    ids, mask = cuda_ids_and_mask()
    got = pipeline.encode_prompt(ids, mask)
    assert during and during[0] - idle >= encoder_bytes
    torch.cuda.synchronize()
    assert placement.device_bytes() == 0
    assert torch.cuda.memory_allocated() - idle < encoder_bytes  # the entry stays, the encoder left
    expected = reference.encode_prompt(ids, mask)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert cache.stats()["encoder_device_bytes"] == 0


def test_module_offload_on_a_gpu_moves_what_the_record_counts() -> None:
    """vLLM-Omni's real hooks on a GPU: the counts are the moves that happened (tensors' devices)."""
    from vllm_omni.diffusion.offloader.sequential_backend import apply_sequential_offload

    from vllm_omni_prompt_cache.settings.resolved import resolve_settings
    from vllm_omni_prompt_cache.vllm_omni import runner

    pipeline = TokenIdTextPipeline(build_qwen2_encoder(vocab_size=VOCAB).to("cuda"))
    pipeline.transformer = torch.nn.Linear(64, 64).to("cuda")
    apply_sequential_offload([pipeline.transformer], [pipeline.text_encoder], torch.device("cuda"), pin_memory=True)
    settings = resolve_settings({"enable_prompt_embed_cache": True}, environ={})
    cache = runner.install_for_stage(pipeline, settings, "tiny")
    ids, mask = cuda_ids_and_mask()
    for seed in (0, 1, 0):  # miss, miss, hit
        ids, mask = cuda_ids_and_mask(seed)
        embeds, _ = pipeline.encode_prompt(ids, mask)
        with torch.inference_mode():
            pipeline.transformer(embeds)
        assert next(pipeline.text_encoder.parameters()).device.type == "cpu"
        assert next(pipeline.transformer.parameters()).device.type == "cuda"
    stats = cache.stats()
    assert (stats["encoder_placements"], stats["encoder_evictions"], stats["dit_evictions"]) == (1, 2, 2)
    assert stats["placements_avoided"] == 1 and stats["encoder_device_bytes"] == 0
