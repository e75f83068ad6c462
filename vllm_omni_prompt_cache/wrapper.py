"""How a pipeline's encode methods are intercepted: install, first use, hit, miss, bypass.

Same contract as upstream vLLM-Omni's ``install_prompt_embed_cache``: idempotent,
``None`` for a pipeline with nothing to wrap, and the cache and the original
``encode_prompt`` stored on the pipeline as ``_prompt_embed_cache`` and
``_prompt_embed_cache_original_fn``. What differs is the key (tensors are keyed
by content, see :mod:`.keys`, and so is what the encode read from the pipeline,
see :mod:`.reads`), the store (budgets, verification, single-flight, bypass
reasons, see :mod:`.store`), rows (see :mod:`.rows`), and which methods:
``encode_prompt``, the declared ones, and those found by watching the text
encoders (see :mod:`.discovery`), each keyed, split and counted on its own in
one shared store.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from vllm_omni_prompt_cache.audit import Audit
from vllm_omni_prompt_cache.audit import off_reason as audit_off_reason
from vllm_omni_prompt_cache.audit import turn_off as turn_off_for_class
from vllm_omni_prompt_cache.config import DIRECTORY_BYTES
from vllm_omni_prompt_cache.counters import ENCODE_PROMPT, ROW_HIT, WHOLE_HIT, Outcome, tally
from vllm_omni_prompt_cache.directory_tier import DirectoryTier
from vllm_omni_prompt_cache.directory_trust import Modes
from vllm_omni_prompt_cache.discovery import (
    EncoderWatch,
    MethodState,
    OpenEncode,
    child_modules,
    holds_token_embedding,
)
from vllm_omni_prompt_cache.fingerprint import (
    code_and_configuration,
    encode_devices,
    encoder_modules,
    pipeline_fingerprint,
)
from vllm_omni_prompt_cache.first_use import LEARNED_REASON, FirstUse, Learned, with_state
from vllm_omni_prompt_cache.keys import Bypass, CallKey, CallKeyBuilder
from vllm_omni_prompt_cache.layouts import find_method_layout, find_row_layout
from vllm_omni_prompt_cache.logs import warn_once
from vllm_omni_prompt_cache.methods import EncodeMethod, find_encode_methods
from vllm_omni_prompt_cache.proofs import (
    DECLARED_BY_CLASS,
    DECLARED_IN_CODE,
    ONE_ROW,
    LayoutProof,
    compare_outputs,
    infer_layout,
    row_strength,
)
from vllm_omni_prompt_cache.reads import instance_attributes, is_packed, pack, unpack
from vllm_omni_prompt_cache.residency import PLACEMENT_ATTRIBUTE, EncoderMoves
from vllm_omni_prompt_cache.row_batches import RowTally
from vllm_omni_prompt_cache.rows import LayoutMismatch, RowLayout, RowSplit, SingleRow, UnstackableRows
from vllm_omni_prompt_cache.store import PromptEmbedCache
from vllm_omni_prompt_cache.values import unaliased

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
    row_layouts: Mapping[str, RowLayout] | None = None,
    host_bytes: int | None = None,
    directory: str | os.PathLike | None = None,
    directory_bytes: int | None = DIRECTORY_BYTES.default,
    methods: Mapping[str, Sequence[str]] | None = None,
    directory_key: bytes | None = None,
    directory_group: int | None = None,
    audit: float = 0.0,
    find_encodes: bool = True,
) -> PromptEmbedCache | None:
    """Wrap ``pipeline``'s encode methods with one content-keyed cache; return the cache or None.

    The methods: ``encode_prompt``, the encode methods known for the pipeline's classes, and
    ``methods[class path]`` (a user's declarations, for classes they cannot edit; the path is
    ``module.qualname`` where the class is defined, as
    :func:`~.methods.resolve_declared_methods` returns it). Each has its
    own keys, row layout and counters (``stats()["methods"]``); a method known to read input that
    is not an argument is wrapped only to count every call as a bypass with that reason.

    ``max_bytes`` bounds tensor bytes held (values plus verification bytes);
    ``verify`` compares input bytes on every hit; ``digest`` replaces xxh3-128
    (tests use a weak one to force collisions); ``report(cache)`` runs after each
    call (the vLLM-Omni worker uses it for a rate-limited log line). Rows of batched
    ``encode_prompt`` calls are cached on their own when a layout is known: ``row_layout``, else
    ``row_layouts[class path]`` (a user's declarations), else the class's
    ``prompt_embed_row_layout``, else a layout proven for vLLM-Omni's pipelines, else
    one inferred from a call (see :mod:`.proofs`); another method's rows follow a layout proven
    for it, else one inferred. A layout given in code (``row_layout``,
    the class attribute) is its author's word; any other is checked against the uncached
    call on the first call of each kind before its rows are served.

    Tiers below device memory: ``host_bytes`` bounds a host-memory tier that entries leaving
    device memory move to; ``directory`` holds a file per encoded entry within
    ``directory_bytes`` (None: no limit), namespaced by the pipeline's fingerprint (see
    :mod:`.fingerprint`), shared with every process that uses the same directory; with
    ``directory_key`` its files are signed and unsigned ones refused, and ``directory_group`` (a gid)
    shares what it creates with that group (see :mod:`.directory_trust`).

    ``audit``: the share of hits encoded again and compared with what was served (see :mod:`.audit`).

    ``find_encodes``: watch the pipeline's text encoders and wrap the method that hands them their
    token ids, whatever it is called (see :mod:`.discovery`); False: ``encode_prompt`` and the
    declared methods only. Every wrapped method is keyed on its arguments and on what its calls were
    seen to read from the pipeline, and replays what they wrote (see :mod:`.reads`).
    """
    existing = getattr(pipeline, "_prompt_embed_cache", None)
    if existing is not None:
        return existing

    wrapped = _readable_methods(pipeline, find_encode_methods(pipeline, methods))
    watchable = find_encodes and any(holds_token_embedding(module) for module in child_modules(pipeline).values())
    if not wrapped and not watchable:
        logger.debug("Prompt-embed cache: %s has no encode method to wrap; skipping.", type(pipeline).__name__)
        return None

    tag = model_tag or type(pipeline).__name__
    directory_tier = None
    if directory is not None:
        try:
            encode_prompt = next((fn for method, fn, _ in wrapped if method.name == ENCODE_PROMPT), None)
            fixed: dict[str, Any] | str = code_and_configuration(pipeline, encode_prompt, tag)
        except Exception as error:  # a tokenizer or processor we cannot read: no directory, no error
            fixed = f"its code and configuration could not be fingerprinted ({type(error).__qualname__}: {error})"
        directory_tier = DirectoryTier(
            directory,
            directory_bytes,
            lambda: fixed if isinstance(fixed, str) else pipeline_fingerprint(pipeline, fixed),
            local_device=functools.partial(_local_device, pipeline),
            key=directory_key,
            modes=Modes(directory_group),
        )
    cache = PromptEmbedCache(
        max_size=max_size,
        enabled=enabled,
        max_bytes=max_bytes,
        verify=verify,
        host_bytes=host_bytes,
        directory=directory_tier,
    )
    if audit:
        cache.audit = Audit(audit)
    if (failed := audit_off_reason(type(pipeline))) is not None:  # an audit caught this class before
        cache.enabled, cache.off_reason = False, failed
    installation = _Installation(pipeline, cache, tag, digest, report, row_layout, row_layouts)
    for method, encode_fn, signature in wrapped:
        installation.wrap(method.name, method.source, encode_fn, signature, inferred=False)
    if find_encodes:
        installation.watch()
    object.__setattr__(pipeline, "_prompt_embed_cache", cache)
    object.__setattr__(pipeline, "_prompt_embed_cache_original_fn", installation.originals.get(ENCODE_PROMPT))
    object.__setattr__(pipeline, "_prompt_embed_cache_originals", installation.originals)
    object.__setattr__(pipeline, "_prompt_embed_cache_layout", installation.proofs.get(ENCODE_PROMPT))
    object.__setattr__(pipeline, "_prompt_embed_cache_layouts", installation.proofs)
    object.__setattr__(pipeline, "_prompt_embed_cache_installation", installation)
    cache.encode_methods = installation.describe
    proof = installation.proofs.get(ENCODE_PROMPT) or next(iter(installation.proofs.values()), None)
    logger.info(
        "Prompt-embed cache (content-keyed) installed on %s: max_size=%d, max_bytes=%s, verify=%s, enabled=%s, "
        "host tier: %s, directory tier: %s, rows: %s, methods: %s; finding encodes: %s.",
        tag,
        max_size,
        "unlimited" if max_bytes is None else max_bytes,
        verify,
        enabled,
        "off" if host_bytes is None else f"{host_bytes} bytes",
        "off"
        if directory is None
        else f"{directory} ({'no limit' if directory_bytes is None else f'{directory_bytes} bytes'})",
        "none"
        if proof is None
        else f"{proof.layout.name} ({proof.source})"
        if proof.layout is not None
        else "inferred from the first batched call, then checked"
        if proof.may_infer
        else "whole calls only",
        "; ".join(f"{method.name} ({method.source})" for method, _, _ in wrapped) or "none yet",
        "off"
        if not find_encodes
        else f"watching {', '.join(installation.encoders) or 'nothing (no child module holds a token embedding)'}",
    )
    return cache


class _Installation:
    """One pipeline's wrapped methods, and the encoder watch that finds more (see :mod:`.discovery`)."""

    def __init__(
        self,
        pipeline: Any,
        cache: PromptEmbedCache,
        tag: str,
        digest: Callable[[Any], bytes] | None,
        report: Callable[[PromptEmbedCache], None] | None,
        row_layout: RowLayout | None,
        row_layouts: Mapping[str, RowLayout] | None,
    ) -> None:
        self.pipeline = pipeline
        self.cache = cache
        self.tag = tag
        self.digest = digest
        self.report = report
        self.row_layout = row_layout
        self.row_layouts = row_layouts
        self.inside = threading.local()  # set while a wrapped method of this pipeline runs on this thread
        self.originals: dict[str, Callable[..., Any]] = {}
        self.proofs: dict[str, LayoutProof] = {}
        self.states: dict[str, MethodState] = {}
        self.rejected: dict[str, str] = {}  # candidates found by watching that turned out not to be encodes
        self.unwrappable: dict[str, str] = {}  # encoder -> why no method could be wrapped for it
        self._inner: dict[str, list[str]] = {}  # candidate -> the methods around it, tried next
        self._open: OpenEncode | None = None  # the encode whose encoder calls are being gathered
        self._settle_hooks: list[Any] = []  # on the other child modules while an encode is open
        self._lock = threading.RLock()
        self._watch: EncoderWatch | None = None
        self.configuration = instance_attributes(pipeline)  # what the pipeline held at install (see MethodState)

    @property
    def encoders(self) -> list[str]:
        return [] if self._watch is None else list(self._watch.encoders)

    def wrap(
        self, name: str, source: str, encode_fn: Callable[..., Any], signature: inspect.Signature, *, inferred: bool
    ) -> None:
        """Wrap ``name`` on the pipeline with its own keys, layout, counters and :class:`MethodState`."""
        pipeline = self.pipeline
        if name == ENCODE_PROMPT:
            proof = _layout_proof(pipeline, signature, self.tag, self.row_layout, self.row_layouts)
            method_tag = self.tag
        else:  # another method: its own keys (never an encode_prompt entry), layout and counters
            proof = _method_layout_proof(pipeline, name, signature, self.tag)
            method_tag = f"{self.tag}.{name}"
        # A method found by watching is observed on its first call before anything is kept, and so is every
        # method where several ranks run: each rank's first call encodes, so all see its collectives at once
        # (a lower tier's hit on one rank could skip them). Elsewhere encode_prompt and declared methods are
        # served from their first call, their first encode observed (see _run).
        instance = getattr(encode_fn, "__self__", pipeline)
        configuration = self.configuration if instance is pipeline else instance_attributes(instance)
        state = MethodState(name, source, inferred, learning=inferred or _several_ranks(), configuration=configuration)
        calls = _CachedCalls(
            self.cache,
            _noting_encodes(encode_fn, self.inside, pipeline),
            signature,
            CallKeyBuilder(signature, method_tag, digest=self.digest),
            proof,
            method=name,
            pipeline=pipeline,
            state=state,
            installation=self,
            instance=instance,
        )
        if not inferred:
            self.cache.register(name)  # listed in stats() from now on; a candidate once it is confirmed
        _set_attribute(pipeline, name, _cached(calls, encode_fn, self.cache, self.report, self.inside, pipeline))
        self.originals[name] = encode_fn
        self.proofs[name] = proof
        self.states[name] = state

    def watch(self) -> None:
        """Start watching the text encoders for encodes that no wrapped method covers."""
        self._watch = EncoderWatch(self.pipeline, lambda: getattr(self.inside, "active", False), self._found)

    def _found(self, calls: list[tuple[str, Any]], encoder: str) -> None:
        """An encoder ran outside every wrapped method, called through ``calls`` (outermost first). The encode
        it belongs to is settled when the next one begins (see :class:`~.discovery.OpenEncode`)."""
        with self._lock:
            if not calls:  # another object's call (an encoder shared with a reference pipeline), or no method's
                return
            if self._open is not None and self._open.joins(calls, encoder):
                return
            self._settle_open()
            self._open = OpenEncode(calls, {encoder}, {encoder: [frame for _, frame in calls]})
            # The encode ends, at the latest, when another child module runs (the DiT after the encodes).
            self._settle_hooks = [
                module.register_forward_pre_hook(self._on_other_module)
                for name, module in child_modules(self.pipeline).items()
                if name not in self.encoders
            ]

    def _on_other_module(self, module: torch.nn.Module, args: tuple) -> None:
        with self._lock:
            self._settle_open()

    def _settle_open(self) -> None:
        """Settle the encode being gathered, if any; the lock is held."""
        for handle in self._settle_hooks:
            handle.remove()
        self._settle_hooks = []
        if self._open is not None:
            encode, self._open = self._open, None
            self._settle(encode)

    def _settle(self, encode: OpenEncode) -> None:
        names = encode.candidates()
        if any(name in self.states for name in names):  # a method it runs under is wrapped (or being tried)
            return
        candidates = [name for name in names if name not in self.rejected]
        if candidates:
            self._try(candidates)
        else:
            why = f"no method that calls it is an encode ({', '.join(names)})"
            for encoder in encode.encoders - set(self.unwrappable):
                self.unwrappable[encoder] = why
                warn_once(f"{self.tag}.{encoder} runs uncached: {why}")

    def _try(self, candidates: list[str]) -> None:
        """Wrap the first of ``candidates`` that can be, remembering the rest for when it is refuted."""
        for index, name in enumerate(candidates):
            encode_fn = getattr(self.pipeline, name, None)
            try:
                signature = inspect.signature(encode_fn)
            except (TypeError, ValueError) as why:
                self.rejected[name] = f"its signature cannot be read ({why})"
                continue
            encoders = ", ".join(self.encoders)
            self._inner[name] = candidates[index + 1 :]
            self.wrap(name, f"found: it hands {encoders} their token ids", encode_fn, signature, inferred=True)
            return

    def reject(self, name: str, why: str) -> None:
        """Unwrap a candidate that is not an encode, and try the method around it."""
        with self._lock:
            if name not in self.states:
                return
            self.rejected[name] = why
            original = self.originals.pop(name)
            del self.states[name], self.proofs[name]
            _restore(self.pipeline, name, original)
            logger.debug("Prompt-embed cache: %s.%s is not an encode: %s.", self.tag, name, why)
            following = [inner for inner in self._inner.pop(name, []) if inner not in self.states]
            if following:
                self._try([inner for inner in following if inner not in self.rejected])

    def confirmed(self, state: MethodState) -> None:
        """Say once which method was found, how, and what it is keyed on; list it in stats()."""
        self.cache.register(state.name)
        logger.info(
            "Prompt-embed cache: %s.%s is cached (%s), keyed on %s%s.",
            self.tag,
            state.name,
            state.source,
            ", ".join(state.keyed_on()),
            f"; hits replay {', '.join('self.' + name for name in state.writes)}" if state.writes else "",
        )

    def refused(self, state: MethodState, why: str) -> None:
        """Stop caching ``state``'s method, and say so once."""
        state.refusal = why
        self.cache.register(state.name)
        logger.warning("Prompt-embed cache: %s.%s is not cached: %s.", self.tag, state.name, why)

    def describe(self) -> dict[str, Any]:
        """Return what stats() says of the encode methods: found, how, keyed on what; and the rejected."""
        with self._lock:
            described = {name: state.describe() for name, state in self.states.items()}
            for name, why in self.rejected.items():
                described[name] = {"found": "a candidate", "state": "not an encode", "refusal": why}
            for encoder, why in self.unwrappable.items():
                described[f"<{encoder}>"] = {"found": "an encoder call", "state": "uncached", "refusal": why}
            return described

    def remove(self) -> None:
        if self._watch is not None:
            self._watch.remove()
        with self._lock:
            for handle in self._settle_hooks:
                handle.remove()
            self._settle_hooks, self._open = [], None


