"""What a call's key is: equal content gives equal keys, different content different keys."""

from __future__ import annotations

import copy
import inspect
import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vllm_omni_prompt_cache.keys.call_key import (
    MAX_KEY_DEPTH,
    MAX_KEY_ITEMS,
    Bypass,
    CallKey,
    CallKeyBuilder,
    freeze_witness,
    witness_matches,
)


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


def test_tensor_identity_strides_and_grad_are_not_in_the_key() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    transposed_view = base.t()  # non-contiguous
    copy = transposed_view.contiguous()
    with_grad = copy.clone().requires_grad_(True)
    offset_view = torch.cat([torch.zeros(1, 4), copy.reshape(1, 12)[:, :4].clone()], 0)[1:]
    keys = {one(t).identity for t in (transposed_view, copy, with_grad)}
    assert len(keys) == 1
    assert one(offset_view).identity == one(copy.reshape(1, 12)[:, :4].clone()).identity


def test_a_tensor_on_another_device_keys_like_its_cpu_copy(accept_device_reporting_tensors) -> None:
    """The device-to-host branch (taken by a CUDA tensor) leaves the device out of identity and witness."""
    from device_reporting import ReportsCudaDevice

    for values in (torch.tensor([[5, 6, 7, 0]]), torch.randn(2, 3).to(torch.bfloat16)):
        on_host = one(values)
        reported = ReportsCudaDevice(values.clone())
        assert reported.device.type == "cuda" and not reported.is_cpu  # what a CUDA argument reports
        on_device = one(reported)
        assert isinstance(on_device, CallKey)
        assert on_device.identity == on_host.identity
        assert witness_matches(freeze_witness(on_host.witness), on_device.witness)
    assert one(ReportsCudaDevice(torch.tensor([[5, 6, 8, 0]]))).identity != one(torch.tensor([[5, 6, 7, 0]])).identity


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
#: Keys of every kind a dict can mix and the encoder orders: text, ints, bools, floats, None.
dict_keys = st.one_of(st.text(max_size=2), st.integers(-2, 2), st.booleans(), st.none(), st.floats(-2, 2, width=16))
values = st.recursive(
    st.one_of(scalars, tensors()),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(dict_keys, children, max_size=3),
    ),
    max_leaves=6,
)


def canonical(value):
    """A reference canonical form, written independently of call_key.py, for comparison."""
    if isinstance(value, torch.Tensor):
        return ("T", str(value.dtype), tuple(value.shape), value.contiguous().view(torch.uint8).tolist())
    if isinstance(value, float):
        return ("f", value.hex())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(canonical(v) for v in value))
    if isinstance(value, dict):
        return ("d", tuple(sorted((canonical(k), canonical(v)) for k, v in value.items())))
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


# --- hostile arguments: a call that works uncached never fails because of the cache ------------

CONTAINS_ITSELF = Bypass("argument 'prompt_ids': contains itself")
TOO_DEEP = Bypass(f"argument 'prompt_ids': nested deeper than {MAX_KEY_DEPTH} levels")
TOO_MANY = Bypass(f"argument 'prompt_ids': more than {MAX_KEY_ITEMS:,} container items in the call")


def nest(kind: str, depth: int, leaf=1):
    """``leaf`` inside ``depth`` containers of one kind, built without recursion."""
    value = leaf
    for _ in range(depth):
        value = {"k": value} if kind == "dict" else [value] if kind == "list" else (value,)
    return value


def test_the_exact_reason_strings_at_the_exact_limits() -> None:
    """The reasons users read in stats and logs, produced by the real encoder at its documented limits."""
    looped: list = []
    looped.append(looped)
    assert one(looped).reason == "argument 'prompt_ids': contains itself"
    assert isinstance(one(nest("list", 32)), CallKey)
    assert one(nest("list", 33)).reason == "argument 'prompt_ids': nested deeper than 32 levels"
    assert isinstance(one([0] * 10_000), CallKey)
    assert one([0] * 10_001).reason == "argument 'prompt_ids': more than 10,000 container items in the call"
    assert one({torch.float32: 1, torch.int64: 2}).reason == "argument 'prompt_ids': dict with keys of mixed kinds"


def test_a_list_that_contains_itself_bypasses() -> None:
    looped = [1, "a"]
    looped.append(looped)
    assert one(looped) == CONTAINS_ITSELF
    assert one([[looped]]) == CONTAINS_ITSELF  # the cycle below the top level


