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


class CallKey(NamedTuple):
    """The key of one cacheable call: ``identity`` to look up, ``witness`` to verify."""

    identity: tuple
    witness: tuple  # of objects exposing the buffer protocol (numpy arrays, bytes)


class Bypass(NamedTuple):
    """Why a call was not cached; ``reason`` is short and bounded in variety."""

    reason: str


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

    __slots__ = ("digest", "items_left", "open_ids", "witness")

    def __init__(self, digest: Callable[[Any], bytes]) -> None:
        self.digest = digest
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
            try:
                array = tensor.numpy()
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


#: The name under which a key holds the instance data of a method cached whole (an extra bound argument).
STATE = "self"


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

    def build_from_arguments(self, arguments: Mapping[str, Any], *, held: tuple | None = None) -> CallKey | Bypass:
        """Return the key for already-bound arguments (defaults applied); ``held``: the instance data the key of a
        call cached whole also holds, keyed as one more argument named :data:`STATE`."""
        precomputed = self.precomputed(arguments)
        if precomputed is not None:
            return precomputed
        if held is not None:
            arguments = {**arguments, STATE: held}
        encoder = _Encoder(self.digest)
        encode = encoder.encode
        # Bound arguments come in signature order, so values alone identify the call.
        parts = [self.model_tag]
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