def _restore(pipeline: Any, name: str, original: Callable[..., Any]) -> None:
    """Put ``original`` back as ``pipeline.name``."""
    if getattr(original, "__self__", None) is pipeline and name in vars(pipeline):
        object.__delattr__(pipeline, name)  # the original was the class's bound method
    else:
        _set_attribute(pipeline, name, original)


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


def _cached(
    calls: _CachedCalls,
    encode_fn: Callable[..., Any],
    cache: PromptEmbedCache,
    report: Callable[[PromptEmbedCache], None] | None,
    inside: threading.local,
    pipeline: Any,
) -> Callable[..., Any]:
    """Return the function that replaces ``encode_fn`` on the pipeline.

    A wrapped method called from inside another (MAGI-2's ``encode_prompt`` calls its
    ``_encode_prompts``) runs straight through: the outer call is the one keyed, counted and
    stored, so one encode is one entry and one call in the counts. A call runs in a session of the
    pipeline's encoder placement when it has one (the encoders leave the device when it ends; they
    are placed only if it calls the original, see :func:`_noting_encodes`); a call that did not
    encode counts the encoder moves it saved.
    """

    @functools.wraps(encode_fn)
    def cached_encode(*args: Any, **kwargs: Any) -> Any:
        if getattr(inside, "active", False):
            return encode_fn(*args, **kwargs)
        inside.active = True
        try:
            moves, audit = cache.moves, cache.audit
            if moves is None and audit is None:  # nothing moves the encoders, no audit: the hit path as it was
                result = calls(args, kwargs)
            else:
                result = _observed(calls, args, kwargs, moves, audit, inside, pipeline)
        finally:
            inside.active = False
        if report is not None:
            report(cache)
        return result

    cached_encode.__wrapped__ = encode_fn  # type: ignore[attr-defined]
    return cached_encode


