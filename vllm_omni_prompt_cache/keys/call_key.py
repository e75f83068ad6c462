"""What the cache key of an ``encode_prompt`` call is.

A key has two parts:

``identity``
    A hashable, type-tagged tuple that stands for the call: the model tag and
    every bound argument (defaults applied). Scalars, strings and containers
    appear by value; tensors, numpy arrays and PIL images appear as
    ``(kind, dtype, shape, digest)`` where ``digest`` is xxh3-128 over their
    contiguous CPU bytes. The device, strides, storage offset,
    ``requires_grad`` and object identity never enter it, so the K fresh
    ``prompt_ids`` tensors an RL rollout sends for one prompt share one key.

``witness``
    The bytes those digests summarize, in order. The store compares them on
    every hit, so a digest collision (xxHash is not collision resistant) can
    cost a re-encode but never return another prompt's embedding.

A call that cannot be keyed exactly is not guessed at: :meth:`CallKeyBuilder.build`
returns a :class:`Bypass` whose ``reason`` names the argument and why. So does a
call whose arguments contain themselves, nest deeper than :data:`MAX_KEY_DEPTH`,
hold more than :data:`MAX_KEY_ITEMS` container items, or raise while being read:
keying never raises, and never costs more than those limits allow.
Nothing here knows about vLLM-Omni.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash

#: Digest used for array contents unless a builder is given another one.
#: xxh3-128 hashes about 30 GB/s here; collisions are caught by the witness.
default_digest: Callable[[Any], bytes] = xxhash.xxh3_128_digest

#: Arguments that carry already-encoded input. A non-None value means the call
#: is a cheap pass-through (upstream bypasses it too), and keying it would hash
#: a large embedding for nothing.
PRECOMPUTED_EMBED_ARGS = (
    "prompt_embeds",
    "negative_prompt_embeds",
    "pooled_prompt_embeds",
    "negative_pooled_prompt_embeds",
    "prompt_embeds_mask",
    "negative_prompt_embeds_mask",
)

#: Containers (lists, tuples, dicts) may nest this deep in one argument. Real calls nest
#: two or three levels; the limit keeps the encoder far from Python's recursion limit.
MAX_KEY_DEPTH = 32

#: List/tuple elements plus dict entries encoded per call, summed over all arguments
#: (a tensor, array or image is one element). Real calls hold a few hundred prompts;
#: beyond this, keying (up to ~1 us an item) would cost more than it saves.
MAX_KEY_ITEMS = 10_000

# Tensor subclasses we read exactly like a plain tensor. Anything else (FakeTensor,
# DTensor, functional wrappers, ...) may not expose its real values through
# ``.numpy()`` and is bypassed.
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_NONE = ("none",)
#: Follows the model tag in a row's identity (see :mod:`~vllm_omni_prompt_cache.rows.layout`); no argument value
#: encodes to it, so a row never shares an entry with a whole call.
_ROW = ("row",)


class CallKey(NamedTuple):
    """The key of one cacheable call: ``identity`` to look up, ``witness`` to verify."""

    identity: tuple
    witness: tuple  # of objects exposing the buffer protocol (numpy arrays, bytes)


class Bypass(NamedTuple):
    """Why a call was not cached; ``reason`` is short and bounded in variety."""

    reason: str


class ReadCall(NamedTuple):
    """A call as :meth:`CallKeyBuilder.read` found it: everything its key rests on, read once."""

    arguments: dict[str, Any]  # by name in signature order, defaults applied
    learning: bool  # its method is learning: nothing else was read
    precomputed: Bypass | None  # why it is a pass-through (it gives precomputed embeddings), if it is
    held: tuple | Bypass | None  # the pipeline state its key holds; a Bypass: a component was replaced
    key: CallKey | Bypass | None  # the whole call's key, when asked for and the rest allows one


class _Uncacheable(Exception):
    """Raised while encoding a value that has no exact key; carries the reason."""


def witness_nbytes(witness: tuple) -> int:
    """Return how many bytes a witness holds (what keeping it costs)."""
    return sum(memoryview(part).nbytes for part in witness)


def freeze_witness(witness: tuple) -> tuple[bytes, ...]:
    """Return an owned copy of ``witness``: the caller may mutate its inputs later."""
    return tuple(part.tobytes() if not isinstance(part, bytes) else part for part in witness)


def witness_matches(stored: tuple[bytes, ...], probe: tuple) -> bool:
    """Return True when ``probe`` holds exactly the bytes of ``stored``."""
    if len(stored) != len(probe):
        return False
    for kept, part in zip(stored, probe, strict=True):
        if kept != (part if isinstance(part, bytes) else part.tobytes()):
            return False
    return True


class _Encoder:
    """Turns one call's argument values into identity tuples, collecting the witness."""

    __slots__ = ("digest", "host_views", "items_left", "open_ids", "witness")

    def __init__(self, digest: Callable[[Any], bytes], host_views: Mapping[int, np.ndarray] | None = None) -> None:
        self.digest = digest
        self.host_views = host_views  # numpy views of contiguous CPU tensors already read, by id(tensor)
        self.witness: list = []
        self.items_left = MAX_KEY_ITEMS
        self.open_ids: set[int] = set()  # containers being encoded: the path from the argument down

    def encode(self, value: Any) -> Any:
        # Exact type checks, most common first: they are the hot path, and they
        # keep True, 1 and 1.0 apart.
        kind = type(value)
        if kind is str:
            return value  # the common case stays a bare str; no other kind encodes to one
        if kind is torch.Tensor:
            return self._tensor(value)
        if kind is int:
            return ("int", value)
        if value is None:
            return _NONE
        if kind is bool:
            return ("bool", value)
        if kind is float:
            return ("float", value.hex())  # keeps -0.0 apart from 0.0; all NaNs alike
        if kind is tuple or kind is list:
            return (kind.__name__, self._sequence(value))
        if kind is dict:
            return self._dict(value)
        if kind is torch.dtype:
            return ("dtype", value)  # dtypes are interned singletons
        if kind is torch.device:
            return ("device", value.type, value.index)
        if kind is bytes:
            return ("bytes", value)
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, np.ndarray):
            return self._ndarray(value)
        if isinstance(value, np.generic):
            return self._numpy_scalar(value)
        image_module = sys.modules.get("PIL.Image")  # no PIL loaded means no PIL image
        if image_module is not None and isinstance(value, image_module.Image):
            return self._image(value)
        if isinstance(value, (str, int, float, tuple, list, dict, bytes)):
            # Subclasses (enums, named tuples, ...) may compare or behave differently.
            raise _Uncacheable(f"unsupported subclass {kind.__qualname__}")
        raise _Uncacheable(f"unsupported type {kind.__module__}.{kind.__qualname__}")

    def _open(self, container: list | tuple | dict) -> int:
        """Check the limits before encoding ``container``'s items; return the id to close it with."""
        container_id = id(container)  # ancestors are alive, so their ids cannot be reused
        if container_id in self.open_ids:
            raise _Uncacheable("contains itself")
        if len(self.open_ids) >= MAX_KEY_DEPTH:
            raise _Uncacheable(f"nested deeper than {MAX_KEY_DEPTH} levels")
        # Charged before any item is encoded, so an oversized container costs nothing.
        self.items_left -= len(container)
        if self.items_left < 0:
            raise _Uncacheable(f"more than {MAX_KEY_ITEMS:,} container items in the call")
        self.open_ids.add(container_id)
        return container_id

    def _sequence(self, value: list | tuple) -> tuple:
        container_id = self._open(value)
        encoded = tuple([self.encode(item) for item in value])
        self.open_ids.remove(container_id)  # a shared (not cyclic) sub-list may appear again
        return encoded

    def _dict(self, value: dict) -> tuple:
        container_id = self._open(value)
        items = [(self.encode(key), self.encode(item)) for key, item in value.items()]
        self.open_ids.remove(container_id)
        try:
            # Text keys encode to bare strings, every other kind to a tagged tuple: order the two
            # groups apart, so {1: a, "b": c} has one canonical order too.
            items.sort(key=lambda pair: (type(pair[0]) is str, pair[0]))
        except TypeError:  # keys whose encodings do not order, such as dtypes
            raise _Uncacheable("dict with keys of mixed kinds") from None
        return ("dict", tuple(items))

    def _tensor(self, tensor: torch.Tensor) -> tuple:
        # Fast path: a plain, dense, contiguous CPU tensor whose dtype numpy knows.
        # .numpy() raises for requires_grad, conj/neg bits and bf16/fp8, which
        # then take the general path below.
        if type(tensor) is torch.Tensor and tensor.is_cpu and tensor.layout is _STRIDED and tensor.is_contiguous():
            views = self.host_views
            try:
                array = views[id(tensor)] if views and id(tensor) in views else tensor.numpy()
            except (RuntimeError, TypeError):
                array = self._tensor_bytes(tensor)
        else:
            array = self._tensor_bytes(tensor)
        self.witness.append(array)
        return ("tensor", tensor.dtype, tensor.shape, self.digest(array))  # torch.Size is a tuple

    @staticmethod
    def _tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
        """Return the tensor's values as contiguous CPU bytes, copying at most once to the CPU."""
        if type(tensor) not in _PLAIN_TENSOR_TYPES:
            raise _Uncacheable(f"tensor subclass {type(tensor).__qualname__}")
        if tensor.layout is not torch.strided:
            raise _Uncacheable(f"tensor with layout {tensor.layout}")
        if tensor.is_nested:
            raise _Uncacheable("nested tensor")
        if tensor.is_meta:
            raise _Uncacheable("meta tensor")
        if tensor.is_quantized:
            raise _Uncacheable("quantized tensor")
        tensor = tensor.detach().resolve_conj().resolve_neg().contiguous()
        if not tensor.is_cpu:
            tensor = tensor.cpu()
        try:
            return tensor.numpy()
        except TypeError:  # bf16, fp8, ...: numpy has no such dtype, the bytes are what matter
            return tensor.reshape(-1).view(torch.uint8).numpy()

    def _ndarray(self, array: np.ndarray) -> tuple:
        if array.dtype.hasobject:
            raise _Uncacheable("numpy array of Python objects")
        contiguous = np.ascontiguousarray(array)
        self.witness.append(contiguous)
        return ("ndarray", str(array.dtype.descr), array.shape, self.digest(contiguous))

    def _numpy_scalar(self, scalar: np.generic) -> tuple:
        if scalar.dtype.hasobject:
            raise _Uncacheable("numpy object scalar")
        return ("npscalar", str(scalar.dtype.descr), scalar.tobytes())

    def _image(self, image: Any) -> tuple:
        pixels = image.tobytes()
        palette = image.getpalette() if image.mode in ("P", "PA") else None
        transparency = image.info.get("transparency")
        self.witness.append(pixels)
        return (
            "image",
            image.mode,
            image.size,
            None if palette is None else tuple(palette),
            self.encode(transparency),
            self.digest(pixels),
        )


