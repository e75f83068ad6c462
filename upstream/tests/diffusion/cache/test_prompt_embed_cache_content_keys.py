# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""
Content keys, the byte witness and the byte budget of the prompt-embedding cache.

Covers what :mod:`vllm_omni.diffusion.cache.prompt_embed_cache` adds to the
argument-keyed LRU: tensors, numpy arrays and PIL images keyed by content (never
by device or identity), typed scalars, the witness compared on every hit, the
``max_bytes`` budget, bypass reasons and the warnings for bad env values.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from vllm_omni.diffusion.cache import prompt_embed_cache as pec
from vllm_omni.diffusion.cache.prompt_embed_cache import (
    _CACHE_MISS,
    _NOT_HASHABLE,
    PromptEmbedCache,
    _build_key,
    _hashable,
    install_prompt_embed_cache,
    resolve_prompt_embed_cache_config,
)

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

VOCAB, WIDTH = 64, 8


class _TokenIdPipeline:
    """A token-ID ``encode_prompt`` with the parameters of verl-omni's Qwen-Image one
    (``verl_omni/pipelines/qwen_image_flow_grpo/common.py``): int64 ids and a bool mask per call.

    The encoder is a real (tiny) embedding, so outputs depend on the ids' values. Unlike that
    encode, it hands the caller's mask back (as verl-omni's LTX-2 ``_encode_token_ids`` can),
    which the aliasing tests need.
    """

    def __init__(self):
        torch.manual_seed(0)
        self.text_encoder = torch.nn.Embedding(VOCAB, WIDTH)
        self.call_count = 0

    def encode_prompt(
        self,
        prompt_ids,
        attention_mask=None,
        num_images_per_prompt=1,
        prompt_embeds=None,
        prompt_embeds_mask=None,
        max_sequence_length=1024,
    ):
        self.call_count += 1
        with torch.no_grad():
            embeds = self.text_encoder(prompt_ids[:, :max_sequence_length])
        if attention_mask is not None:
            embeds = embeds * attention_mask[:, :max_sequence_length, None]
        return embeds.repeat_interleave(num_images_per_prompt, dim=0), attention_mask


class _ScalePipeline:
    """An encoder whose output dtype follows a scalar argument, as ``torch.tensor(x)`` does."""

    def __init__(self):
        self.call_count = 0

    def encode_prompt(self, prompt, scale=1):
        self.call_count += 1
        return torch.tensor(scale)