def _observed(
    calls: _CachedCalls,
    args: tuple,
    kwargs: dict,
    moves: EncoderMoves | None,
    audit: Audit | None,
    inside: threading.local,
    pipeline: Any,
) -> Any:
    """Run one cached call in a session of the pipeline's encoder placement (when it has one); when it
    was served without encoding, tell ``moves`` and let ``audit`` check it."""
    inside.encoded = False
    placement = getattr(pipeline, PLACEMENT_ATTRIBUTE, None)
    with contextlib.nullcontext() if placement is None else placement.session():
        result = calls(args, kwargs)
        if inside.encoded:
            return result
        if audit is not None and audit.due():  # its encode places the encoders: no placement was saved
            return calls.audited(args, kwargs, result)
        if moves is not None:
            moves.served_without_encoding()
    return result


def _noting_encodes(encode_fn: Callable[..., Any], inside: threading.local, pipeline: Any) -> Callable[..., Any]:
    """Return ``encode_fn``, noting on ``inside`` that the current call encoded (every bypass does too),
    with the pipeline's encoders placed for it when they wait off the device between calls: placed
    before the call, not at the encoder's first forward, since code reads where an encoder's
    parameters are before running it (vLLM-Omni's ByT5 glyph encoder, FLUX.2's prompt helpers when
    given no device)."""

    def encode(*args: Any, **kwargs: Any) -> Any:
        inside.encoded = True
        placement = getattr(pipeline, PLACEMENT_ATTRIBUTE, None)
        if placement is None:
            return encode_fn(*args, **kwargs)
        with placement.held():
            return encode_fn(*args, **kwargs)

    return encode


