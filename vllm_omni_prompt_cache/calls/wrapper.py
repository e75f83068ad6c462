"""How a pipeline's text encoders and encode methods are intercepted: install and uninstall.

Same contract as upstream vLLM-Omni's ``install_prompt_embed_cache``: idempotent, ``None`` for a pipeline with
nothing to serve, and the cache and the original ``encode_prompt`` stored on the pipeline as
``_prompt_embed_cache`` and ``_prompt_embed_cache_original_fn``; everything else the cache keeps for the pipeline is
one :class:`~.installation.Installation` beside them. What differs is what is cached: what each text encoder
returned for the inputs that reached it (:mod:`.encoder_calls`), keyed by their content (:mod:`.call_key`), while
every encode method runs as written; a method that reaches no text encoder the cache recognises is cached whole on
its arguments, as upstream caches it (:mod:`.method_calls`).

:func:`install_prompt_embed_cache`'s settings (``max_size`` and ``enabled`` as keywords, as upstream's; each of the
others an attribute of the one :class:`~.resolved.PromptEmbedCacheSettings` it takes):

* Methods: ``encode_prompt``, and ``methods[class path]`` (a user's declarations), each counted on its own
  (``stats()["methods"]``); with ``find_encodes``, a method seen calling a text encoder outside them too.
* ``max_size`` bounds entries; ``max_bytes`` bounds tensor bytes held (values plus verification bytes); ``verify``
  compares input bytes on every hit; ``digest`` replaces xxh3-128 (tests use a weak one to force collisions);
  ``report(cache)`` runs after each call (the vLLM-Omni worker uses it for a rate-limited log line).
* Tiers below device memory: ``host_bytes`` bounds a host-memory tier that entries leaving device memory move to
  (``"auto"``, the default: only those a level-1 sleep drops, within ``max_size`` and ``max_bytes``; None: none, a
  sleep clears the cache); ``directory`` holds a file per entry within ``directory_bytes`` (None: no limit),
  namespaced by the pipeline's fingerprint (see :mod:`.fingerprint`), shared with every process that uses the same
  directory; with ``directory_key`` its files are signed and unsigned ones refused, and ``directory_group`` (a gid)
  shares what it creates with that group (see :mod:`.directory_trust`).
* ``audit``: the share of encoder calls answered from the cache that are encoded again and compared (see
  :mod:`.audit`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from vllm_omni_prompt_cache.calls.installation import (
    CACHE_ATTRIBUTE,
    INSTALLATION_ATTRIBUTE,
    ORIGINAL_ATTRIBUTE,
    Installation,
    restore,
)
from vllm_omni_prompt_cache.calls.methods import EncodeMethod, find_encode_methods
from vllm_omni_prompt_cache.counts.counters import ENCODE_PROMPT
from vllm_omni_prompt_cache.encoders.fingerprint import code_and_configuration, encode_devices, pipeline_fingerprint
from vllm_omni_prompt_cache.encoders.residency import PLACEMENT_ATTRIBUTE
from vllm_omni_prompt_cache.encoders.text_encoders import text_encoders
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.settings.schema import (
    DIRECTORY_KEY_FILE,
    ENABLE,
    MAX_SIZE,
    PromptEmbedCacheConfigError,
)
from vllm_omni_prompt_cache.store.audit import Audit
from vllm_omni_prompt_cache.store.audit import off_reason as audit_off_reason
from vllm_omni_prompt_cache.store.prompt_embed_cache import PromptEmbedCache
from vllm_omni_prompt_cache.store.tiers.directory import DirectoryTier
from vllm_omni_prompt_cache.store.tiers.directory_trust import Modes, read_key
from vllm_omni_prompt_cache.store.tiers.host import HOST_AT_SLEEP

__all__ = ["PLACEMENT_ATTRIBUTE", "install_prompt_embed_cache", "uninstall_prompt_embed_cache"]

logger = logging.getLogger(__name__)


def install_prompt_embed_cache(
    pipeline: Any,
    *,
    max_size: int = 32,
    enabled: bool = True,
    model_tag: str | None = None,
    settings: PromptEmbedCacheSettings | None = None,
) -> PromptEmbedCache | None:
    """Wrap ``pipeline``'s encode methods with one content-keyed cache; return the cache or None (see the module).

    ``max_size``, ``enabled`` and ``model_tag`` are upstream's keywords, with upstream's defaults, and
    decide those three; every other setting comes from ``settings`` (see :data:`~.schema.SETTINGS`;
    default: every default). ``settings.max_size`` and ``settings.enabled`` are what resolution found:
    a caller passes them as the keywords, as the vLLM-Omni worker does (a resolved value that differs from
    the keyword raises). ``backend`` and ``encoder_on_miss`` are the engine's to apply
    (:mod:`.vllm_omni.runner`), not the install's.
    """
    if (existing := getattr(pipeline, CACHE_ATTRIBUTE, None)) is not None:
        return existing
    settings = _for_install(PromptEmbedCacheSettings() if settings is None else settings, max_size, enabled)
    wrapped = _readable_methods(pipeline, find_encode_methods(pipeline, settings.methods))
    find_encodes = settings.find_encodes
    if not wrapped and not text_encoders(pipeline):
        logger.debug("Prompt-embed cache: %s has no encode method to wrap; skipping.", type(pipeline).__name__)
        return None
    tag = model_tag or type(pipeline).__name__
    tier = _directory_tier(pipeline, wrapped, tag, settings)
    cache = PromptEmbedCache(
        max_size=max_size,
        enabled=enabled,
        max_bytes=settings.max_bytes,
        verify=settings.verify,
        host_bytes=settings.host_bytes,
        directory=tier,
    )
    _set_audit(cache, settings.audit, type(pipeline))
    installation = Installation(pipeline, cache, tag, settings.digest, settings.report, find_encodes=find_encodes)
    for method, encode_fn, signature in wrapped:
        installation.wrap(method.name, method.source, encode_fn, signature, found=False)
    installation.attach()
    cache.attach(encode_methods=installation.describe)
    logger.info(
        "Prompt-embed cache (content-keyed) installed on %s: max_size=%d, max_bytes=%s, verify=%s, enabled=%s, "
        "host tier: %s, directory tier: %s, text encoders: %s, methods: %s; finding encodes: %s.",
        tag,
        max_size,
        "unlimited" if settings.max_bytes is None else settings.max_bytes,
        settings.verify,
        enabled,
        _host_described(settings.host_bytes),
        _directory_described(settings.directory, settings.directory_bytes),
        ", ".join(installation.encoders) or "none recognised (encode methods are cached whole, as upstream does)",
        "; ".join(f"{method.name} ({method.source})" for method, _, _ in wrapped) or "none yet",
        _watch_described(installation, find_encodes),
    )
    return cache


def _for_install(settings: PromptEmbedCacheSettings, max_size: int, enabled: bool) -> PromptEmbedCacheSettings:
    """Return ``settings`` with its signing key read; raise when a value resolved from a user (not a default)
    for ``max_size`` or ``enabled`` differs from the keyword, which would silently win over it."""
    for setting, keyword in ((MAX_SIZE, max_size), (ENABLE, enabled)):
        source = settings.sources.get(setting.name, "default")
        if source != "default" and getattr(settings, setting.field) != keyword:
            raise PromptEmbedCacheConfigError(
                f"{setting.name}={getattr(settings, setting.field)!r} from {source} differs from "
                f"install_prompt_embed_cache's {setting.field}={keyword!r}: pass the resolved value as the keyword"
            )
    if settings.directory is None or settings.directory_key is not None:
        return settings
    if settings.directory_key_file is None and settings.directory_key_id is None:
        return settings  # unsigned: no key was given, or resolved
    source = settings.sources.get(DIRECTORY_KEY_FILE.name, "keyword argument")
    return settings.replace(directory_key=read_key(settings.directory_key_file, source))


def uninstall_prompt_embed_cache(pipeline: Any) -> None:
    """Restore every original encode method on ``pipeline`` if they were wrapped."""
    installation = getattr(pipeline, INSTALLATION_ATTRIBUTE, None)
    if installation is not None:
        originals = installation.originals
    else:  # installed by another release of this function: encode_prompt alone
        original = getattr(pipeline, ORIGINAL_ATTRIBUTE, None)
        originals = {} if original is None else {ENCODE_PROMPT: original}
    if not originals and getattr(pipeline, CACHE_ATTRIBUTE, None) is None:
        return
    if installation is not None:  # the encoder watch goes
        installation.remove()
    placement = getattr(pipeline, PLACEMENT_ATTRIBUTE, None)
    if placement is not None:  # the encoders go back on the device for good
        placement.remove()
        object.__delattr__(pipeline, PLACEMENT_ATTRIBUTE)
    for name, original in originals.items():
        restore(pipeline, name, original)
    for name in (INSTALLATION_ATTRIBUTE, CACHE_ATTRIBUTE, ORIGINAL_ATTRIBUTE):
        with contextlib.suppress(AttributeError):
            object.__delattr__(pipeline, name)


def _readable_methods(pipeline: Any, methods: Sequence[EncodeMethod]) -> list[tuple[EncodeMethod, Any, Any]]:
    """Return ``(method, bound function, signature)`` for each of ``methods`` the pipeline can have wrapped."""
    readable = []
    for method in methods:
        encode_fn = getattr(pipeline, method.name, None)
        if not callable(encode_fn):
            logger.warning(
                "Prompt-embed cache: %s.%s is not callable; not wrapped.", type(pipeline).__name__, method.name
            )
            continue
        try:
            readable.append((method, encode_fn, inspect.signature(encode_fn)))
        except (TypeError, ValueError) as why:
            logger.warning(
                "Prompt-embed cache: cannot read the signature of %s.%s (%s); not wrapped.",
                type(pipeline).__name__,
                method.name,
                why,
            )
    return readable


def _set_audit(cache: PromptEmbedCache, share: float, kind: type) -> None:
    """Audit ``share`` of ``cache``'s hits; turn it off if an audit caught the pipeline class ``kind`` before."""
    if share:
        cache.attach(audit=Audit(share))
    if (failed := audit_off_reason(kind)) is not None:
        cache.turn_off(failed)  # a new cache: nothing to drop yet


