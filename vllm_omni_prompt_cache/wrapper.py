"""How a pipeline's ``encode_prompt`` is intercepted: install, uninstall, hit, miss, bypass.

Same contract as upstream vLLM-Omni's ``install_prompt_embed_cache``: idempotent,
``None`` for a pipeline without a callable ``encode_prompt``, and the cache and
the original function stored on the pipeline as ``_prompt_embed_cache`` and
``_prompt_embed_cache_original_fn``. What differs is the key (tensors are keyed
by content, see :mod:`.keys`), the store (budgets, verification,
single-flight, bypass reasons, see :mod:`.store`), and rows: a pipeline with a
row layout has each row of a batched call cached on its own (see :mod:`.rows`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from vllm_omni_prompt_cache.keys import Bypass, CallKey, CallKeyBuilder, freeze_witness, witness_matches
from vllm_omni_prompt_cache.rows import ROW_LAYOUT_ATTRIBUTE, LayoutMismatch, RowLayout, RowSplit, UnstackableRows
from vllm_omni_prompt_cache.store import PromptEmbedCache

logger = logging.getLogger(__name__)

DISABLED_REASON = "cache disabled"
#: Whole-call reason for the call that found its row layout not to match the function's outputs
#: (the calls after it have no layout: they are keyed whole like any pipeline's).
LAYOUT_DROPPED_REASON = "row layout dropped: it did not match encode_prompt's outputs"
#: Whole-call reason for a call whose rows differ in dtype, device or shape: served uncached.
UNSTACKABLE_REASON = "rows could not be stacked into one output (dtype, device or shape differed)"


def _set_attribute(pipeline: Any, name: str, value: Any) -> None:
    # diffusers / torch.nn.Module pipelines may refuse plain assignment of some values.
    try:
        setattr(pipeline, name, value)
    except Exception:
        object.__setattr__(pipeline, name, value)


def install_prompt_embed_cache(
    pipeline: Any,
    *,
    max_size: int = 32,
    enabled: bool = True,
    model_tag: str | None = None,
    max_bytes: int | None = None,
    verify: bool = True,
    digest: Callable[[Any], bytes] | None = None,
    report: Callable[[PromptEmbedCache], None] | None = None,
    row_layout: RowLayout | None = None,
) -> PromptEmbedCache | None:
    """Wrap ``pipeline.encode_prompt`` with a content-keyed cache; return the cache or None.

    ``max_bytes`` bounds tensor bytes held (values plus verification bytes);
    ``verify`` compares input bytes on every hit; ``digest`` replaces xxh3-128
    (tests use a weak one to force collisions); ``report(cache)`` runs after each
    call (the vLLM-Omni worker uses it for a rate-limited log line); ``row_layout``
    caches batched calls row by row (default: the pipeline's ``prompt_embed_row_layout``).
    """
    existing = getattr(pipeline, "_prompt_embed_cache", None)
    if existing is not None:
        return existing

    encode_fn = getattr(pipeline, "encode_prompt", None)
    if encode_fn is None or not callable(encode_fn):
        logger.debug("Prompt-embed cache: %s has no encode_prompt(); skipping.", type(pipeline).__name__)
        return None
    try:
        signature = inspect.signature(encode_fn)
    except (TypeError, ValueError) as why:
        logger.warning(
            "Prompt-embed cache: cannot read the signature of %s.encode_prompt (%s); not installed.",
            type(pipeline).__name__,
            why,
        )
        return None

    cache = PromptEmbedCache(max_size=max_size, enabled=enabled, max_bytes=max_bytes, verify=verify)
    tag = model_tag or type(pipeline).__name__
    layout = _usable_layout(row_layout or getattr(pipeline, ROW_LAYOUT_ATTRIBUTE, None), signature, tag)
    calls = _CachedCalls(cache, encode_fn, signature, CallKeyBuilder(signature, tag, digest=digest), layout)

    @functools.wraps(encode_fn)
    def cached_encode_prompt(*args: Any, **kwargs: Any) -> Any:
        result = calls(args, kwargs)
        if report is not None:
            report(cache)
        return result

    cached_encode_prompt.__wrapped__ = encode_fn  # type: ignore[attr-defined]
    _set_attribute(pipeline, "encode_prompt", cached_encode_prompt)
    object.__setattr__(pipeline, "_prompt_embed_cache", cache)
    object.__setattr__(pipeline, "_prompt_embed_cache_original_fn", encode_fn)
    logger.info(
        "Prompt-embed cache (content-keyed) installed on %s: max_size=%d, max_bytes=%s, verify=%s, enabled=%s, "
        "rows: %s.",
        tag,
        max_size,
        "unlimited" if max_bytes is None else max_bytes,
        verify,
        enabled,
        "whole calls only" if layout is None else layout.name,
    )
    return cache


def _usable_layout(layout: Any, signature: inspect.Signature, tag: str) -> RowLayout | None:
    """Return ``layout`` if it can describe ``signature``; say once why not otherwise."""
    if layout is None:
        return None
    if not isinstance(layout, RowLayout):
        logger.warning(
            "Prompt-embed cache: %s's %s is a %s, not a RowLayout; calls are keyed whole.",
            tag,
            ROW_LAYOUT_ATTRIBUTE,
            type(layout).__qualname__,
        )
        return None
    why = layout.unusable_with(signature)
    if why is not None:
        logger.warning(
            "Prompt-embed cache: row layout %r does not fit %s (%s); calls are keyed whole.", layout.name, tag, why
        )
        return None
    return layout


class _CachedCalls:
    """Serves one pipeline's ``encode_prompt`` calls: whole, row by row, or bypassed with a reason."""

    def __init__(
        self,
        cache: PromptEmbedCache,
        encode_fn: Callable[..., Any],
        signature: inspect.Signature,
        key_builder: CallKeyBuilder,
        layout: RowLayout | None,
    ) -> None:
        self.cache = cache
        self.encode_fn = encode_fn
        self.signature = signature
        self.key_builder = key_builder
        self.layout = layout

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        cache = self.cache
        if not cache.enabled:
            cache.record_bypass(DISABLED_REASON)
            return self.encode_fn(*args, **kwargs)
        arguments = self.key_builder.bind(args, kwargs)
        if type(arguments) is Bypass:
            cache.record_bypass(arguments.reason)
            return self.encode_fn(*args, **kwargs)
        layout = self.layout
        if layout is None or self.key_builder.precomputed(arguments) is not None:
            return self._whole(args, kwargs, arguments, rows=None)
        split = layout.split(arguments)
        if type(split) is not RowSplit:
            cache.record_whole_call(split)
            return self._whole(args, kwargs, arguments, rows=layout.batch_size(arguments))
        try:
            return self._by_rows(split, args, kwargs)
        except (LayoutMismatch, UnstackableRows) as error:
            # The rows path counted this call already: serve it once more, whole and uncached.
            if type(error) is LayoutMismatch:
                self._drop_layout(layout, error)
            cache.record_whole_call(LAYOUT_DROPPED_REASON if type(error) is LayoutMismatch else UNSTACKABLE_REASON)
            cache.record_rows_encoded(split.batch)
            return self.encode_fn(*args, **kwargs)

    def _whole(self, args: tuple, kwargs: dict, arguments: dict[str, Any], rows: int | None) -> Any:
        """Serve the call under one key; ``rows``: how many rows it encodes, when a layout says."""
        cache = self.cache

        def encode() -> Any:
            if rows:
                cache.record_rows_encoded(rows)
            return self.encode_fn(*args, **kwargs)

        key = self.key_builder.build_from_arguments(arguments)
        if type(key) is Bypass:
            cache.record_bypass(key.reason)
            return encode()
        return cache.get_or_compute(key, encode)

    def _by_rows(self, split: RowSplit, args: tuple, kwargs: dict) -> Any:
        """Serve each distinct row from the cache or one encode of it alone; assemble the call's output."""
        distinct: list[tuple[CallKey, int]] = []  # (key, first row with it)
        row_entry: list[int] = []  # row -> its index in ``distinct``
        by_identity: dict[tuple, list[tuple[int, tuple[bytes, ...] | None]]] = {}  # -> (entry, its witness bytes)
        for index in range(split.batch):
            key = self.key_builder.build_from_arguments(split.key_arguments(index), row=True)
            if type(key) is Bypass:  # a shared argument no key can hold: no row can be keyed
                self.cache.record_bypass(key.reason)
                self.cache.record_rows_encoded(split.batch)
                return self.encode_fn(*args, **kwargs)
            row_entry.append(self._entry_for(key, index, distinct, by_identity))

        def encode_row(entry: int) -> Any:
            row_arguments = split.call_arguments(distinct[entry][1])
            bound = inspect.BoundArguments(self.signature, row_arguments)  # type: ignore[arg-type]
            return split.check_row(self.encode_fn(*bound.args, **bound.kwargs))

        keys = [key for key, _ in distinct]
        values = self.cache.get_or_compute_rows(keys, encode_row, repeats=split.batch - len(keys))
        return split.assemble([values[entry] for entry in row_entry])

    def _entry_for(
        self,
        key: CallKey,
        index: int,
        distinct: list[tuple[CallKey, int]],
        by_identity: dict[tuple, list[tuple[int, tuple[bytes, ...] | None]]],
    ) -> int:
        """Return the distinct entry row ``index`` shares, adding one; colliding rows stay apart."""
        entries = by_identity.setdefault(key.identity, [])
        if not self.cache.verify and entries:  # the digest alone decides, as for every hit
            return entries[0][0]
        for entry, witness in entries:
            if witness_matches(witness, key.witness):
                return entry
        entries.append((len(distinct), freeze_witness(key.witness) if self.cache.verify else None))
        distinct.append((key, index))
        return len(distinct) - 1

    def _drop_layout(self, layout: RowLayout, mismatch: LayoutMismatch) -> None:
        if self.layout is layout:
            self.layout = None
            logger.warning(
                "Prompt-embed cache: row layout %r does not match encode_prompt's outputs (%s); "
                "from now on its calls are keyed whole.",
                layout.name,
                mismatch,
            )


def uninstall_prompt_embed_cache(pipeline: Any) -> None:
    """Restore the original ``encode_prompt`` on ``pipeline`` if it was wrapped."""
    original = getattr(pipeline, "_prompt_embed_cache_original_fn", None)
    if original is None:
        return
    if getattr(original, "__self__", None) is pipeline and "encode_prompt" in vars(pipeline):
        # The original was the class's bound method: drop the instance attribute.
        object.__delattr__(pipeline, "encode_prompt")
    else:
        _set_attribute(pipeline, "encode_prompt", original)
    for name in ("_prompt_embed_cache", "_prompt_embed_cache_original_fn"):
        with contextlib.suppress(AttributeError):
            object.__delattr__(pipeline, name)
