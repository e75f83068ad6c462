"""One pipeline's installation: its text encoders' calls served from the store, and its encode methods wrapped.

:class:`Installation` is what the cache sets on a pipeline besides upstream's two attributes (``_prompt_embed_cache``,
``_prompt_embed_cache_original_fn``): the store, the :class:`~.encoder_calls.EncoderCalls` that serves every call of
the pipeline's text encoders, and each wrapped method's :class:`~.method_calls.MethodCalls`. ``encode_prompt`` and
the declared methods are wrapped at install; a method of the pipeline seen calling a text encoder outside every
wrapped one is wrapped then (``find_encodes``), so that its calls are counted under its name, one call at a time.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from vllm_omni_prompt_cache.calls.encoder_calls import EncoderCalls
from vllm_omni_prompt_cache.calls.method_calls import MethodCalls, cached_method
from vllm_omni_prompt_cache.calls.row_calls import RowCalls
from vllm_omni_prompt_cache.counts.counters import ENCODE_PROMPT
from vllm_omni_prompt_cache.keys.call_key import CallKeyBuilder
from vllm_omni_prompt_cache.store.prompt_embed_cache import PromptEmbedCache

logger = logging.getLogger(__name__)

#: Where a pipeline holds its :class:`Installation`.
INSTALLATION_ATTRIBUTE = "_prompt_embed_cache_installation"
#: Upstream's attributes: the cache, and the original ``encode_prompt`` (None when the pipeline has none).
CACHE_ATTRIBUTE = "_prompt_embed_cache"
ORIGINAL_ATTRIBUTE = "_prompt_embed_cache_original_fn"


class Installation:
    """Everything the cache keeps for one pipeline (see the module docstring)."""

    def __init__(
        self,
        pipeline: Any,
        cache: PromptEmbedCache,
        tag: str,
        digest: Callable[[Any], bytes] | None,
        report: Callable[[PromptEmbedCache], None] | None,
        *,
        find_encodes: bool = True,
    ) -> None:
        self.pipeline = pipeline
        self.cache = cache
        self.tag = tag
        self.digest = digest
        self.report = report
        self.inside = threading.local()  # .active: a wrapped method of this pipeline runs on this thread
        self.originals: dict[str, Callable[..., Any]] = {}  # each wrapped method's original, by name
        self.methods: dict[str, MethodCalls] = {}  # what serves each wrapped method's calls, by name
        self._lock = threading.RLock()
        #: the encode being gathered from encoder calls outside every wrapped method: its shared frames (outermost
        #: first) and the encoders it called
        self._open: tuple[list[tuple[str, Any]], set[str]] | None = None
        self.encoder_calls = EncoderCalls(pipeline, cache, tag, self._found if find_encodes else None, digest)
        self.encoder_calls.rows = RowCalls(self.encoder_calls)

    @property
    def encoders(self) -> list[str]:
        return self.encoder_calls.encoders

    def wrap(
        self, name: str, source: str, encode_fn: Callable[..., Any], signature: inspect.Signature, *, found: bool
    ) -> None:
        """Wrap ``name`` on the pipeline with its own keys and counters; ``found``: seen calling a text encoder."""
        method_tag = self.tag if name == ENCODE_PROMPT else f"{self.tag}.{name}"
        calls = MethodCalls(
            self.cache,
            encode_fn,
            CallKeyBuilder(signature, method_tag, digest=self.digest),
            self.encoder_calls,
            method=name,
            source=source,
            tag=self.tag,
            found=found,
            instance=getattr(encode_fn, "__self__", self.pipeline),
        )
        self.cache.register(name)
        _set_attribute(
            self.pipeline, name, cached_method(calls, encode_fn, self.cache, self.report, self.inside, self.pipeline)
        )
        self.originals[name] = encode_fn
        self.methods[name] = calls

    def _found(self, encoder: str) -> str | None:
        """An encoder runs outside every wrapped method: return the method it is counted under (None: no method of
        the pipeline called it). The calls of different encoders under shared frames belong to one encode (SD3's
        CLIP-L, CLIP-G and T5); a second call of an encoder already seen, or one under other frames, begins the next.
        The deepest method an encode's calls share so far is wrapped, to count its later calls as its own."""
        frames = [
            (name, frame)
            for name, frame in calling_methods(self.pipeline, sys._getframe(2))
            if name not in ("__call__", "forward")
        ]
        if not frames:
            return None
        with self._lock:
            opened = self._open
            if opened is not None:
                shared = _shared(opened[0], frames)
                opened = None if encoder in opened[1] or not shared else (shared, opened[1] | {encoder})
            self._open = opened = opened or (frames, {encoder})
            name = opened[0][-1][0]
            self._settle(name)  # a shallower one, wrapped later, is the outer call: it counts, the inner runs through
            return name

    def _settle(self, name: str) -> None:
        """Wrap ``name``, the deepest method an encode's encoder calls share; the lock is held."""
        if name in self.methods:  # wrapped meanwhile, or called unwrapped by a bound reference
            return
        encode_fn = getattr(self.pipeline, name, None)
        try:
            signature = inspect.signature(encode_fn)
        except (TypeError, ValueError):
            return
        encoders = ", ".join(self.encoders)
        self.wrap(name, f"found: it calls {encoders}", encode_fn, signature, found=True)
        logger.info("Prompt-embed cache: %s.%s calls %s; its calls are counted as its own.", self.tag, name, encoders)

    def describe(self) -> dict[str, Any]:
        """Return what stats() says of the encode methods: how each was found, and what serves its calls."""
        with self._lock:
            return {name: calls.describe() for name, calls in self.methods.items()}

    def attach(self) -> None:
        """Set this installation on the pipeline, with upstream's two attributes."""
        object.__setattr__(self.pipeline, CACHE_ATTRIBUTE, self.cache)
        object.__setattr__(self.pipeline, ORIGINAL_ATTRIBUTE, self.originals.get(ENCODE_PROMPT))
        object.__setattr__(self.pipeline, INSTALLATION_ATTRIBUTE, self)

    def remove(self) -> None:
        """Give the text encoders their classes back (the wrapped methods are restored by the caller)."""
        self.encoder_calls.remove()


