# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""
Prompt-embedding cache for diffusion pipelines.

Text encoders are the most expensive per-request preprocessing step of most
diffusion pipelines, and RL rollouts (GRPO and its variants) send the same
prompt many times with different seeds. This module wraps a pipeline's
``encode_prompt`` in a small LRU cache so those repeats reuse one encode.

Keys
    A call is keyed by its bound arguments (defaults applied) and the model
    tag. Strings, numbers, ``None``, bytes, ``torch.device`` / ``torch.dtype``
    and lists/tuples/dicts of them appear by value, each tagged with its type
    so ``1``, ``1.0`` and ``True`` stay apart. Tensors, numpy arrays and PIL
    images appear by content: dtype (mode for images), shape and a 128-bit
    digest of their CPU bytes. The device, strides and object identity never
    enter the key, so the K fresh ``prompt_ids`` tensors of one prompt share
    one entry whether they arrive on the CPU or the GPU.

Exactness
    A digest is not proof. Each key also carries the bytes its digests were
    computed from (the *witness*); an entry keeps a copy, and every hit
    compares the two. A digest collision costs an encode, never another
    prompt's embedding.

Bypasses
    Anything else (tensor subclasses, custom objects, a precomputed
    ``*_embeds`` argument) runs the encoder uncached. Each distinct reason is
    logged once per pipeline and counted in :meth:`PromptEmbedCache.bypass_reasons`.

Memory
    ``max_size`` bounds the entries and ``max_bytes`` (optional) the bytes
    they hold: output tensors (on their device) plus witnesses (host memory).
    Values are detached and shared with later callers, who treat them as
    read-only; an output tensor that is one of the call's own inputs (a mask
    handed back) is copied first. The diffusion worker clears the cache before
    it sleeps, since the entries live outside the allocator's pools.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys
import threading
from collections import Counter, OrderedDict
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger

logger = init_logger(__name__)

try:  # xxHash is optional in vLLM (its prefix-cache hashes use it when present)
    from xxhash import xxh3_128_digest as _digest
except ImportError:  # blake3 is a vLLM requirement: slower, equally exact (the witness decides)
    import blake3

    def _digest(data: np.ndarray) -> bytes:
        return blake3.blake3(data).digest(length=16)


# Sentinel returned by :func:`_hashable` for a value that has no exact key.
_NOT_HASHABLE = object()

# Sentinel returned by :meth:`PromptEmbedCache.get` to tell a miss from a cached ``None``.
_CACHE_MISS = object()

# A non-None value for one of these means the caller already holds the embeddings: the
# call is a cheap pass-through, and keying it would hash a large tensor for nothing.
_PRECOMPUTED_EMBED_ARGS = (
    "prompt_embeds",
    "negative_prompt_embeds",
    "pooled_prompt_embeds",
    "negative_pooled_prompt_embeds",
    "prompt_embeds_mask",
    "negative_prompt_embeds_mask",
)

# Dict keys that repr() spells uniquely, so sorting by repr gives one canonical order.
_DICT_KEY_TYPES = (str, int, float, bool, bytes, type(None))

