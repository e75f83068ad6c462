"""What a call's key is: equal content gives equal keys, different content different keys."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vllm_omni_prompt_cache.keys import Bypass, CallKey, CallKeyBuilder, freeze_witness, witness_matches


def encode_prompt(prompt_ids, attention_mask=None, num_images_per_prompt=1, max_sequence_length=512):
    raise AssertionError("never called: only the signature is used")


def key_of(*args, builder: CallKeyBuilder | None = None, **kwargs) -> CallKey | Bypass:
    builder = builder or CallKeyBuilder(inspect.signature(encode_prompt), "tiny")
    return builder.build(args, kwargs)


def one(value) -> CallKey | Bypass:
    return key_of(value)


def test_positional_and_keyword_calls_share_a_key() -> None:
    ids = torch.tensor([[5, 6, 7]])
    mask = ids != 0
    by_position = key_of(ids, mask, 1, 512)
    by_keyword = key_of(attention_mask=mask, prompt_ids=ids)
    assert isinstance(by_position, CallKey)
    assert by_position.identity == by_keyword.identity


def test_defaults_are_applied_before_keying() -> None:
    ids = torch.tensor([[5, 6, 7]])
    assert key_of(ids).identity == key_of(ids, None, 1, 512).identity
    assert key_of(ids).identity != key_of(ids, None, 2, 512).identity


def test_model_tag_is_part_of_the_key() -> None:
    signature = inspect.signature(encode_prompt)
    ids = torch.tensor([[1]])
    a = CallKeyBuilder(signature, "model-a").build((ids,), {})
    b = CallKeyBuilder(signature, "model-b").build((ids,), {})
    assert a.identity != b.identity


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (True, 1),
        (1, 1.0),
        (True, 1.0),
        (0.0, -0.0),
        ("1", 1),
        (b"a", "a"),
        ([1, 2], (1, 2)),
        (None, "none"),
        (np.int64(1), 1),
        (np.int32(1), np.int64(1)),
        (torch.device("cpu"), "cpu"),
        (torch.float32, "torch.float32"),
    ],
)
def test_values_that_python_may_equate_get_distinct_keys(left, right) -> None:
    assert one(left).identity != one(right).identity


def test_dict_order_does_not_matter_and_values_do() -> None:
    assert one({"a": 1, "b": 2}).identity == one({"b": 2, "a": 1}).identity
    assert one({"a": 1}).identity != one({"a": 2}).identity


def test_tensor_device_identity_strides_and_grad_are_not_in_the_key() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    transposed_view = base.t()  # non-contiguous
    copy = transposed_view.contiguous()
    with_grad = copy.clone().requires_grad_(True)
    offset_view = torch.cat([torch.zeros(1, 4), copy.reshape(1, 12)[:, :4].clone()], 0)[1:]
    keys = {one(t).identity for t in (transposed_view, copy, with_grad)}
    assert len(keys) == 1
    assert one(offset_view).identity == one(copy.reshape(1, 12)[:, :4].clone()).identity


def test_tensor_dtype_and_shape_are_in_the_key() -> None:
    ids = torch.arange(6)
    assert one(ids).identity != one(ids.to(torch.int32)).identity
    assert one(ids).identity != one(ids.reshape(2, 3)).identity
    assert one(ids != 0).identity != one((ids != 0).to(torch.uint8)).identity


@pytest.mark.parametrize(
    "dtype",
    [
        torch.int64,
        torch.int32,
        torch.bool,
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float8_e4m3fn,
        torch.complex64,
    ],
)
def test_every_dtype_is_keyed_by_its_bytes(dtype) -> None:
    values = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    tensor = values.to(dtype) if dtype is not torch.bool else values > 3
    changed = tensor.clone()
    changed.view(torch.uint8).reshape(-1)[-1] ^= 1  # flip one bit of the last element
    assert isinstance(one(tensor), CallKey)
    assert one(tensor).identity == one(tensor.clone()).identity
    assert one(tensor).identity != one(changed).identity


def test_conjugate_and_negative_bits_are_resolved_first() -> None:
    values = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    lazy_conj = values.conj()
    assert lazy_conj.is_conj()
    assert one(lazy_conj).identity == one(lazy_conj.resolve_conj()).identity
    lazy_neg = lazy_conj.imag
    assert lazy_neg.is_neg()
    assert one(lazy_neg).identity == one(lazy_neg.resolve_neg().clone()).identity


def test_zero_dim_and_empty_tensors_are_keyed() -> None:
    assert one(torch.tensor(3)).identity != one(torch.tensor([3])).identity
    assert isinstance(one(torch.empty(0, 4)), CallKey)
    assert isinstance(one(torch.tensor(1.5, dtype=torch.bfloat16)), CallKey)


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized / nested tensors are deprecated or prototype
@pytest.mark.parametrize(
    ("value", "reason_part"),
    [
        (torch.eye(3).to_sparse(), "layout"),
        (torch.empty(2, device="meta"), "meta tensor"),
        (torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8), "quantized"),
        (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
        (object(), "unsupported type builtins.object"),
        (np.array([object()], dtype=object), "objects"),
    ],
)
def test_what_cannot_be_read_exactly_bypasses_with_a_reason(value, reason_part) -> None:
    result = one(value)
    assert isinstance(result, Bypass)
    assert "'prompt_ids'" in result.reason
    assert reason_part in result.reason


def test_tensor_subclasses_bypass() -> None:
    class Tagged(torch.Tensor):
        pass

    result = one(torch.ones(2).as_subclass(Tagged))
    assert isinstance(result, Bypass)
    assert "tensor subclass" in result.reason
    assert "Tagged" in result.reason


def test_parameters_are_keyed_like_tensors() -> None:
    weights = torch.ones(3)
    assert one(torch.nn.Parameter(weights.clone())).identity == one(weights).identity


def test_precomputed_embeddings_bypass() -> None:
    def encode(prompt, prompt_embeds=None, negative_prompt_embeds_mask=None):
        pass

    builder = CallKeyBuilder(inspect.signature(encode), "tiny")
    assert isinstance(builder.build(("a cat",), {}), CallKey)
    bypass = builder.build(("a cat",), {"prompt_embeds": torch.ones(1)})
    assert bypass == Bypass("precomputed prompt_embeds given")
    assert isinstance(builder.build((None,), {"negative_prompt_embeds_mask": torch.ones(1)}), Bypass)


def test_arguments_that_do_not_bind_bypass() -> None:
    assert isinstance(key_of(1, 2, 3, 4, 5), Bypass)


def test_numpy_arrays_and_images_are_keyed_by_content() -> None:
    array = np.arange(6, dtype=np.int64).reshape(2, 3)
    assert one(array).identity == one(array.copy()).identity
    assert one(array).identity == one(np.asfortranarray(array)).identity
    assert one(array).identity != one(array.astype(np.int32)).identity
    assert one(array).identity != one(array.T.copy()).identity

    pixels = np.zeros((4, 4, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    assert one(image).identity == one(Image.fromarray(pixels.copy())).identity
    pixels[0, 0, 0] = 1
    assert one(image).identity != one(Image.fromarray(pixels)).identity
    assert one(image).identity != one(image.convert("L")).identity

    palette_a = Image.new("P", (2, 2))
    palette_a.putpalette([0, 0, 0, 255, 0, 0] * 128)
    palette_b = palette_a.copy()
    palette_b.putpalette([0, 0, 0, 0, 255, 0] * 128)
    assert one(palette_a).identity != one(palette_b).identity


def test_witness_holds_the_bytes_and_detects_a_collision() -> None:
    ids = torch.tensor([[1, 2, 3]])
    key = one(ids)
    frozen = freeze_witness(key.witness)
    assert frozen == (ids.numpy().tobytes(),)
    ids[0, 0] = 9  # the caller mutates its tensor after the call
    assert frozen == (torch.tensor([[1, 2, 3]]).numpy().tobytes(),)
    assert not witness_matches(frozen, one(ids).witness)
    assert witness_matches(frozen, one(torch.tensor([[1, 2, 3]])).witness)


def test_the_digest_is_replaceable() -> None:
    weak = CallKeyBuilder(inspect.signature(encode_prompt), "tiny", digest=lambda buffer: b"same")
    a = weak.build((torch.tensor([1]),), {})
    b = weak.build((torch.tensor([2]),), {})
    assert a.identity == b.identity  # the weak digest collides ...
    assert not witness_matches(freeze_witness(a.witness), b.witness)  # ... the witness does not


# --- properties: equal canonical inputs <=> equal keys ---------------------------------------

DTYPES = [torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16, torch.float16]


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    values = draw(st.lists(st.integers(0, 3), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    tensor = torch.tensor(values).reshape(shape)
    tensor = tensor > 1 if dtype is torch.bool else tensor.to(dtype)
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    if layout == "transposed" and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    elif layout == "sliced":
        padded = torch.cat([tensor.reshape(-1), tensor.reshape(-1)])
        tensor = padded[tensor.numel() :].reshape(shape)  # storage offset != 0
    return tensor


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=False, width=32),
    st.text(max_size=3),
    st.binary(max_size=3),
)
values = st.recursive(
    st.one_of(scalars, tensors()),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=2), children, max_size=3),
    ),
    max_leaves=6,
)


def canonical(value):
    """A reference canonical form, written independently of keys.py, for comparison."""
    if isinstance(value, torch.Tensor):
        return ("T", str(value.dtype), tuple(value.shape), value.contiguous().view(torch.uint8).tolist())
    if isinstance(value, float):
        return ("f", value.hex())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(canonical(v) for v in value))
    if isinstance(value, dict):
        return ("d", tuple(sorted((k, canonical(v)) for k, v in value.items())))
    return (type(value).__name__, value)


@settings(max_examples=300, deadline=None)
@given(values, values)
def test_equal_canonical_inputs_iff_equal_keys(left, right) -> None:
    left_key, right_key = one(left), one(right)
    same_content = canonical(left) == canonical(right)
    assert (left_key.identity == right_key.identity) == same_content
    if same_content:
        assert witness_matches(freeze_witness(left_key.witness), right_key.witness)


@settings(max_examples=100, deadline=None)
@given(tensors())
def test_a_tensor_and_its_contiguous_copy_share_a_key(tensor) -> None:
    assert one(tensor).identity == one(tensor.contiguous().clone()).identity


def test_precomputed_embeddings_passed_through_var_keyword_bypass() -> None:
    def encode(prompt, **kwargs):
        pass

    builder = CallKeyBuilder(inspect.signature(encode), "tiny")
    assert isinstance(builder.build(("a cat",), {"max_sequence_length": 77}), CallKey)
    assert builder.build(("a cat",), {"prompt_embeds": torch.ones(1)}) == Bypass("precomputed prompt_embeds given")