def _local_device(pipeline: Any, recorded: str) -> torch.device:
    """Return where a file's tensor, encoded on ``recorded``, goes in this process: the CPU stays the
    CPU; an accelerator tensor goes where this pipeline's text encoder runs (not where its weights
    wait between calls under an offload), else to the pipeline's device of that kind."""
    device = torch.device(recorded)
    if device.type == "cpu":
        return device
    for module in encoder_modules(pipeline).values():
        for runs_on in encode_devices(module):
            if runs_on.type == device.type:
                return runs_on
    pipeline_device = getattr(pipeline, "device", None)
    if isinstance(pipeline_device, torch.device) and pipeline_device.type == device.type:
        return pipeline_device
    return device


def _method_layout_proof(pipeline: Any, method: str, signature: inspect.Signature, tag: str) -> LayoutProof:
    """Return where the row layout of ``pipeline``'s encode method ``method`` comes from."""
    layout, source = find_method_layout(type(pipeline), method)
    if layout is not None and (why := layout.unusable_with(signature)) is not None:
        logger.warning(
            "Prompt-embed cache: row layout %r (%s) does not fit %s.%s (%s); its rows are inferred, then checked.",
            layout.name,
            source,
            tag,
            method,
            why,
        )
        layout = None
    return LayoutProof(type(pipeline), layout, source, may_infer=layout is None, method=method)