def value_key(value: Any, digest: Callable[[Any], bytes] | None = None) -> tuple[Any, tuple] | Bypass:
    """Return ``value``'s identity and witness (the bytes its digests summarize), or a Bypass saying why it
    has none; ``digest``: what digests arrays (None: xxh3-128)."""
    encoder = _Encoder(default_digest if digest is None else digest)
    try:
        return encoder.encode(value), tuple(encoder.witness)
    except _Uncacheable as why:
        return Bypass(str(why))
    except Exception as error:
        return Bypass(f"{type(error).__qualname__} raised while keying")


def value_identity(value: Any) -> Any | Bypass:
    """Return ``value``'s identity as a call key spells it, or a Bypass saying why it has none.

    For code that must agree with the cache's keys without building one (request routing).
    """
    encoder = _Encoder(default_digest)
    try:
        return encoder.encode(value)
    except _Uncacheable as why:
        return Bypass(str(why))
    except Exception as error:
        return Bypass(f"{type(error).__qualname__} raised while keying")


#: The name under which a key holds what its call read from the pipeline (an extra bound argument).
STATE = "self"


def _comparable(value: Any, depth: int = 0) -> Any:
    """Return ``value`` with each part no key can read (an object of the adapter's own) replaced by its type's name:
    what a proof compares of it (a stand-in cannot have shaped such an object's identity, and it is served as kept)."""
    if depth > 32 or isinstance(value, torch.Tensor) or value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if type(value) in (tuple, list):
        return type(value)(_comparable(item, depth + 1) for item in value)
    if type(value) is dict:
        return {key: _comparable(item, depth + 1) for key, item in value.items()}
    name = (type(value).__module__, type(value).__qualname__)
    if isinstance(value, tuple):  # a NamedTuple: its fields, and its type
        return (name, tuple(_comparable(item, depth + 1) for item in value))
    if isinstance(value, Mapping):  # a ModelOutput, an OrderedDict: its items, and its type
        return (name, {str(key): _comparable(item, depth + 1) for key, item in value.items()})
    if type(value_identity(value)) is not Bypass:
        return value
    if hasattr(value, "__dict__") and not callable(value):  # an object of the adapter's own: its attributes
        return (name, {key: _comparable(item, depth + 1) for key, item in vars(value).items()})
    return ("opaque", *name)