def test_a_dict_that_contains_itself_bypasses() -> None:
    looped = {"a": 1}
    looped["self"] = looped
    assert one(looped) == CONTAINS_ITSELF
    keyed_by_loop = []
    keyed_by_loop.append({"k": keyed_by_loop})
    assert one(keyed_by_loop) == CONTAINS_ITSELF


def test_mutually_containing_containers_bypass() -> None:
    left, right = [], {}
    left.append(right)
    right["back"] = left
    assert one(left) == CONTAINS_ITSELF
    assert one(right) == CONTAINS_ITSELF
    via_tuple = []
    via_tuple.append((1, via_tuple))
    assert one(via_tuple) == CONTAINS_ITSELF


def test_dict_keys_of_mixed_kinds_have_one_canonical_order() -> None:
    forward = {1: "a", "b": 2, None: 3, 2.5: 4, False: 5}
    backward = dict(reversed(forward.items()))
    assert one(forward).identity == one(backward).identity
    ints, texts, floats, bools = (one({key: "a"}).identity for key in (1, "1", 1.0, True))
    assert len({ints, texts, floats, bools}) == 4  # 1, "1", 1.0 and True stay apart as keys


def test_shared_sub_containers_are_not_cycles() -> None:
    shared = [1, 2]
    assert one([shared, shared]).identity == one([[1, 2], [1, 2]]).identity
    assert one({"a": shared, "b": shared}).identity == one({"a": [1, 2], "b": [1, 2]}).identity


@pytest.mark.parametrize("kind", ["list", "tuple", "dict"])
def test_5000_deep_nesting_bypasses(kind) -> None:
    assert one(nest(kind, 5_000)) == TOO_DEEP


@pytest.mark.parametrize("kind", ["list", "tuple", "dict"])
def test_nesting_up_to_the_depth_limit_is_keyed(kind) -> None:
    assert isinstance(one(nest(kind, MAX_KEY_DEPTH)), CallKey)
    assert one(nest(kind, MAX_KEY_DEPTH + 1)) == TOO_DEEP
    assert one({nest("tuple", MAX_KEY_DEPTH): 1}) == TOO_DEEP  # a deep dict key counts too


def test_a_100000_entry_dict_bypasses() -> None:
    assert one({str(i): i for i in range(100_000)}) == TOO_MANY