def _layout_proof(
    pipeline: Any,
    signature: inspect.Signature,
    tag: str,
    row_layout: RowLayout | None,
    row_layouts: Mapping[str, RowLayout] | None,
) -> LayoutProof:
    """Return where ``pipeline``'s row layout comes from, checked for use with ``signature``."""
    kind = type(pipeline)
    if row_layout is not None:
        layout, source = row_layout, DECLARED_IN_CODE
    else:
        layout, source = find_row_layout(pipeline, row_layouts or {})
    trusted = source in (DECLARED_BY_CLASS, DECLARED_IN_CODE)
    if layout is not None and not isinstance(layout, RowLayout):
        logger.warning(
            "Prompt-embed cache: %s's row layout (%s) is a %s, not a RowLayout; calls are keyed whole.",
            tag,
            source,
            type(layout).__qualname__,
        )
        return LayoutProof(kind, None, source, may_infer=False)
    if layout is not None:
        why = layout.unusable_with(signature)
        if why is not None:
            logger.warning(
                "Prompt-embed cache: row layout %r (%s) does not fit %s (%s); calls are keyed whole.",
                layout.name,
                source,
                tag,
                why,
            )
            return LayoutProof(kind, None, source, may_infer=False)
    return LayoutProof(kind, layout, source, may_infer=layout is None, trusted=trusted)


