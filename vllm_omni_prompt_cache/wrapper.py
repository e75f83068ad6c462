"""How a pipeline's encode methods are intercepted: install, uninstall, hit, miss, bypass.

Same contract as upstream vLLM-Omni's ``install_prompt_embed_cache``: idempotent,
``None`` for a pipeline with nothing to wrap, and the cache and the original
``encode_prompt`` stored on the pipeline as ``_prompt_embed_cache`` and
``_prompt_embed_cache_original_fn``. What differs is the key (tensors are keyed
by content, see :mod:`.keys`), the store (budgets, verification,
single-flight, bypass reasons, see :mod:`.store`), rows: a pipeline with a
row layout has each row of a batched call cached on its own (see :mod:`.rows`),
and which methods: besides ``encode_prompt``, the encode methods some pipelines'
``forward`` calls instead (see :mod:`.vllm_omni.methods`), each keyed, split and
counted on its own in one shared store, and none whose result depends on
anything but its arguments.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni_prompt_cache.audit import Audit
from vllm_omni_prompt_cache.audit import off_reason as audit_off_reason
from vllm_omni_prompt_cache.audit import turn_off as turn_off_for_class
from vllm_omni_prompt_cache.config import DIRECTORY_BYTES
from vllm_omni_prompt_cache.counters import ENCODE_PROMPT, ROW_HIT, WHOLE_HIT, Outcome, tally
from vllm_omni_prompt_cache.directory_tier import DirectoryTier
from vllm_omni_prompt_cache.directory_trust import Modes
from vllm_omni_prompt_cache.fingerprint import (
    code_and_configuration,
    encode_devices,
    encoder_modules,
    pipeline_fingerprint,
)
from vllm_omni_prompt_cache.keys import Bypass, CallKey, CallKeyBuilder
from vllm_omni_prompt_cache.logs import warn_once
from vllm_omni_prompt_cache.proofs import (
    DECLARED_BY_CLASS,
    DECLARED_IN_CODE,
    ONE_ROW,
    LayoutProof,
    compare_outputs,
    infer_layout,
    row_strength,
)
from vllm_omni_prompt_cache.residency import PLACEMENT_ATTRIBUTE, EncoderMoves
from vllm_omni_prompt_cache.row_batches import RowTally
from vllm_omni_prompt_cache.rows import LayoutMismatch, RowLayout, RowSplit, SingleRow, UnstackableRows
from vllm_omni_prompt_cache.store import PromptEmbedCache
from vllm_omni_prompt_cache.values import unaliased

if TYPE_CHECKING:
    from vllm_omni_prompt_cache.vllm_omni.methods import EncodeMethod

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
) -> PromptEmbedCache | None:
    """Wrap ``pipeline``'s encode methods with one content-keyed cache; return the cache or None.

    The methods: ``encode_prompt``, the encode methods known for the pipeline's classes, and
    ``methods[class path]`` (a user's declarations, for classes they cannot edit; the path is
    ``module.qualname`` where the class is defined, as
    :func:`~.vllm_omni.methods.resolve_declared_methods` returns it). Each has its
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
    """
    existing = getattr(pipeline, "_prompt_embed_cache", None)
    if existing is not None:
        return existing

    from vllm_omni_prompt_cache.vllm_omni.methods import find_encode_methods  # imports nothing of vLLM-Omni

    wrapped = _readable_methods(pipeline, find_encode_methods(pipeline, methods))
    if not wrapped:
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
    originals: dict[str, Callable[..., Any]] = {}
    proofs: dict[str, LayoutProof] = {}
    inside = threading.local()  # set while a wrapped method of this pipeline runs on this thread
    for method, encode_fn, signature in wrapped:
        if method.name == ENCODE_PROMPT:
            proof = _layout_proof(pipeline, signature, tag, row_layout, row_layouts)
            method_tag = tag
        else:  # another method: its own keys (never an encode_prompt entry), layout and counters
            proof = _method_layout_proof(pipeline, method.name, signature, tag)
            method_tag = f"{tag}.{method.name}"
        cache.register(method.name)  # listed in stats() from now on
        calls = _CachedCalls(
            cache,
            _noting_encodes(encode_fn, inside, pipeline),
            signature,
            CallKeyBuilder(signature, method_tag, digest=digest),
            proof,
            method=method.name,
            refusal=method.refusal,
            pipeline_class=type(pipeline),
        )
        _set_attribute(pipeline, method.name, _cached(calls, encode_fn, cache, report, inside, pipeline))
        originals[method.name] = encode_fn
        proofs[method.name] = proof
    object.__setattr__(pipeline, "_prompt_embed_cache", cache)
    object.__setattr__(pipeline, "_prompt_embed_cache_original_fn", originals.get(ENCODE_PROMPT))
    object.__setattr__(pipeline, "_prompt_embed_cache_originals", originals)
    object.__setattr__(pipeline, "_prompt_embed_cache_layout", proofs.get(ENCODE_PROMPT))
    object.__setattr__(pipeline, "_prompt_embed_cache_layouts", proofs)
    proof = proofs.get(ENCODE_PROMPT) or next(iter(proofs.values()))
    logger.info(
        "Prompt-embed cache (content-keyed) installed on %s: max_size=%d, max_bytes=%s, verify=%s, enabled=%s, "
        "host tier: %s, directory tier: %s, rows: %s, methods: %s.",
        tag,
        max_size,
        "unlimited" if max_bytes is None else max_bytes,
        verify,
        enabled,
        "off" if host_bytes is None else f"{host_bytes} bytes",
        "off"
        if directory is None
        else f"{directory} ({'no limit' if directory_bytes is None else f'{directory_bytes} bytes'})",
        f"{proof.layout.name} ({proof.source})"
        if proof.layout is not None
        else "inferred from the first batched call, then checked"
        if proof.may_infer
        else "whole calls only",
        "; ".join(
            f"{method.name} ({method.source}{'; never cached: ' + method.refusal if method.refusal else ''})"
            for method, _, _ in wrapped
        ),
    )
    for method, _, _ in wrapped:
        if method.refusal is not None:
            logger.warning("Prompt-embed cache: %s.%s is not cached: %s.", tag, method.name, method.refusal)
    return cache


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
    from vllm_omni_prompt_cache.vllm_omni.layouts import find_method_layout  # imports nothing of vLLM-Omni

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
    from vllm_omni_prompt_cache.vllm_omni.layouts import find_row_layout  # imports nothing of vLLM-Omni

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


class _CachedCalls:
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
        refusal: str | None = None,
        pipeline_class: type = object,
    ) -> None:
        self.store = store
        self.method = method  # whose counters every count made here goes to
        self._count = store.recorder(method)  # adds one tally to them
        self.pipeline_class = pipeline_class  # what an audit's mismatch turns the cache off for
        self.encode_fn = encode_fn
        self.signature = signature
        self.key_builder = key_builder
        self.proof = proof
        self.refusal = refusal  # why no call of this method may be cached (None: they may)

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        store = self.store
        if not store.enabled:
            return self._uncached(args, kwargs, tally(Outcome.BYPASS, reason=store.off_reason or DISABLED_REASON))
        if self.refusal is not None:
            return self._uncached(args, kwargs, tally(Outcome.BYPASS, reason=self.refusal))
        arguments = self.key_builder.bind(args, kwargs)
        if type(arguments) is Bypass:
            return self._uncached(args, kwargs, tally(Outcome.BYPASS, reason=arguments.reason))
        if self.key_builder.precomputed(arguments) is not None:
            return self._whole(args, kwargs, arguments)
        layout = self.proof.layout
        if layout is None:
            return self._whole(args, kwargs, arguments, infer=self.proof.may_infer)
        try:
            single = layout.single_row_key(arguments)
            split = None
            if single is None or (single.text and not self.proof.trusted):
                split = layout.split(arguments)
        except Exception as error:  # hostile arguments: reading them as rows must not fail the call
            return self._whole(
                args, kwargs, arguments, why=f"rows could not be read: {type(error).__qualname__} raised"
            )
        # A prompt's row is shared by its forms ("a" and ["a"]), which a layout the class does not vouch
        # for must have passed a check on before one is served for the other.
        if single is not None and (
            split is None or (type(split) is RowSplit and self.proof.has_checked(layout, split))
        ):
            return self._single_row(layout, args, kwargs, single)
        if type(split) is not RowSplit:
            return self._whole(args, kwargs, arguments, rows=layout.batch_size(arguments), why=split)
        keys = self._row_keys(split)
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

    def _single_row(self, layout: RowLayout, args: tuple, kwargs: dict, single: SingleRow) -> Any:
        """Serve a call that is its own only row, keyed as :meth:`RowLayout.single_row_key` reads it."""
        key = self.key_builder.build_from_arguments(single.arguments, row=True, host_views=single.host_views)
        if type(key) is Bypass:
            return self._uncached(args, kwargs, tally(Outcome.BYPASS, reason=key.reason, rows_encoded=1))
        try:
            return self.store.serve(
                key, lambda: layout.check_row(self._encode_to_keep(args, kwargs)), self._count_row, self.method
            )
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
        try:
            try:
                values = self.store.serve_rows(keys, self._row_encoder(split), rows, self.method)
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
    ) -> Any:
        """Serve the call under one key; ``rows``: how many rows it encodes, when a layout says; ``why``:
        why a call with a row layout is keyed whole.

        ``infer``: on a miss, try to infer a row layout from the call and its output (then check it).
        """
        encoded: list[Any] = []

        def encode() -> Any:
            result = self.encode_fn(*args, **kwargs)
            encoded.append(result)
            return result

        def count(outcome: Outcome, reason: str | None) -> None:
            if outcome is Outcome.HIT and why is None:
                self._count(WHOLE_HIT)
                return
            self._count(
                tally(outcome, reason=reason, whole_call=why, rows_encoded=0 if outcome is Outcome.HIT else rows or 0)
            )

        key = self.key_builder.build_from_arguments(arguments)
        if type(key) is Bypass:
            count(Outcome.BYPASS, key.reason)
            return encode()
        result = self.store.serve(key, lambda: unaliased(encode(), (args, kwargs)), count, self.method)
        if infer and encoded and self.proof.claim_inference():
            adopted = None
            try:
                adopted = self._infer(arguments, encoded[0])
            finally:
                self.proof.end_inference(adopted)
        return result

    def _infer(self, arguments: dict[str, Any], output: Any) -> RowLayout | None:
        """Return the layout a missed call suggests if its rows, encoded alone, assemble to ``output``."""
        layout = infer_layout(self.signature, arguments, output)
        if type(layout) is str:
            if layout != ONE_ROW:  # a one-row call says nothing: not worth a reason
                self._count(tally(whole_call=f"no row layout inferred: {layout}"))
            return None
        split = layout.split(arguments)
        keys = None if type(split) is not RowSplit else self._row_keys(split)
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

    def _row_keys(self, split: RowSplit) -> list[CallKey] | Bypass:
        keys = []
        for index in range(split.batch):
            key = self.key_builder.build_from_arguments(split.key_arguments(index), row=True)
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
        return unaliased(self.encode_fn(*args, **kwargs), (args, kwargs))


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
    placement = getattr(pipeline, PLACEMENT_ATTRIBUTE, None)
    if placement is not None:  # the encoders go back on the device for good
        placement.remove()
        object.__delattr__(pipeline, PLACEMENT_ATTRIBUTE)
    for name, original in originals.items():
        if getattr(original, "__self__", None) is pipeline and name in vars(pipeline):
            # The original was the class's bound method: drop the instance attribute.
            object.__delattr__(pipeline, name)
        else:
            _set_attribute(pipeline, name, original)
    for name in (
        "_prompt_embed_cache",
        "_prompt_embed_cache_original_fn",
        "_prompt_embed_cache_originals",
        "_prompt_embed_cache_layout",
        "_prompt_embed_cache_layouts",
    ):
        with contextlib.suppress(AttributeError):
            object.__delattr__(pipeline, name)
