"""How a pipeline's ``encode_prompt`` is intercepted: install, uninstall, hit, miss, bypass.

Same contract as upstream vLLM-Omni's ``install_prompt_embed_cache``: idempotent,
``None`` for a pipeline without a callable ``encode_prompt``, and the cache and
the original function stored on the pipeline as ``_prompt_embed_cache`` and
``_prompt_embed_cache_original_fn``. What differs is the key (tensors are keyed
by content, see :mod:`.keys`) and the store (budgets, verification,
single-flight, bypass reasons, see :mod:`.store`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from vllm_omni_prompt_cache.keys import Bypass, CallKeyBuilder
from vllm_omni_prompt_cache.store import PromptEmbedCache

logger = logging.getLogger(__name__)

DISABLED_REASON = "cache disabled"


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
) -> PromptEmbedCache | None:
    """Wrap ``pipeline.encode_prompt`` with a content-keyed cache; return the cache or None.

    ``max_bytes`` bounds tensor bytes held (values plus verification bytes);
    ``verify`` compares input bytes on every hit; ``digest`` replaces xxh3-128
    (tests use a weak one to force collisions); ``report(cache)`` runs after each
    call (the vLLM-Omni worker uses it for a rate-limited log line).
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
    key_builder = CallKeyBuilder(signature, tag, digest=digest)

    def lookup(args: tuple, kwargs: dict) -> Any:
        if not cache.enabled:
            cache.record_bypass(DISABLED_REASON)
            return encode_fn(*args, **kwargs)
        key = key_builder.build(args, kwargs)
        if type(key) is Bypass:
            cache.record_bypass(key.reason)
            return encode_fn(*args, **kwargs)
        return cache.get_or_compute(key, lambda: encode_fn(*args, **kwargs))

    @functools.wraps(encode_fn)
    def cached_encode_prompt(*args: Any, **kwargs: Any) -> Any:
        result = lookup(args, kwargs)
        if report is not None:
            report(cache)
        return result

    cached_encode_prompt.__wrapped__ = encode_fn  # type: ignore[attr-defined]
    _set_attribute(pipeline, "encode_prompt", cached_encode_prompt)
    object.__setattr__(pipeline, "_prompt_embed_cache", cache)
    object.__setattr__(pipeline, "_prompt_embed_cache_original_fn", encode_fn)
    logger.info(
        "Prompt-embed cache (content-keyed) installed on %s: max_size=%d, max_bytes=%s, verify=%s, enabled=%s.",
        tag,
        max_size,
        "unlimited" if max_bytes is None else max_bytes,
        verify,
        enabled,
    )
    return cache


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