_ENABLE_ENV = "OMNI_DIFFUSION_PROMPT_EMBED_CACHE"
_SIZE_ENV = "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE"
_MAX_BYTES_ENV = "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_MAX_BYTES"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_BYTE_UNITS = {"": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_BYTES_PATTERN = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")


def _tensor_bytes(tensor: torch.Tensor) -> np.ndarray | None:
    """Return a tensor's values as contiguous CPU bytes (uint8), or None when it has none to read."""
    if type(tensor) is torch.Tensor and tensor.is_cpu and tensor.is_contiguous() and not tensor.requires_grad:
        try:  # the common case, token ids already on the CPU: a view, no copy
            return tensor.numpy().reshape(-1).view(np.uint8)
        except (TypeError, RuntimeError):  # bf16 or fp8 (no numpy dtype), a conjugate or negative view
            pass
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return None  # FakeTensor, DTensor, ...: their bytes are not their values
    if tensor.layout != torch.strided or tensor.is_meta or tensor.is_quantized or tensor.is_nested:
        return None
    tensor = tensor.detach().resolve_conj().resolve_neg().contiguous()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _content(kind: str, dtype: str, shape: tuple, data: np.ndarray | bytes, witness: list | None) -> tuple:
    """Key an array-like value by kind, dtype, shape and digest; its bytes join the witness."""
    if witness is not None:
        witness.append(data)
    return (kind, dtype, shape, _digest(data))


def _hashable(obj: Any, witness: list | None = None) -> Any:
    """Return an exact, hashable stand-in for *obj*, or ``_NOT_HASHABLE``.

    Array-like values are keyed by a digest of their bytes; pass a list as
    *witness* to collect those bytes (see :class:`_CallKey`). Python scalars
    and containers are matched by exact type, since a subclass may compare or
    encode differently; tensor subclasses other than ``nn.Parameter`` have no key.
    """
    kind = type(obj)
    if obj is None or kind is str or kind is bytes:
        return obj
    if kind is bool:
        return ("__bool__", obj)
    if kind is int:
        return ("__int__", obj)
    if kind is float:
        return ("__float__", obj.hex())  # keeps -0.0 apart from 0.0; NaN matches NaN
    if kind is torch.device:
        return ("__torch_device__", str(obj))
    if kind is torch.dtype:
        return ("__torch_dtype__", str(obj))
    if isinstance(obj, torch.Tensor):
        data = _tensor_bytes(obj)
        if data is None:
            return _NOT_HASHABLE
        return _content("__torch_tensor__", str(obj.dtype), tuple(obj.shape), data, witness)
    if kind is np.ndarray:
        if obj.dtype.hasobject:
            return _NOT_HASHABLE
        data = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
        return _content("__ndarray__", str(obj.dtype.descr), obj.shape, data, witness)
    if isinstance(obj, np.generic):
        if obj.dtype.hasobject:
            return _NOT_HASHABLE
        return ("__numpy_scalar__", str(obj.dtype.descr), obj.tobytes())
    if kind is list or kind is tuple:
        items = []
        for item in obj:
            h = _hashable(item, witness)
            if h is _NOT_HASHABLE:
                return _NOT_HASHABLE
            items.append(h)
        return ("__seq__", kind.__name__, tuple(items))
    if kind is dict:
        if not all(type(key) in _DICT_KEY_TYPES for key in obj):
            return _NOT_HASHABLE  # a key whose repr may not be unique
        items = []
        for key in sorted(obj, key=repr):
            h = _hashable(obj[key], witness)
            if h is _NOT_HASHABLE:
                return _NOT_HASHABLE
            items.append((repr(key), h))
        return ("__dict__", tuple(items))
    image_module = sys.modules.get("PIL.Image")  # no PIL imported means no PIL image
    if image_module is not None and isinstance(obj, image_module.Image):
        palette = obj.palette if obj.mode in ("P", "PA") else None
        transparency = _hashable(obj.info.get("transparency"))
        if transparency is _NOT_HASHABLE:
            return _NOT_HASHABLE
        colours = None if palette is None else (palette.mode, tuple(obj.getpalette(rawmode=None) or ()))
        extra = (colours, transparency)
        return (*_content("__pil_image__", obj.mode, obj.size, obj.tobytes(), witness), extra)
    return _NOT_HASHABLE


def _same_bytes(ours: tuple, theirs: tuple) -> bool:
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs, strict=False):  # lengths checked above
        if (a if type(a) is bytes else a.tobytes()) != (b if type(b) is bytes else b.tobytes()):
            return False
    return True


class _CallKey:
    """The key of one call: ``identity`` (hashable; digests stand for contents) and the
    ``witness``, the bytes those digests were computed from. Two keys are equal only
    when both are, and :class:`PromptEmbedCache` compares the witness on every hit.
    """

    __slots__ = ("identity", "witness")

    def __init__(self, identity: tuple, witness: tuple) -> None:
        self.identity = identity
        self.witness = witness

    def __hash__(self) -> int:
        return hash(self.identity)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _CallKey):
            return NotImplemented
        return self.identity == other.identity and _same_bytes(self.witness, other.witness)

    def copied(self) -> _CallKey:
        """Return this key with its own copy of the witness bytes."""
        return _CallKey(self.identity, tuple(p if type(p) is bytes else p.tobytes() for p in self.witness))