def calling_methods(pipeline: Any, frame: Any) -> list[tuple[str, Any]]:
    """Return ``(name, frame)`` of ``pipeline``'s methods running on the stack above ``frame``, outermost first:
    frames whose first argument is the pipeline and whose code is what the pipeline's class resolves that name to."""
    kind = type(pipeline)
    found: list[tuple[str, Any]] = []
    while frame is not None:
        code = frame.f_code
        if code.co_argcount >= 1 and frame.f_locals.get(code.co_varnames[0]) is pipeline:
            name = code.co_name
            if _defines(kind, name, code) and not _defines(torch.nn.Module, name, code):
                found.append((name, frame))
        frame = frame.f_back
    return found[::-1]


def _shared(frames: list[tuple[str, Any]], others: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Return the frames two encoder calls share, outermost first (the same frame objects)."""
    shared = []
    for mine, theirs in zip(frames, others, strict=False):
        if mine[1] is not theirs[1]:
            break
        shared.append(mine)
    return shared


def _defines(kind: type, name: str, code: Any) -> bool:
    for base in kind.__mro__:
        value = vars(base).get(name)
        if value is not None:
            function = getattr(value, "__func__", value)
            function = inspect.unwrap(function) if callable(function) else function
            return getattr(function, "__code__", None) is code
    return False


def restore(pipeline: Any, name: str, original: Callable[..., Any]) -> None:
    """Put ``original`` back as ``pipeline.name``."""
    if getattr(original, "__self__", None) is pipeline and name in vars(pipeline):
        object.__delattr__(pipeline, name)  # the original was the class's bound method
    else:
        _set_attribute(pipeline, name, original)


def _set_attribute(pipeline: Any, name: str, value: Any) -> None:
    # diffusers / torch.nn.Module pipelines may refuse plain assignment of some values.
    try:
        setattr(pipeline, name, value)
    except Exception:
        object.__setattr__(pipeline, name, value)