def _rollout_ids(seed: int, batch: int = 2, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[:, -3:] = False
    return ids, mask


# ---------------------------------------------------------------------------
# Keys by content
# ---------------------------------------------------------------------------


class TestContentKeys:
    def test_fresh_tensors_of_one_prompt_hit_and_get_the_same_embedding(self):
        pipe = _TokenIdPipeline()
        cache = install_prompt_embed_cache(pipe)
        ids, mask = _rollout_ids(0)
        first, _ = pipe.encode_prompt(ids, mask)
        for _ in range(7):  # the K-1 siblings of a rollout group each send new tensors
            again, _ = pipe.encode_prompt(ids.clone(), attention_mask=mask.clone())
            assert torch.equal(again, first)
        assert pipe.call_count == 1
        assert cache.stats()["hits"] == 7 and cache.stats()["bypassed"] == 0

    def test_another_prompt_misses(self):
        pipe = _TokenIdPipeline()
        cache = install_prompt_embed_cache(pipe)
        ids, mask = _rollout_ids(0)
        other = ids.clone()
        other[1, 4] = (other[1, 4] + 1) % VOCAB
        first, _ = pipe.encode_prompt(ids, mask)
        second, _ = pipe.encode_prompt(other, mask)
        assert not torch.equal(first, second)
        assert pipe.call_count == 2 and cache.stats()["misses"] == 2

    def test_int_and_bool_masks_are_different_keys(self):
        ids, mask = _rollout_ids(0)
        sig = pec.inspect.signature(_TokenIdPipeline().encode_prompt)
        as_bool = _build_key(sig, "m", (ids, mask), {})
        as_int = _build_key(sig, "m", (ids, mask.long()), {})
        assert as_bool is not None and as_int is not None and as_bool != as_int

    def test_layout_and_autograd_state_do_not_enter_the_key(self):
        ids, _ = _rollout_ids(0)
        wide = torch.zeros(ids.shape[0], ids.shape[1] * 2, dtype=ids.dtype)
        wide[:, ::2] = ids
        strided = wide[:, ::2]  # same values, other strides and storage
        assert not strided.is_contiguous()
        assert _hashable(strided) == _hashable(ids)
        values = torch.rand(3, 4)
        assert _hashable(values.requires_grad_()) == _hashable(values.detach().clone())
        assert _hashable(values.t().contiguous().t()) == _hashable(values.detach())

    def test_dtype_and_shape_are_part_of_the_key(self):
        ids = torch.arange(6)
        assert _hashable(ids) != _hashable(ids.to(torch.int32))
        assert _hashable(ids) != _hashable(ids.view(2, 3))

    def test_float_tensors_are_keyed_bit_exactly(self):
        zero = torch.tensor([0.0])
        assert _hashable(zero) != _hashable(-zero)  # equal values, different bits
        nan = torch.tensor([float("nan")])
        assert _hashable(nan) == _hashable(nan.clone())
        assert _hashable(torch.ones(2, dtype=torch.bfloat16)) != _hashable(torch.ones(2, dtype=torch.float16))
        complex_values = torch.tensor([1 + 2j, 3 - 1j])
        assert _hashable(complex_values.conj()) == _hashable(complex_values.conj().resolve_conj())  # a lazy view
        assert _hashable(complex_values.conj()) != _hashable(complex_values)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    def test_cpu_and_cuda_copies_share_one_entry(self):
        class CudaPipeline(_TokenIdPipeline):
            """Moves the ids to the encoder's device first, as token-ID encode_prompt methods do."""

            def encode_prompt(self, prompt_ids, attention_mask=None, num_images_per_prompt=1, max_sequence_length=1024):
                device = self.text_encoder.weight.device
                embeds, _ = super().encode_prompt(prompt_ids.to(device), attention_mask.to(device))
                return embeds, attention_mask.to(device)

        pipe = CudaPipeline()
        pipe.text_encoder.cuda()
        cache = install_prompt_embed_cache(pipe)
        ids, mask = _rollout_ids(0)
        from_cpu, _ = pipe.encode_prompt(ids, mask)
        from_cuda, _ = pipe.encode_prompt(ids.cuda(), mask.cuda())
        assert pipe.call_count == 1 and cache.stats()["hits"] == 1
        assert from_cuda.is_cuda and torch.equal(from_cuda, from_cpu)

    def test_tensor_subclasses_and_meta_tensors_bypass(self):
        class Tagged(torch.Tensor):
            pass

        assert _hashable(torch.ones(2).as_subclass(Tagged)) is _NOT_HASHABLE
        assert _hashable(torch.ones(2, device="meta")) is _NOT_HASHABLE

    def test_numpy_arrays_are_keyed_by_content(self):
        array = np.arange(6, dtype=np.int64).reshape(2, 3)
        assert _hashable(array) == _hashable(array.copy())
        assert _hashable(array) != _hashable(array.astype(np.int32))
        assert _hashable(np.asfortranarray(array)) == _hashable(array)
        assert _hashable(np.array([object()], dtype=object)) is _NOT_HASHABLE

    def test_numpy_scalars_keep_their_dtype(self):
        assert _hashable(np.float64(1.5)) != _hashable(np.float32(1.5))
        assert _hashable(np.int64(7)) == _hashable(np.int64(7))
        assert _hashable(np.int64(7)) != _hashable(7)

    def test_images_are_keyed_by_pixels_mode_and_size(self):
        red = Image.new("RGB", (4, 4), (255, 0, 0))
        assert _hashable(red) == _hashable(red.copy())
        assert _hashable(red) != _hashable(Image.new("RGB", (4, 4), (254, 0, 0)))
        assert _hashable(red) != _hashable(red.convert("RGBA"))
        assert _hashable(red) != _hashable(Image.new("RGB", (2, 8), (255, 0, 0)))
        palette = red.convert("P")
        recoloured = palette.copy()
        recoloured.putpalette([0, 0, 255] * 256)  # same indices, other colours
        assert _hashable(palette) != _hashable(recoloured)
        opaque, translucent = palette.copy(), palette.copy()
        opaque.putpalette([255, 0, 0, 255] * 256, rawmode="RGBA")
        translucent.putpalette([255, 0, 0, 128] * 256, rawmode="RGBA")  # differs in alpha only
        assert opaque.convert("RGBA").tobytes() != translucent.convert("RGBA").tobytes()
        assert _hashable(opaque) != _hashable(translucent)


# ---------------------------------------------------------------------------
# Scalars and containers keep their type
# ---------------------------------------------------------------------------


class TestTypedScalars:
    def test_equal_numbers_of_different_types_do_not_share_an_entry(self):
        pipe = _ScalePipeline()
        install_prompt_embed_cache(pipe)
        outputs = [pipe.encode_prompt("cat", scale=value) for value in (1, 1.0, True)]
        assert [out.dtype for out in outputs] == [torch.int64, torch.float32, torch.bool]
        assert pipe.call_count == 3

    def test_negative_zero_and_nan(self):
        assert _hashable(0.0) != _hashable(-0.0)
        assert _hashable(float("nan")) == _hashable(float("nan"))

    def test_list_and_tuple_are_different_keys(self):
        assert _hashable(["a", "b"]) != _hashable(("a", "b"))
        assert _hashable(["a", ("b", 1)])[0] == "__seq__"

    def test_dict_keys_of_other_types_bypass(self):
        assert _hashable({1: "a"}) != _hashable({"1": "a"})
        assert _hashable({("tuple", "key"): 1}) is _NOT_HASHABLE

    def test_a_list_that_contains_itself_bypasses(self):
        loop: list = ["a"]
        loop.append(loop)

        def encode(prompt):
            return None

        assert _build_key(pec.inspect.signature(encode), "m", (loop,), {}) is None


# ---------------------------------------------------------------------------
# The witness
# ---------------------------------------------------------------------------


class TestWitness:
    def test_a_digest_collision_costs_an_encode_not_a_wrong_embedding(self, monkeypatch):
        monkeypatch.setattr(pec, "_digest", lambda data: b"\0" * 16)  # every content collides
        pipe = _TokenIdPipeline()
        cache = install_prompt_embed_cache(pipe)
        ids, mask = _rollout_ids(0)
        other, _ = _rollout_ids(1)
        first, _ = pipe.encode_prompt(ids, mask)
        second, _ = pipe.encode_prompt(other, mask)
        assert not torch.equal(first, second)
        assert torch.equal(pipe.encode_prompt(ids.clone(), mask)[0], first)
        assert torch.equal(pipe.encode_prompt(other.clone(), mask)[0], second)
        assert pipe.call_count == 4 and cache.stats()["hits"] == 0  # one slot, taken in turn
        assert torch.equal(pipe.encode_prompt(other.clone(), mask)[0], second)
        assert pipe.call_count == 4 and cache.stats()["hits"] == 1

    def test_writing_into_the_callers_tensor_later_does_not_change_the_stored_key(self):
        pipe = _TokenIdPipeline()
        install_prompt_embed_cache(pipe)
        ids, mask = _rollout_ids(0)
        original = ids.clone()
        first, _ = pipe.encode_prompt(ids, mask)
        ids[0, 0] = (ids[0, 0] + 1) % VOCAB  # the adapter reuses its buffer for the next prompt
        changed, _ = pipe.encode_prompt(ids, mask)
        assert pipe.call_count == 2 and not torch.equal(changed, first)
        assert torch.equal(pipe.encode_prompt(original, mask)[0], first)
        assert pipe.call_count == 2

    def test_an_output_that_is_an_input_is_copied_before_it_is_kept(self):
        pipe = _TokenIdPipeline()  # hands its attention_mask back, as some token-ID encodes do
        install_prompt_embed_cache(pipe)
        ids, mask = _rollout_ids(0)
        _, returned_mask = pipe.encode_prompt(ids, mask)
        assert returned_mask is mask
        expected = mask.clone()
        mask[:, -3:] = True  # the adapter reuses its mask buffer for the next batch
        _, cached_mask = pipe.encode_prompt(ids.clone(), expected.clone())
        assert pipe.call_count == 1
        assert torch.equal(cached_mask, expected)

    def test_an_output_built_on_a_numpy_input_is_copied_before_it_is_kept(self):
        class Pipeline:
            def encode_prompt(self, token_ids):
                return torch.from_numpy(token_ids)  # shares the caller's memory

        pipe = Pipeline()
        cache = install_prompt_embed_cache(pipe)
        token_ids = np.arange(4)
        pipe.encode_prompt(token_ids)
        token_ids[:] = 9
        assert torch.equal(pipe.encode_prompt(np.arange(4)), torch.arange(4))
        assert cache.stats()["hits"] == 1

    def test_an_output_that_cannot_be_kept_still_reaches_the_caller(self, monkeypatch):
        warned = []
        monkeypatch.setattr(pec.logger, "warning", lambda msg, *args: warned.append(msg % args))

        def no_memory(value, inputs=None):
            raise torch.OutOfMemoryError("no memory for the copy")

        monkeypatch.setattr(pec, "_detach_output", no_memory)
        pipe = _TokenIdPipeline()
        cache = install_prompt_embed_cache(pipe)
        ids, mask = _rollout_ids(0)
        for _ in range(2):
            embeds, _ = pipe.encode_prompt(ids, mask)
            assert embeds.shape == (2, 12, WIDTH)
        assert pipe.call_count == 2 and cache.stats()["size"] == 0
        assert len(warned) == 1 and "no memory for the copy" in warned[0]

    def test_an_encode_that_writes_into_its_inputs_still_hits_later(self):
        class Consuming(_TokenIdPipeline):
            def encode_prompt(self, prompt_ids, attention_mask=None, num_images_per_prompt=1, max_sequence_length=1024):
                out = super().encode_prompt(prompt_ids, attention_mask)
                prompt_ids.zero_()  # an encode that recycles its input buffer
                return out

        pipe = Consuming()
        cache = install_prompt_embed_cache(pipe)
        ids, mask = _rollout_ids(0)
        first, _ = pipe.encode_prompt(ids.clone(), mask)
        again, _ = pipe.encode_prompt(ids.clone(), mask)
        assert pipe.call_count == 1 and cache.stats()["hits"] == 1 and torch.equal(again, first)

    def test_keys_built_without_xxhash_are_exact_too(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "xxhash", None)  # an environment without xxhash
        spec = importlib.util.spec_from_file_location("pec_without_xxhash", pec.__file__)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module._digest.__module__ == module.__name__  # the blake3 fallback
        pipe = _TokenIdPipeline()
        cache = module.install_prompt_embed_cache(pipe)
        ids, mask = _rollout_ids(0)
        pipe.encode_prompt(ids, mask)
        pipe.encode_prompt(ids.clone(), mask.clone())
        pipe.encode_prompt(_rollout_ids(1)[0], mask)
        assert pipe.call_count == 2 and cache.stats()["hits"] == 1


# ---------------------------------------------------------------------------
# Byte budget
# ---------------------------------------------------------------------------


class TestByteBudget:
    def test_bytes_count_outputs_and_witnesses_and_stay_within_the_budget(self):
        ids, mask = _rollout_ids(0)
        out, _ = _TokenIdPipeline().encode_prompt(ids, mask)
        entry = out.nbytes + mask.nbytes + ids.nbytes + mask.nbytes  # output (embeds, mask) + witness
        pipe = _TokenIdPipeline()
        cache = install_prompt_embed_cache(pipe, max_size=100, max_bytes=2 * entry)
        for seed in range(5):
            pipe.encode_prompt(*_rollout_ids(seed))
            assert cache.stats()["bytes"] <= 2 * entry
        assert cache.stats()["size"] == 2 and cache.stats()["bytes"] == 2 * entry
        pipe.encode_prompt(*_rollout_ids(4))  # the newest entries are the ones kept
        assert pipe.call_count == 5
        pipe.encode_prompt(*_rollout_ids(0))
        assert pipe.call_count == 6

    def test_an_output_larger_than_the_budget_is_returned_but_not_kept(self):
        pipe = _TokenIdPipeline()
        cache = install_prompt_embed_cache(pipe, max_bytes=64)
        ids, mask = _rollout_ids(0)
        out, _ = pipe.encode_prompt(ids, mask)
        assert out.shape == (2, 12, WIDTH)
        assert cache.stats()["size"] == 0 and cache.stats()["bytes"] == 0

    def test_shared_storage_is_counted_once(self):
        cache = PromptEmbedCache(max_size=4)
        embeds = torch.zeros(4, 8)
        cache.put("k", (embeds, embeds[:2], embeds))
        assert cache.stats()["bytes"] == embeds.nbytes

    def test_an_output_of_unknown_size_is_returned_but_not_kept(self):
        class SparsePipeline:
            def encode_prompt(self, prompt):
                return torch.eye(3).to_sparse()

        pipe = SparsePipeline()
        cache = install_prompt_embed_cache(pipe)
        assert pipe.encode_prompt("cat").is_sparse
        assert cache.stats()["size"] == 0 and cache.stats()["misses"] == 1

    def test_clear_returns_the_bytes(self):
        cache = PromptEmbedCache(max_size=4, max_bytes=1 << 20)
        cache.put("k", torch.zeros(16))
        cache.clear()
        assert cache.stats()["bytes"] == 0 and cache.get("k") is _CACHE_MISS

    @pytest.mark.parametrize("bad", [0, -1, 1.5, "64"])
    def test_bad_budgets_are_refused(self, bad):
        with pytest.raises(ValueError, match="max_bytes"):
            PromptEmbedCache(max_bytes=bad)

    @pytest.mark.parametrize(
        ("raw", "expected"),
        [("4096", 4096), ("64KiB", 65536), ("2 MB", 2_000_000), ("1GiB", 1 << 30), ("none", None), ("", None)],
    )
    def test_env_budget(self, monkeypatch, raw, expected):
        monkeypatch.setenv("OMNI_DIFFUSION_PROMPT_EMBED_CACHE_MAX_BYTES", raw)
        cache = install_prompt_embed_cache(_TokenIdPipeline())
        assert cache.max_bytes == expected

    @pytest.mark.parametrize("raw", ["0", "-1", "abc", "1.5GiB", "12 parsecs"])
    def test_bad_env_budget_is_an_error_naming_the_variable(self, monkeypatch, raw):
        monkeypatch.setenv("OMNI_DIFFUSION_PROMPT_EMBED_CACHE_MAX_BYTES", raw)
        with pytest.raises(ValueError, match=r"OMNI_DIFFUSION_PROMPT_EMBED_CACHE_MAX_BYTES=.*\(environment variable\)"):
            install_prompt_embed_cache(_TokenIdPipeline())

    def test_an_explicit_budget_wins_over_the_env(self, monkeypatch):
        monkeypatch.setenv("OMNI_DIFFUSION_PROMPT_EMBED_CACHE_MAX_BYTES", "1KiB")
        assert install_prompt_embed_cache(_TokenIdPipeline(), max_bytes=4096).max_bytes == 4096


# ---------------------------------------------------------------------------
# Bypasses say why; bad env values are named
# ---------------------------------------------------------------------------


class TestVisibility:
    def test_each_bypass_reason_is_counted_and_logged_once(self, monkeypatch):
        logged = []
        monkeypatch.setattr(pec.logger, "info", lambda msg, *args: logged.append(msg % args))

        class Handle:
            pass

        class Pipeline:
            call_count = 0

            def encode_prompt(self, prompt, generator=None):
                self.call_count += 1
                return torch.zeros(1)

        pipe = Pipeline()
        cache = install_prompt_embed_cache(pipe)
        for _ in range(3):
            pipe.encode_prompt("cat", generator=Handle())
        assert pipe.call_count == 3
        reason = f"argument 'generator' of type {__name__}.{Handle.__qualname__}"
        assert cache.bypass_reasons() == {reason: 3}
        assert sum(reason in line for line in logged) == 1

    def test_precomputed_embeds_bypass_with_their_reason(self):
        class Pipeline:
            def encode_prompt(self, prompt=None, prompt_embeds=None):
                return prompt_embeds

        pipe = Pipeline()
        cache = install_prompt_embed_cache(pipe)
        pipe.encode_prompt(prompt_embeds=torch.zeros(1))
        assert cache.bypass_reasons() == {"precomputed prompt_embeds": 1}

    @pytest.mark.parametrize(
        ("name", "raw"),
        [
            ("OMNI_DIFFUSION_PROMPT_EMBED_CACHE", "garbage"),
            ("OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE", "0"),
            ("OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE", "-5"),
            ("OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE", "abc"),
        ],
    )
    def test_ignored_env_values_are_warned_about(self, monkeypatch, name, raw):
        warned = []
        monkeypatch.setattr(pec.logger, "warning", lambda msg, *args: warned.append(msg % args))
        monkeypatch.delenv("OMNI_DIFFUSION_PROMPT_EMBED_CACHE", raising=False)
        monkeypatch.delenv("OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE", raising=False)
        monkeypatch.setenv(name, raw)
        assert resolve_prompt_embed_cache_config(enable=True, max_size=12) == (True, 12)
        assert len(warned) == 1 and name in warned[0] and repr(raw) in warned[0]