def _storage_id(tensor: torch.Tensor) -> tuple | None:
    """Return where a tensor's storage lives, or None for tensors without one (sparse, nested, ...)."""
    try:
        storage = tensor.untyped_storage()
        return (storage.device, storage.data_ptr(), storage.nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _overlaps(tensor: torch.Tensor, inputs: list[tuple[str, int, int]]) -> bool:
    """Return whether the tensor's storage overlaps memory of the call's inputs (see :func:`_input_memory`)."""
    storage = _storage_id(tensor)
    if storage is None:
        return False
    device, start = str(storage[0]), storage[1]
    end = start + storage[2]
    return any(device == in_device and start < in_end and in_start < end for in_device, in_start, in_end in inputs)


def _detach_output(value: Any, inputs: list[tuple[str, int, int]] | None = None) -> Any:
    """Detach tensors in the return value so the cache never holds grad state.

    A tensor whose memory overlaps *inputs* (the call's own arguments) is cloned.
    """
    if isinstance(value, torch.Tensor):
        detached = value.detach()
        if inputs and _overlaps(detached, inputs):
            detached = detached.clone()
        return detached
    if isinstance(value, tuple):
        detached = tuple(_detach_output(v, inputs) for v in value)
        return type(value)(*detached) if hasattr(value, "_fields") else detached  # keep named tuples
    if isinstance(value, list):
        return [_detach_output(v, inputs) for v in value]
    if isinstance(value, dict):
        return {k: _detach_output(v, inputs) for k, v in value.items()}
    return value


def _value_nbytes(value: Any, seen: set | None = None) -> int | None:
    """Return the bytes of the tensor storages *value* keeps alive, each counted once (None: unknown)."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        storage = _storage_id(value)
        if storage is None:
            return None
        if storage in seen:
            return 0
        seen.add(storage)
        return storage[2]
    items = value if isinstance(value, (tuple, list)) else value.values() if isinstance(value, dict) else ()
    total = 0
    for item in items:
        nbytes = _value_nbytes(item, seen)
        if nbytes is None:
            return None
        total += nbytes
    return total


def _split_key(key: Any) -> tuple[Any, tuple]:
    """Return what a key is stored under and the witness its hits must match (none for plain keys)."""
    return (key.identity, key.witness) if type(key) is _CallKey else (key, ())


class PromptEmbedCache:
    """Thread-safe LRU cache for ``encode_prompt`` outputs, bounded in entries and, optionally, bytes.

    It stores whatever ``encode_prompt`` returns (tensor, tuple of tensors,
    ``None``, ...). A value that alone exceeds ``max_bytes`` is not stored.
    """

    def __init__(self, max_size: int = 32, enabled: bool = True, max_bytes: int | None = None) -> None:
        if type(max_size) is not int or max_size <= 0:
            raise ValueError(f"max_size must be a positive integer, got {max_size!r}")
        if max_bytes is not None and (type(max_bytes) is not int or max_bytes <= 0):
            raise ValueError(f"max_bytes must be a positive integer or None (no limit), got {max_bytes!r}")
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.enabled = enabled
        self._store: OrderedDict[Any, tuple[Any, int, tuple]] = OrderedDict()  # -> (value, bytes, witness)
        self._lock = threading.Lock()
        self._nbytes = 0
        self._bypass_reasons: Counter[str] = Counter()
        self.hits = 0
        self.misses = 0
        self.bypassed = 0

    def get(self, key: Any) -> Any:
        """Return the cached value, or ``_CACHE_MISS`` (a cached ``None`` is a hit).

        An entry whose witness differs from the key's (a digest collision) is a miss.
        """
        stored_under, witness = _split_key(key)
        with self._lock:
            entry = self._store.get(stored_under)
            if entry is None or not _same_bytes(entry[2], witness):
                self.misses += 1
                return _CACHE_MISS
            self._store.move_to_end(stored_under)
            self.hits += 1
            return entry[0]

    def put(self, key: Any, value: Any) -> bool:
        """Store *value*, evicting least-recently-used entries; False when it alone is over
        ``max_bytes``, or holds tensors without a countable storage (sparse, nested).

        The witness is copied: the caller may write into its tensors later.
        """
        stored_under, witness = _split_key(key)
        witness = tuple(part if type(part) is bytes else part.tobytes() for part in witness)
        value_nbytes = _value_nbytes(value)
        if value_nbytes is None:  # an output whose memory cannot be counted is not kept
            return False
        nbytes = value_nbytes + sum(len(part) for part in witness)
        with self._lock:
            old = self._store.pop(stored_under, None)
            if old is not None:
                self._nbytes -= old[1]
            if self.max_bytes is not None and nbytes > self.max_bytes:
                return False
            self._store[stored_under] = (value, nbytes, witness)
            self._nbytes += nbytes
            while len(self._store) > self.max_size or (self.max_bytes is not None and self._nbytes > self.max_bytes):
                self._nbytes -= self._store.popitem(last=False)[1][1]
            return True

    def clear(self) -> None:
        """Drop every entry; the counters keep their totals."""
        with self._lock:
            self._store.clear()
            self._nbytes = 0

    def count_bypass(self, reason: str) -> bool:
        """Count a call that ran uncached; return True the first time *reason* is seen."""
        with self._lock:
            self.bypassed += 1
            self._bypass_reasons[reason] += 1
            return self._bypass_reasons[reason] == 1

    def bypass_reasons(self) -> dict[str, int]:
        """Return how many calls bypassed the cache, by reason."""
        with self._lock:
            return dict(self._bypass_reasons)

    def stats(self) -> dict[str, int | None]:
        with self._lock:
            return {
                "size": len(self._store),
                "max_size": self.max_size,
                "bytes": self._nbytes,
                "max_bytes": self.max_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "bypassed": self.bypassed,
            }


def _bind(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any] | str:
    """Return the call's arguments by name, defaults applied, or why the call gets no key."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return "arguments that do not match encode_prompt's signature"
    bound.apply_defaults()
    for name in _PRECOMPUTED_EMBED_ARGS:
        if bound.arguments.get(name) is not None:
            return f"precomputed {name}"
    return bound.arguments


def _key_or_reason(signature: inspect.Signature, model_tag: str, args: tuple, kwargs: dict) -> _CallKey | str:
    """Return the call's cache key, or why the call must bypass the cache."""
    arguments = _bind(signature, args, kwargs)
    if type(arguments) is str:
        return arguments
    witness: list = []
    items = []
    for name in sorted(arguments):
        value = arguments[name]
        try:
            h = _hashable(value, witness)
        except Exception as error:  # a value that fails while being read, or nests too deep
            return f"argument {name!r} raising {type(error).__name__} while being keyed"
        if h is _NOT_HASHABLE:
            return f"argument {name!r} of type {type(value).__module__}.{type(value).__qualname__}"
        items.append((name, h))
    return _CallKey((model_tag, tuple(items)), tuple(witness))


def _build_key(signature: inspect.Signature, model_tag: str, args: tuple, kwargs: dict) -> _CallKey | None:
    """Return the call's cache key, or ``None`` if this call must bypass the cache.

    Positional and keyword spellings of one call bind to the same key.
    """
    key = _key_or_reason(signature, model_tag, args, kwargs)
    return None if type(key) is str else key


def _input_memory(value: Any, found: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Collect the memory (device, start, end) of the tensors and numpy arrays in an already-keyed
    argument (so acyclic and of known types), which an output may be built on."""
    if isinstance(value, torch.Tensor):
        storage = _storage_id(value)
        if storage is not None:
            found.append((str(storage[0]), storage[1], storage[1] + storage[2]))
    elif isinstance(value, np.ndarray):
        start, end = np.lib.array_utils.byte_bounds(value)
        found.append(("cpu", start, end))
    elif isinstance(value, (list, tuple)):
        for item in value:
            _input_memory(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _input_memory(item, found)
    return found


def _max_bytes_from_env() -> int | None:
    """Read ``OMNI_DIFFUSION_PROMPT_EMBED_CACHE_MAX_BYTES``: None when unset, an error when invalid."""
    raw = os.environ.get(_MAX_BYTES_ENV)
    if raw is None or raw.strip().lower() in ("", "none"):
        return None
    match = _BYTES_PATTERN.match(raw)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS or int(match.group(1)) == 0:
        raise ValueError(
            f"{_MAX_BYTES_ENV}={raw!r} (environment variable) is not a byte budget: use a positive "
            "integer, optionally with a unit (KB, MB, GB, KiB, MiB, GiB), or 'none' for no limit."
        )
    return int(match.group(1)) * _BYTE_UNITS[unit]


def install_prompt_embed_cache(
    pipeline: Any,
    *,
    max_size: int = 32,
    enabled: bool = True,
    model_tag: str | None = None,
    max_bytes: int | None = None,
) -> PromptEmbedCache | None:
    """Wrap ``pipeline.encode_prompt`` so results are cached by argument content.

    ``max_bytes=None`` reads ``OMNI_DIFFUSION_PROMPT_EMBED_CACHE_MAX_BYTES``
    (unset or ``none``: no byte limit); a number given here wins over it. Idempotent: a second call returns the existing
    cache. Returns ``None`` if the pipeline has no ``encode_prompt``.
    """
    existing = getattr(pipeline, "_prompt_embed_cache", None)
    if existing is not None:
        return existing

    encode_fn = getattr(pipeline, "encode_prompt", None)
    if encode_fn is None or not callable(encode_fn):
        logger.debug("Prompt-embed cache: pipeline %s has no encode_prompt(); skipping.", type(pipeline).__name__)
        return None

    try:
        signature = inspect.signature(encode_fn)
    except (TypeError, ValueError) as e:
        logger.warning(
            "Prompt-embed cache: cannot introspect encode_prompt on %s (%s); skipping.", type(pipeline).__name__, e
        )
        return None

    if max_bytes is None:
        max_bytes = _max_bytes_from_env()
    cache = PromptEmbedCache(max_size=max_size, enabled=enabled, max_bytes=max_bytes)
    tag = model_tag or type(pipeline).__name__

    failed_to_keep: list[Exception] = []

    @functools.wraps(encode_fn)
    def cached_encode_prompt(*args: Any, **kwargs: Any) -> Any:
        if not cache.enabled:
            return encode_fn(*args, **kwargs)
        key = _key_or_reason(signature, tag, args, kwargs)
        if type(key) is str:
            if cache.count_bypass(key):
                logger.info("Prompt-embed cache on %s: calls with %s run uncached (said once).", tag, key)
            return encode_fn(*args, **kwargs)
        hit = cache.get(key)
        if hit is not _CACHE_MISS:
            return hit
        key = key.copied()  # before the encode, which may write into its inputs
        inputs = _input_memory((args, kwargs), [])
        out = encode_fn(*args, **kwargs)
        try:
            # An output built on an input (a mask handed back) is copied: the caller may reuse its buffer.
            kept = cache.put(key, _detach_output(out, inputs))
        except Exception as error:  # e.g. out of memory for the copy: the caller still gets its output
            kept = False
            if not failed_to_keep:
                failed_to_keep.append(error)
                logger.warning("Prompt-embed cache on %s: an output could not be kept (%r; said once).", tag, error)
        if not kept:
            logger.debug("Prompt-embed cache on %s: an output over max_bytes or of unknown size was not kept.", tag)
        return out

    cached_encode_prompt.__wrapped__ = encode_fn  # type: ignore[attr-defined]
    # Use object.__setattr__ to bypass diffusers ModelMixin attribute checks.
    try:
        pipeline.encode_prompt = cached_encode_prompt  # type: ignore[assignment]
    except Exception:
        object.__setattr__(pipeline, "encode_prompt", cached_encode_prompt)
    object.__setattr__(pipeline, "_prompt_embed_cache", cache)
    object.__setattr__(pipeline, "_prompt_embed_cache_original_fn", encode_fn)

    logger.info(
        "Prompt-embed cache installed on %s (max_size=%d, max_bytes=%s, enabled=%s).",
        tag,
        max_size,
        cache.max_bytes,
        enabled,
    )
    return cache


def uninstall_prompt_embed_cache(pipeline: Any) -> None:
    """Restore the original ``encode_prompt`` on *pipeline* if wrapped."""
    original = getattr(pipeline, "_prompt_embed_cache_original_fn", None)
    if original is None:
        return
    try:
        pipeline.encode_prompt = original  # type: ignore[assignment]
    except Exception:
        object.__setattr__(pipeline, "encode_prompt", original)
    for attr in ("_prompt_embed_cache", "_prompt_embed_cache_original_fn"):
        if hasattr(pipeline, attr):
            try:
                delattr(pipeline, attr)
            except Exception:
                object.__setattr__(pipeline, attr, None)


def resolve_prompt_embed_cache_config(
    enable: bool | None = None,
    max_size: int | None = None,
) -> tuple[bool, int]:
    """Combine explicit args with env-var overrides.

    ``OMNI_DIFFUSION_PROMPT_EMBED_CACHE`` (``1``/``0``/``true``/``false``/``yes``/``no``/``on``/``off``)
    and ``OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE`` (positive int) win over the
    arguments. An invalid value is ignored with a warning that names it.
    """
    env_enable = os.environ.get(_ENABLE_ENV)
    if env_enable is not None:
        parsed = env_enable.strip().lower()
        if parsed in _TRUE:
            enable = True
        elif parsed in _FALSE:
            enable = False
        else:
            logger.warning(
                "Ignoring %s=%r: expected one of %s; the cache stays %s.",
                _ENABLE_ENV,
                env_enable,
                "/".join(_TRUE + _FALSE),
                "enabled" if enable else "disabled",
            )

    env_size = os.environ.get(_SIZE_ENV)
    if env_size is not None:
        try:
            env_size_int = int(env_size)
        except ValueError:
            env_size_int = 0
        if env_size_int > 0:
            max_size = env_size_int
        else:
            logger.warning(
                "Ignoring %s=%r: expected a positive integer; using max_size=%d.", _SIZE_ENV, env_size, max_size or 32
            )

    return bool(enable), int(max_size or 32)