class _CachedCalls(FirstUse):
    """Serves one pipeline method's calls: whole, row by row, or bypassed with a reason; counts each call once."""

    def __init__(
        self,
        store: PromptEmbedCache,
        encode_fn: Callable[..., Any],
        signature: inspect.Signature,
        key_builder: CallKeyBuilder,
        proof: LayoutProof,
        *,
        method: str = ENCODE_PROMPT,
        pipeline: Any = None,
        state: MethodState | None = None,
        installation: _Installation | None = None,
        instance: Any = None,
    ) -> None:
        self.store = store
        #: Whose attributes a call reads and writes: the object the method is bound to (the pipeline's own
        #: methods are bound to it; an encode_prompt given to an instance may be bound to another object).
        self.instance = pipeline if instance is None else instance
        self.method = method  # whose counters every count made here goes to
        self._count = store.recorder(method)  # adds one tally to them
        self.pipeline = pipeline
        self.pipeline_class = type(pipeline)  # what an audit's mismatch turns the cache off for
        self.encode_fn = encode_fn
        self.signature = signature
        self.key_builder = key_builder
        self.proof = proof
        self.state = state if state is not None else MethodState(method, "given", inferred=False, learning=False)
        self.installation = installation

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        try:
            return self._serve(args, kwargs)
        except Learned as learned:  # a row's encode read or wrote what earlier calls had not: served whole
            return self._uncached(args, kwargs, tally(Outcome.BYPASS, reason=learned.reason or LEARNED_REASON))

    def _serve(self, args: tuple, kwargs: dict) -> Any:
        store, state = self.store, self.state
        if not store.enabled:
            return self._uncached(args, kwargs, tally(Outcome.BYPASS, reason=store.off_reason or DISABLED_REASON))
        if state.refusal is not None:
            return self._uncached(args, kwargs, tally(Outcome.BYPASS, reason=state.refusal))
        arguments = self.key_builder.bind(args, kwargs)
        if type(arguments) is Bypass:
            if state.inferred and state.learning:
                return self._not_an_encode(args, kwargs, "its calls do not bind to its signature")
            return self._uncached(args, kwargs, tally(Outcome.BYPASS, reason=arguments.reason))
        if state.learning:
            return self._learn(args, kwargs, arguments)
        return self._dispatch(args, kwargs, arguments)

    def _dispatch(self, args: tuple, kwargs: dict, arguments: dict[str, Any]) -> Any:
        """Serve a call of a method past its first use: whole, by rows, or bypassed."""
        state = self.state
        if self.key_builder.precomputed(arguments) is not None:
            return self._whole(args, kwargs, arguments)
        held = state.state_argument(self.instance)
        if type(held) is Bypass:  # a component was replaced: learn the method again
            state.learning = True
            return self._learn(args, kwargs, arguments)
        if not state.rows_allowed:
            return self._whole(args, kwargs, arguments, held=held)
        layout = self.proof.layout
        if layout is None:
            return self._whole(args, kwargs, arguments, infer=self.proof.may_infer, held=held)
        try:
            single = layout.single_row_key(arguments)
            split = None
            if single is None or (single.text and not self.proof.trusted):
                split = layout.split(arguments)
        except Exception as error:  # hostile arguments: reading them as rows must not fail the call
            return self._whole(
                args, kwargs, arguments, why=f"rows could not be read: {type(error).__qualname__} raised", held=held
            )
        # A prompt's row is shared by its forms ("a" and ["a"]), which a layout the class does not vouch
        # for must have passed a check on before one is served for the other.
        if single is not None and (
            split is None or (type(split) is RowSplit and self.proof.has_checked(layout, split))
        ):
            return self._single_row(layout, args, kwargs, single, held)
        if type(split) is not RowSplit:
            return self._whole(args, kwargs, arguments, rows=layout.batch_size(arguments), why=split, held=held)
        keys = self._row_keys(split, held)
        if type(keys) is Bypass:  # a shared argument no key can hold: no row can be keyed
            return self._uncached(args, kwargs, tally(Outcome.BYPASS, reason=keys.reason, rows_encoded=split.batch))
        return self._by_rows(layout, split, keys, args, kwargs)

    def _uncached(self, args: tuple, kwargs: dict, counts: dict[str, Any]) -> Any:
        """Serve the call from the original function, not cached, counted as ``counts`` (a :func:`tally`)."""
        self._count(counts)
        return self.encode_fn(*args, **kwargs)

    def audited(self, args: tuple, kwargs: dict, served: Any) -> Any:
        """Encode a call that was served from the cache again and compare; return what the call gets:
        ``served`` when they agree, else the fresh encode (and the cache is off from now on)."""
        try:
            fresh = self.encode_fn(*args, **kwargs)
            why = compare_outputs(served, fresh)[0]
        except Exception as error:  # out of memory, say: the call was served; the audit is what failed
            warn_once(f"an audit's encode failed ({type(error).__qualname__}: {error}); the hit was served")
            return served
        self.store.record_audit(mismatch=why is not None, method=self.method)
        if why is None:
            return served
        served_why = why.replace("assembled", "served").replace("uncached", "encoded again")
        turn_off_for_class(self.store, self.pipeline_class, self.key_builder.model_tag, served_why)
        return fresh

    def _single_row(self, layout: RowLayout, args: tuple, kwargs: dict, single: SingleRow, held: tuple | None) -> Any:
        """Serve a call that is its own only row, keyed as :meth:`RowLayout.single_row_key` reads it."""
        keyed = with_state(single.arguments, held)
        key = self.key_builder.build_from_arguments(keyed, row=True, host_views=single.host_views)
        if type(key) is Bypass:
            return self._uncached(args, kwargs, tally(Outcome.BYPASS, reason=key.reason, rows_encoded=1))
        known = len(self.state.data)
        try:
            value = self.store.serve(
                key, lambda: layout.check_row(self._encode_to_keep(args, kwargs)), self._count_row, self.method
            )
            if len(self.state.data) > known:  # its encode read more state: keep it under the key that holds it
                self._keep_rows([single.arguments], [key], [value], single.host_views)
            return value
        except LayoutMismatch as error:  # the row was not stored; serve the call whole and uncached
            self.proof.refute(layout, str(error))
            return self._uncached(args, kwargs, tally(whole_call=LAYOUT_DROPPED_REASON, rows_encoded=1))

    def _count_row(self, outcome: Outcome, reason: str | None) -> None:
        """Count a call that is one row, as a call and as a row."""
        if outcome is Outcome.HIT:
            self._count(ROW_HIT)
            return
        self._count(
            tally(
                outcome,
                reason=reason,
                rows_missed=int(outcome is Outcome.MISS),
                row_reasons=None if reason is None else {reason: 1},
                rows_encoded=1,
            )
        )

    def _by_rows(self, layout: RowLayout, split: RowSplit, keys: list[CallKey], args: tuple, kwargs: dict) -> Any:
        """Serve each distinct row from the cache or one encode of it alone; assemble the call's output.

        A call that goes beyond what checks have proven the layout for is served from the uncached
        call and compared with its assembled rows (:meth:`_check`).
        """
        rows = RowTally()
        call = Outcome.MISS  # unless every row was served without encoding and the output assembles
        dropped = tally(whole_call=LAYOUT_DROPPED_REASON, rows_encoded=split.batch)  # then served uncached
        known = len(self.state.data)
        try:
            try:
                values = self.store.serve_rows(keys, self._row_encoder(split), rows, self.method)
                if len(self.state.data) > known:  # a row's encode read more state: keep them under keys holding it
                    self._keep_rows([split.key_arguments(index) for index in range(split.batch)], keys, values)
            except LayoutMismatch as error:
                self.proof.refute(layout, str(error))
                return self._uncached(args, kwargs, dropped)
            except Exception as error:
                if self.proof.trusted or self.proof.has_checked(layout, split) or _transient(error):
                    raise  # the encoder itself failed, as it would uncached
                # Rows cut by a layout no check has passed yet for such calls: the cut is the suspect.
                self.proof.refute(layout, f"its row calls raised {type(error).__qualname__}: {error}")
                return self._uncached(args, kwargs, dropped)
            if not self.proof.settled(layout, split):  # measuring what the rows exercise costs comparisons
                strength = row_strength(split, values)
                if self.proof.needs_check(layout, split, strength):  # the check encodes the whole call
                    return self._check(layout, split, values, strength, self.encode_fn(*args, **kwargs))
            try:
                assembled = split.assemble(values)
            except UnstackableRows:
                return self._uncached(args, kwargs, tally(whole_call=UNSTACKABLE_REASON, rows_encoded=split.batch))
            call = Outcome.MISS if rows.encoded else Outcome.HIT
            return assembled
        finally:  # the rows and the call, counted whatever happened (an encode or an assembly that raised too)
            self._count(rows.counts(call))

    def _whole(
        self,
        args: tuple,
        kwargs: dict,
        arguments: dict[str, Any],
        *,
        rows: int | None = None,
        why: str | None = None,
        infer: bool = False,
        held: tuple | None = None,
    ) -> Any:
        """Serve the call under one key; ``rows``: how many rows it encodes, when a layout says; ``why``:
        why a call with a row layout is keyed whole; ``held``: the pipeline state the key also holds.

        ``infer``: on a miss, try to infer a row layout from the call and its output (then check it).
        """
        encoded: list[Any] = []
        outcomes: list[Outcome] = []

        def encode() -> Any:
            result, trace = self._run(args, kwargs)
            encoded.append(result)
            return pack(unaliased(result, (args, kwargs)), trace.changed())

        def count(outcome: Outcome, reason: str | None) -> None:
            outcomes.append(outcome)
            if outcome is Outcome.HIT and why is None:
                self._count(WHOLE_HIT)
                return
            self._count(
                tally(outcome, reason=reason, whole_call=why, rows_encoded=0 if outcome is Outcome.HIT else rows or 0)
            )

        key = self.key_builder.build_from_arguments(with_state(arguments, held))
        if type(key) is Bypass:
            count(Outcome.BYPASS, key.reason)
            result = self.encode_fn(*args, **kwargs)
            encoded.append(result)
            return result
        try:
            value = self.store.serve(key, encode, count, self.method)
        except Learned as learned:  # the key grew while encoding: kept under the key it has now
            return self._keep_learned(args, kwargs, arguments, learned)
        if encoded:  # this call encoded: the pipeline holds what it wrote already
            result = value[1] if is_packed(value) else value
        else:
            result = unpack(value, self.instance)
            if self.state.check_pending and outcomes and outcomes[-1] is Outcome.HIT:
                return self._first_hit_check(args, kwargs, result)
        if infer and encoded and self.proof.claim_inference():
            adopted = None
            try:
                adopted = self._infer(arguments, encoded[0], held)
            finally:
                self.proof.end_inference(adopted)
        return result

    def _infer(self, arguments: dict[str, Any], output: Any, held: tuple | None) -> RowLayout | None:
        """Return the layout a missed call suggests if its rows, encoded alone, assemble to ``output``."""
        layout = infer_layout(self.signature, arguments, output)
        if type(layout) is str:
            if layout != ONE_ROW:  # a one-row call says nothing: not worth a reason
                self._count(tally(whole_call=f"no row layout inferred: {layout}"))
            return None
        split = layout.split(arguments)
        keys = None if type(split) is not RowSplit else self._row_keys(split, held)
        if keys is None or type(keys) is Bypass:
            self._count(tally(whole_call="no row layout inferred: the call could not be split into rows"))
            return None
        rows = RowTally()
        try:
            values = self.store.serve_rows(keys, self._row_encoder(split), rows, self.method)
        except LayoutMismatch as error:
            self.proof.refute(layout, str(error), inferred=True)
            return None
        finally:
            self._count(rows.counts(None))
        strength = row_strength(split, values)
        passed = self._check(layout, split, values, strength, output, inferred=True) is not None
        return layout if passed else None

    def _check(
        self,
        layout: RowLayout,
        split: RowSplit,
        values: list[Any],
        strength: tuple,
        expected: Any,
        *,
        inferred: bool = False,
    ) -> Any:
        """Compare ``expected`` (the uncached call) with the call's rows assembled; return ``expected``.

        A match proves the layout for calls like this one; a mismatch turns rows off for the class.
        For an inferred layout, returns None on a mismatch (the caller already holds ``expected``).
        """
        try:
            why, gap = compare_outputs(split.assemble(values), expected)
        except UnstackableRows as error:
            why, gap = str(error), 0.0
        self.store.record_layout_check(split.batch, None if why else gap, method=self.method)
        if why is None:
            self.proof.prove(layout, split, strength)
            return expected
        self.proof.refute(layout, why, inferred=inferred)
        return None if inferred else expected

    def _row_keys(self, split: RowSplit, held: tuple | None) -> list[CallKey] | Bypass:
        keys = []
        for index in range(split.batch):
            key = self.key_builder.build_from_arguments(with_state(split.key_arguments(index), held), row=True)
            if type(key) is Bypass:
                return key
            keys.append(key)
        return keys

    def _row_encoder(self, split: RowSplit) -> Callable[[int], Any]:
        def encode_row(index: int) -> Any:
            bound = inspect.BoundArguments(self.signature, split.call_arguments(index))  # type: ignore[arg-type]
            return split.check_row(self._encode_to_keep(bound.args, bound.kwargs))

        return encode_row

    def _encode_to_keep(self, args: tuple, kwargs: dict) -> Any:
        """Run the encoder for a result the cache keeps (keyed arguments only: bounded, acyclic); outputs
        that are the call's own input tensors are copied."""
        # A row's encode that reads more state than the rows' keys hold is kept under those keys, which no
        # later lookup builds (the state's names are in every key); one that writes state raises Learned.
        result, _ = self._run(args, kwargs, rows=True)
        return unaliased(result, (args, kwargs))