def result_digest(value: Any) -> str | Bypass:
    """Return the digest of what a stand-in run returned (its values are the stand-ins' own: xxh3 digests do)."""
    with torch.inference_mode(False):
        identity = value_identity(_comparable(value))
    return identity if type(identity) is Bypass else _digest(identity, ())


def input_digest(value: Any) -> str | Bypass:
    """Return the digest of what reached a text-encoder call (its module path, arguments and keyword arguments), or
    why it has none: its identity and the bytes themselves (the identity's xxh3 digests are not collision resistant)."""
    with torch.inference_mode(False):  # read as the call's arguments are, whatever mode the encode runs in
        key = value_key(value)
    return key if type(key) is Bypass else _digest(*key)


def _digest(identity: Any, witness: tuple) -> str:
    digest = hashlib.blake2b(repr(identity).encode("utf-8", "surrogatepass"), digest_size=32)
    for part in witness:
        digest.update(part)
    return digest.hexdigest()


class CallKeyBuilder:
    """Builds keys for calls of one ``encode_prompt`` signature under one model tag."""

    def __init__(
        self,
        signature: inspect.Signature,
        model_tag: str,
        *,
        digest: Callable[[Any], bytes] | None = None,
    ) -> None:
        self.signature = signature
        self.model_tag = model_tag
        self.digest = default_digest if digest is None else digest
        # Only the precomputed-embedding arguments this signature can receive need a check.
        self._precomputed_names = tuple(name for name in PRECOMPUTED_EMBED_ARGS if name in signature.parameters)
        self._var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    def read(
        self, args: tuple, kwargs: Mapping[str, Any], state: Any, instance: Any, *, whole: bool
    ) -> ReadCall | Bypass:
        """Read a call of the method whose :class:`~.method_state.MethodState` is ``state``, bound to ``instance``: its
        arguments, whether it is a pass-through, the state its key holds, and with ``whole`` its whole-call key;
        a Bypass when its arguments do not bind."""
        arguments = self.bind(args, kwargs)
        if type(arguments) is Bypass:
            return arguments
        if state.learning:
            return ReadCall(arguments, True, None, None, None)
        precomputed = self.precomputed(arguments)
        if precomputed is not None:
            return ReadCall(arguments, False, precomputed, None, None)
        held = state.state_argument(instance)
        if not whole or type(held) is Bypass:
            return ReadCall(arguments, False, None, held, None)
        return ReadCall(arguments, False, None, held, self._key(arguments, held, False, None))

    def build(self, args: tuple, kwargs: Mapping[str, Any]) -> CallKey | Bypass:
        """Return the call's key, or a Bypass saying why it has none."""
        arguments = self.bind(args, kwargs)
        if type(arguments) is Bypass:
            return arguments
        return self.build_from_arguments(arguments)

    def bind(self, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any] | Bypass:
        """Return the call's arguments by name in signature order, defaults applied; a Bypass if they do not bind."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return Bypass("arguments do not match the encode_prompt signature")
        bound.apply_defaults()
        return bound.arguments

    def precomputed(self, arguments: Mapping[str, Any]) -> Bypass | None:
        """Return a Bypass when the call passes precomputed embeddings (a pass-through), else None."""
        for name in self._precomputed_names:
            if arguments[name] is not None:
                return Bypass(f"precomputed {name} given")
        if self._var_keyword is not None:
            extra = arguments[self._var_keyword]
            for name in PRECOMPUTED_EMBED_ARGS:
                if extra.get(name) is not None:
                    return Bypass(f"precomputed {name} given")
        return None

    def build_from_arguments(
        self,
        arguments: Mapping[str, Any],
        *,
        held: tuple | None = None,
        row: bool = False,
        host_views: Mapping[int, np.ndarray] | None = None,
    ) -> CallKey | Bypass:
        """Return the key for already-bound arguments (defaults applied).

        ``held``: what the call read from the pipeline that its key also holds (see :mod:`.reads`), keyed as
        one more argument named :data:`STATE`. ``row``: the key of one row of a call whose arguments
        :meth:`precomputed` already cleared (the check is per call, not per row). ``host_views``: numpy
        views of contiguous CPU tensors among the arguments that the caller already made, by
        ``id(tensor)``: read, not made again.
        """
        if not row:
            precomputed = self.precomputed(arguments)
            if precomputed is not None:
                return precomputed
        return self._key(arguments, held, row, host_views)

    def _key(
        self, arguments: Mapping[str, Any], held: tuple | None, row: bool, host_views: Mapping[int, np.ndarray] | None
    ) -> CallKey | Bypass:
        if held is not None:
            arguments = {**arguments, STATE: held}
        encoder = _Encoder(self.digest, host_views)
        encode = encoder.encode
        # Bound arguments come in signature order, so values alone identify the call.
        parts = [self.model_tag, _ROW] if row else [self.model_tag]
        for name, value in arguments.items():
            try:
                parts.append(encode(value))
            except _Uncacheable as why:
                return Bypass(f"argument {name!r}: {why}")
            except Exception as error:
                # User code raised (a __class__ property, an image's lazy load, a dict resized by
                # another thread) or the stack ran out: the call may still work uncached.
                return Bypass(f"argument {name!r}: {type(error).__qualname__} raised while keying")
        return CallKey(tuple(parts), tuple(encoder.witness))


#: Marks an entry whose value carries its encoder-input record: ``(SEALED, record, value)``.
SEALED = "prompt-embed-cache:encoder-input"


def seal(value: Any, record: str | None) -> Any:
    """Return what an entry holds for ``value`` encoded with record ``record`` (None: no record)."""
    return value if record is None else (SEALED, record, value)


def unseal(value: Any) -> tuple[Any, str | None]:
    """Return an entry's value and its record (None: it has none)."""
    if type(value) is tuple and len(value) == 3 and type(value[0]) is str and value[0] == SEALED:
        return value[2], value[1]
    return value, None


def with_encoder_input(key: CallKey, first_input: str) -> CallKey:
    """Return the key of the entry for ``key``'s call made with ``first_input`` reaching its first encoder call: a
    call whose key holds the same arguments and pipeline state while hidden state feeds its encoder another input
    is kept beside the first entry, not over it, so that each input is encoded once."""
    return CallKey((*key.identity, (SEALED, first_input)), key.witness)