def _directory_tier(
    pipeline: Any, wrapped: Sequence[tuple[EncodeMethod, Any, Any]], tag: str, settings: PromptEmbedCacheSettings
) -> DirectoryTier | None:
    """Return the directory tier for ``pipeline`` (None: no ``settings.directory``), namespaced by its
    fingerprint (see :mod:`.fingerprint`)."""
    if settings.directory is None:
        return None
    try:
        encode_prompt = next((fn for method, fn, _ in wrapped if method.name == ENCODE_PROMPT), None)
        fixed: dict[str, Any] | str = code_and_configuration(pipeline, encode_prompt, tag)
    except Exception as error:  # a tokenizer or processor we cannot read: no directory, no error
        fixed = f"its code and configuration could not be fingerprinted ({type(error).__qualname__}: {error})"
    return DirectoryTier(
        settings.directory,
        settings.directory_bytes,
        lambda: fixed if isinstance(fixed, str) else pipeline_fingerprint(pipeline, fixed),
        local_device=functools.partial(_local_device, pipeline),
        key=settings.directory_key,
        modes=Modes(settings.directory_group),
    )


def _local_device(pipeline: Any, recorded: str) -> torch.device:
    """Return where a file's tensor, encoded on ``recorded``, goes in this process: the CPU stays the
    CPU; an accelerator tensor goes where this pipeline's text encoder runs (not where its weights
    wait between calls under an offload), else to the pipeline's device of that kind."""
    device = torch.device(recorded)
    if device.type == "cpu":
        return device
    for module in text_encoders(pipeline).values():
        for runs_on in encode_devices(module):
            if runs_on.type == device.type:
                return runs_on
    pipeline_device = getattr(pipeline, "device", None)
    if isinstance(pipeline_device, torch.device) and pipeline_device.type == device.type:
        return pipeline_device
    return device


def _directory_described(directory: str | os.PathLike | None, directory_bytes: int | None) -> str:
    """Return the install log line's words for the directory tier."""
    if directory is None:
        return "off"
    return f"{directory} ({'no limit' if directory_bytes is None else f'{directory_bytes} bytes'})"


def _watch_described(installation: Installation, find_encodes: bool) -> str:
    """Return the install log line's words for finding encodes by watching the text encoders."""
    if not find_encodes:
        return "off"
    return "on" if installation.encoders else "off (no child module holds a token embedding)"


def _host_described(host_bytes: int | str | None) -> str:
    if host_bytes is None:
        return "off"
    if host_bytes == HOST_AT_SLEEP:
        return "a level-1 sleep's entries, within the device tier's limits"
    return f"{host_bytes} bytes"