def test_the_item_budget_is_per_call_and_inclusive() -> None:
    # MAX_KEY_ITEMS items in all, the two lists included: keyed.
    assert isinstance(one([[0] * (MAX_KEY_ITEMS // 2), [0] * (MAX_KEY_ITEMS // 2 - 2)]), CallKey)
    assert one([0] * (MAX_KEY_ITEMS + 1)) == TOO_MANY
    # Two arguments under the budget alone, over it together: the second one is named.
    half = [0] * (MAX_KEY_ITEMS // 2 + 1)
    assert key_of(half, half) == Bypass(
        f"argument 'attention_mask': more than {MAX_KEY_ITEMS:,} container items in the call"
    )
    # A shared sub-list is encoded (and charged) each time it appears: 2**20 items from 21 lists.
    doubling = [0]
    for _ in range(20):
        doubling = [doubling, doubling]
    assert one(doubling) == TOO_MANY


def test_tensors_count_as_one_item_however_large() -> None:
    assert isinstance(one([torch.zeros(MAX_KEY_ITEMS * 4), np.zeros(MAX_KEY_ITEMS * 4)]), CallKey)


class Loud(str):
    """A str subclass whose comparisons raise."""

    __hash__ = str.__hash__

    def __eq__(self, other):
        raise ValueError("no comparing me")

    __lt__ = __eq__


class Unclassifiable:
    """A proxy whose ``__class__`` raises, as a lazy proxy to a failed object does: isinstance() raises."""

    @property
    def __class__(self):
        raise LookupError("the proxied object is gone")


def truncated_png() -> Image.Image:
    """A lazily loaded image whose file is cut short: reading its pixels raises OSError."""
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(buffer, format="PNG")
    return Image.open(io.BytesIO(buffer.getvalue()[:-40]))


@pytest.mark.parametrize(
    ("make_value", "reason"),
    [
        (lambda: {Loud("a"): 1, Loud("b"): 2}, "argument 'prompt_ids': unsupported subclass Loud"),
        (Unclassifiable, "argument 'prompt_ids': LookupError raised while keying"),
        (lambda: [1, {"deep": [Unclassifiable()]}], "argument 'prompt_ids': LookupError raised while keying"),
        (truncated_png, "argument 'prompt_ids': OSError raised while keying"),
    ],
    ids=["dict key comparison raises", "__class__ raises", "nested __class__ raises", "truncated image"],
)
def test_user_objects_that_raise_bypass(make_value, reason) -> None:
    assert one(make_value()) == Bypass(reason)


def test_a_digest_that_raises_bypasses() -> None:
    def broken_digest(buffer):
        raise RuntimeError("digest service down")

    builder = CallKeyBuilder(inspect.signature(encode_prompt), "tiny", digest=broken_digest)
    assert builder.build((torch.ones(2),), {}) == Bypass("argument 'prompt_ids': RuntimeError raised while keying")


# Hostile structures: keyable leaves, leaves that raise or have no key, shared sub-containers,
# and (by post-processing a drawn recipe) cycles and nesting past the depth limit.
hostile_leaves = st.one_of(
    scalars,
    tensors(),
    st.builds(object),
    st.builds(Unclassifiable),
    st.builds(Loud, st.text(max_size=2)),
)


def containers(value) -> list:
    """Every list and dict in ``value`` (each once), in a fixed order, without recursion."""
    found, pending, seen = [], [value], set()
    while pending:
        item = pending.pop()
        if type(item) in (list, tuple, dict) and id(item) not in seen:
            seen.add(id(item))
            if type(item) is not tuple:
                found.append(item)
            pending.extend(item.values() if type(item) is dict else item)
    return found


@st.composite
def hostile_recipes(draw, leaves=hostile_leaves) -> tuple:
    """A small tree (with shared sub-containers), how deep to bury it, and which link makes a loop."""
    base = draw(
        st.recursive(
            leaves,
            lambda children: st.one_of(
                st.lists(children, max_size=4),
                st.tuples(children, children),
                st.dictionaries(st.text(max_size=2), children, max_size=3),
                children.map(lambda child: [child, child]),  # one sub-container under two parents
            ),
            max_leaves=10,
        )
    )
    bury = draw(st.none() | st.sampled_from(["list", "tuple", "dict"]))
    depth = draw(st.sampled_from([MAX_KEY_DEPTH - 1, MAX_KEY_DEPTH + 1, 200, 5_000]))
    link = draw(st.none() | st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)))
    return base, bury, depth, link


def realize(recipe: tuple, prepare=lambda base: base):
    """Build the hostile value a recipe describes, linking into ``prepare(base)`` in place."""
    base, bury, depth, link = recipe
    value = prepare(base)
    if bury is not None:
        value = nest(bury, depth, value)
    found = containers(value)
    if link is not None and found:
        holder, target = found[link[0] % len(found)], found[link[1] % len(found)]
        if type(holder) is list:
            holder.append(target)  # a loop when target is holder or one of its ancestors
        else:
            holder["link"] = target
    return value


@settings(max_examples=200, deadline=None)
@given(hostile_recipes().map(realize))
def test_building_a_key_never_raises(value) -> None:
    result = one(value)
    assert type(result) in (CallKey, Bypass)
    if type(result) is CallKey:
        hash(result.identity)  # a key is always usable as a dict key
    else:
        assert result.reason.startswith("argument 'prompt_ids': ")
        assert len(result.reason) < 120


def unshare(value):
    """A copy of an acyclic ``value`` with every shared sub-container copied apart."""
    if type(value) in (list, tuple):
        return type(value)(unshare(item) for item in value)
    if type(value) is dict:
        return {key: unshare(item) for key, item in value.items()}
    return value


@settings(max_examples=200, deadline=None)
@given(hostile_recipes(leaves=st.one_of(scalars, tensors())))
def test_equal_canonical_hostile_inputs_give_equal_keys(recipe) -> None:
    key = one(realize(recipe, copy.deepcopy))  # realize adds links: keep the drawn base intact
    twin = one(realize(recipe, copy.deepcopy))  # same content, cycles and sharing; new objects
    assert type(key) is type(twin)
    if type(key) is Bypass:
        assert key == twin
        return
    assert key.identity == twin.identity
    assert witness_matches(freeze_witness(key.witness), twin.witness)
    _, _, _, link = recipe
    if link is None:
        assert one(realize(recipe, unshare)).identity == key.identity  # sharing is not content