def _several_ranks() -> bool:
    """Return True when this process is one of several torch.distributed ranks."""
    distributed = torch.distributed
    return distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1


def _transient(error: Exception) -> bool:
    """Return True for failures that say nothing about a layout (memory): they are raised, not held against it."""
    return isinstance(error, (MemoryError, torch.OutOfMemoryError))


def uninstall_prompt_embed_cache(pipeline: Any) -> None:
    """Restore every original encode method on ``pipeline`` if they were wrapped."""
    originals = getattr(pipeline, "_prompt_embed_cache_originals", None)
    if originals is None:  # installed by another release of this function: encode_prompt alone
        original = getattr(pipeline, "_prompt_embed_cache_original_fn", None)
        originals = {} if original is None else {ENCODE_PROMPT: original}
    if not originals and getattr(pipeline, "_prompt_embed_cache", None) is None:
        return
    installation = getattr(pipeline, "_prompt_embed_cache_installation", None)
    if installation is not None:  # the encoder watch goes
        installation.remove()
    placement = getattr(pipeline, PLACEMENT_ATTRIBUTE, None)
    if placement is not None:  # the encoders go back on the device for good
        placement.remove()
        object.__delattr__(pipeline, PLACEMENT_ATTRIBUTE)
    for name, original in originals.items():
        _restore(pipeline, name, original)
    for name in (
        "_prompt_embed_cache_installation",
        "_prompt_embed_cache",
        "_prompt_embed_cache_original_fn",
        "_prompt_embed_cache_originals",
        "_prompt_embed_cache_layout",
        "_prompt_embed_cache_layouts",
    ):
        with contextlib.suppress(AttributeError):
            object.__delattr__(pipeline, name)
