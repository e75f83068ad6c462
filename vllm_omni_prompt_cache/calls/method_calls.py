"""How one wrapped method's calls are served: bypassed with a reason, learned on first use, or by the
method's strategy, whole or row by row.

:func:`cached_method` makes the function that replaces the method on the pipeline; it hands each call to
the method's :class:`MethodCalls`, the front, which reads the call once (:meth:`~.call_key.CallKeyBuilder.read`:
its arguments, whether it is a pass-through, the pipeline state its key holds, its key). The front says why
a call bypasses (the cache is off, the method is refused, its arguments do not bind), hands a method's
first use to :class:`~.first_use.FirstUse`, and every later call to the method's strategy. What an encode
decides about the method comes back as a :class:`~.verdicts.Verdict`; the front acts on it in one place
(:meth:`MethodCalls.settle`), and asks the installation only to unwrap a candidate that is not an encode.
The strategies: :class:`WholeCalls` keys a call whole (and on a miss may infer a row layout from it);
:class:`~.row_calls.RowCalls` serves each row of a batched call on its own. The strategy is chosen when the
method is wrapped, from its layout proof, and again (:meth:`MethodCalls.choose_strategy`) only when what it
rests on changes: a layout refuted, or inferred and adopted, or calls seen to write pipeline state.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from vllm_omni_prompt_cache.calls.found import (
    DISABLED_REASON,
    WHOLE_FOUND,
    Found,
    FoundCounts,
    kept_under,
)
from vllm_omni_prompt_cache.calls.row_calls import RowCalls
from vllm_omni_prompt_cache.counts.counters import (
    KEY_ONLY_HITS,
    PROVEN_HITS,
    Count,
    Outcome,
    tally,
)
from vllm_omni_prompt_cache.encoders.residency import PLACEMENT_ATTRIBUTE, EncoderMoves
from vllm_omni_prompt_cache.keys.call_key import Bypass, CallKey, CallKeyBuilder, ReadCall, seal, unseal
from vllm_omni_prompt_cache.keys.method_state import MethodState, pack
from vllm_omni_prompt_cache.keys.reads import current_attribute, is_packed, unpack
from vllm_omni_prompt_cache.logs import logger, warn_once
from vllm_omni_prompt_cache.proof.encoder_gate import NO_RECORD, NOT_REACHED, EncoderGate
from vllm_omni_prompt_cache.proof.first_use import FirstUse
from vllm_omni_prompt_cache.proof.verdicts import LEARNED_REASON, NO_VERDICT, Learned, NotRun, Unproven, Verdict
from vllm_omni_prompt_cache.rows.layout import RowLayout
from vllm_omni_prompt_cache.rows.layout_proofs import ONE_ROW, LayoutProof, compare_outputs, infer_layout
from vllm_omni_prompt_cache.store.audit import Audit
from vllm_omni_prompt_cache.store.audit import turn_off as turn_off_for_class
from vllm_omni_prompt_cache.store.prompt_embed_cache import PromptEmbedCache
from vllm_omni_prompt_cache.store.values import unaliased


class MethodHost(Protocol):
    """What only the pipeline's installation can do for a method (see :class:`~.installation.Installation`)."""

    inside: threading.local  # .active: a wrapped method of the pipeline runs on this thread

    def reject(self, name: str, why: str) -> None:
        """Unwrap a candidate found by watching that is not an encode (and try the method around it)."""


class MethodCalls:
    """Serves one pipeline method's calls: whole, row by row, or bypassed with a reason; counts each call once."""

    def __init__(
        self,
        store: PromptEmbedCache,
        encode_fn: Callable[..., Any],
        signature: inspect.Signature,
        key_builder: CallKeyBuilder,
        proof: LayoutProof,
        *,
        method: str,
        tag: str,
        pipeline: Any,
        state: MethodState,
        host: MethodHost,
        instance: Any,
        original: Callable[..., Any],
        gate: EncoderGate,
    ) -> None:
        self.store = store
        self.lookups = store.lookups  # how a key is served, and the ticket entries are made under now
        #: Whose attributes a call reads and writes: the object the method is bound to (the pipeline's own
        #: methods are bound to it; an encode_prompt given to an instance may be bound to another object).
        self.instance = pipeline if instance is None else instance
        self.method = method  # whose counters every count made here goes to
        self.tag = tag  # the pipeline's, in what the cache says of the method
        self.count = store.recorder(method)  # adds one tally to them
        self.pipeline_class = type(pipeline)  # what an audit's mismatch turns the cache off for
        self.encode_fn = encode_fn
        self.signature = signature
        self.key_builder = key_builder
        self.proof = proof
        self.state = state
        self.host = host
        #: the encodes its calls make outside a hit: first use, traced misses, proofs, first-hit checks
        self.first_use = FirstUse(
            store,
            state,
            key_builder,
            gate,
            method=method,
            pipeline=pipeline,
            instance=self.instance,
            encode_fn=encode_fn,
            original=original,
            inside=host.inside,
        )
        self.whole = WholeCalls(self)  # precomputed calls, and calls the row layout cannot read
        self.strategy: WholeCalls | RowCalls = self.whole
        self._choosing = threading.Lock()
        self.choose_strategy()

    def choose_strategy(self) -> None:
        """Choose how calls past first use are served, from the method's state and layout proof as they are now."""
        with self._choosing:
            layout = self.proof.layout
            if not self.state.rows_allowed:  # its calls write pipeline state: a hit replays a call's, not a row's
                self.strategy = self.whole
            elif layout is None:
                self.strategy = WholeCalls(self, infer=True) if self.proof.may_infer else self.whole
            else:
                self.strategy = RowCalls(self, layout)

    def refute(self, layout: RowLayout, why: str, *, inferred: bool = False) -> None:
        """Refute ``layout`` (see :meth:`LayoutProof.refute`); the calls after are keyed whole."""
        self.proof.refute(layout, why, inferred=inferred)
        self.choose_strategy()

    def end_inference(self, layout: RowLayout | None) -> None:
        """Adopt an inferred ``layout`` whose first check passed, or None (see :meth:`LayoutProof.end_inference`)."""
        self.proof.end_inference(layout)
        self.choose_strategy()

    def settle(self, verdict: Verdict) -> None:
        """Act on what a call decided about the method (see :class:`~.verdicts.Verdict`)."""
        if verdict == NO_VERDICT:
            return
        if verdict.rejection is not None:
            self.host.reject(self.method, verdict.rejection)
        if verdict.refusal is not None:
            self.store.register(self.method)
            logger.warning("Prompt-embed cache: %s.%s is not cached: %s.", self.tag, self.method, verdict.refusal)
        if verdict.whole_only:
            self._rows_off()
        elif verdict.restrategize:
            self.choose_strategy()
        if verdict.confirmed:
            state = self.state
            self.store.register(self.method)
            logger.info(
                "Prompt-embed cache: %s.%s is cached (%s), keyed on %s%s.",
                self.tag,
                self.method,
                state.source,
                ", ".join(state.keyed_on()),
                f"; hits replay {', '.join('self.' + name for name in state.writes)}" if state.writes else "",
            )

    def _rows_off(self) -> None:
        """Key this method's calls whole when they read or write pipeline state that rows cannot split."""
        if self.state.rows_allowed:
            return
        self.proof = LayoutProof(
            self.pipeline_class,
            None,
            "whole calls: it reads or writes pipeline state",
            may_infer=False,
            method=self.method,
        )
        self.choose_strategy()

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        try:
            return self._serve(args, kwargs)
        except Learned as learned:  # a row's encode read or wrote what earlier calls had not: served whole
            self.settle(learned.verdict)
            return self.uncached(args, kwargs, tally(Outcome.BYPASS, reason=learned.reason or LEARNED_REASON))

    def _serve(self, args: tuple, kwargs: dict) -> Any:
        store, state, strategy = self.store, self.state, self.strategy
        if not store.enabled:
            return self.uncached(args, kwargs, tally(Outcome.BYPASS, reason=store.off_reason or DISABLED_REASON))
        if state.refusal is not None:
            return self.uncached(args, kwargs, tally(Outcome.BYPASS, reason=state.refusal))
        call = self.key_builder.read(args, kwargs, state, self.instance, whole=type(strategy) is WholeCalls)
        if type(call) is Bypass:
            if state.inferred and state.learning:
                self.settle(Verdict(rejection="its calls do not bind to its signature"))
                return self._run_outside(args, kwargs)
            return self.uncached(args, kwargs, tally(Outcome.BYPASS, reason=call.reason))
        if call.learning:
            return self._learn(args, kwargs, call.arguments)
        if call.precomputed is not None:
            return self.uncached(args, kwargs, tally(Outcome.BYPASS, reason=call.precomputed.reason))
        if type(call.held) is Bypass:  # a component was replaced: its entries were made with the old one
            self._component_replaced()
            return self._learn(args, kwargs, call.arguments)
        return strategy.serve(args, kwargs, call)

    def _learn(self, args: tuple, kwargs: dict, arguments: dict[str, Any]) -> Any:
        """Serve a call of the method's first use (see :meth:`FirstUse.learn`), and act on what it decided."""
        result, verdict = self.first_use.learn(args, kwargs, arguments)
        self.settle(verdict)
        if type(result) is not NotRun:
            return result
        if result.bypass is None:  # a candidate that is not an encode
            return self._run_outside(args, kwargs)
        return self.uncached(args, kwargs, tally(Outcome.BYPASS, reason=result.bypass))

    def _run_outside(self, args: tuple, kwargs: dict) -> Any:
        """Run a rejected candidate as if it were not wrapped, so that the methods it calls are seen."""
        inside = self.host.inside
        inside.active = False
        try:
            return self.encode_fn(*args, **kwargs)
        finally:
            inside.active = True

    def _component_replaced(self) -> None:
        """Learn the method again, guarded by the components it reads now, and drop every entry (one made with a
        replaced encoder or tokenizer would be proven by the same token ids, and served wrong)."""
        replaced = self.state.relearn(self.instance)
        if not replaced:  # another call saw it first and cleared
            return
        self.store.clear()
        logger.info(
            "Prompt-embed cache: %s.%s: %s was replaced; every entry was dropped and the method is learned again.",
            self.pipeline_class.__qualname__,
            self.method,
            ", ".join(f"self.{name}" for name in replaced),
        )

    def serve_found(self, args: tuple, kwargs: dict, found: Found, *, row: Callable[[Any], Any] | None = None) -> Any:
        """Serve a call whose key found ``found.value`` (an entry, another call's encode, a lower tier's file):
        proven first when it holds what reached the text encoder then (see :mod:`.encoder_gate`); counted.

        ``row``: the call is one row, kept as ``row(output)`` returns it; else a whole call, whose hit replays
        the writes its encode made. Sets ``found.proven``: None (nothing to compare), True, or False (the
        call ran instead, its result kept beside the entry)."""
        value, record = unseal(found.value)
        if record is None and self.state.recorded:  # its encodes make records: one without is not served unproven
            record = NO_RECORD
        if record is not None:
            try:
                beside, unproven = self.first_use.hits.prove(args, kwargs, found.key, record, rows=row is not None)
            except Exception as error:  # raised as the uncached call would; counted, not lost
                self.count(tally(Outcome.BYPASS, reason=f"its proof run raised {type(error).__qualname__}"))
                raise
            found.proven = unproven is None
            if unproven is not None:
                self.settle(unproven.verdict)
                return self._encoded_instead(args, kwargs, found, unproven, row)
            if beside is not None:
                value = unseal(beside)[0]
        if found.proven:
            self.count(found.counts.proven)
        else:
            warn_once(
                f"{self.tag}.{self.method}'s hits are served on their key alone (key_only_hits): its encode reaches no "
                "text encoder the cache recognises, so none can be proven"
            )
            self.count({**found.counts.hit, KEY_ONLY_HITS: 1})
        return value if row is not None else unpack(value, self.instance)

    def _encoded_instead(
        self,
        args: tuple,
        kwargs: dict,
        found: Found,
        unproven: Unproven,
        row: Callable[[Any], Any] | None,
    ) -> Any:
        """Serve a call whose entry was not proven from its own encode, kept beside the entry; count it."""
        if unproven.reason == NOT_REACHED:  # it ran, but encoded nothing: a bypass, not a miss
            self.count(tally(Outcome.BYPASS, reason=NOT_REACHED))
        else:
            self.count(found.counts.unproven(unproven.reason))
        fresh = unaliased(unproven.result, (args, kwargs))
        if row is not None:
            fresh = row(fresh)
        if (
            unproven.trace is not None and unproven.record is not None
        ):  # kept beside (or over) the entry it differed from
            kept = fresh if row is not None else pack(fresh, self.state.replayed(unproven.trace))
            self.store.keep(kept_under(found.key, unproven), seal(kept, unproven.record), found.made_under)
        return fresh if row is not None else unproven.result

    def uncached(self, args: tuple, kwargs: dict, counts: Mapping[Count, Any]) -> Any:
        """Serve the call from the original function, not cached, counted as ``counts`` (a :func:`tally`)."""
        self.count(counts)
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


def cached_method(
    calls: MethodCalls,
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
    are placed only if it calls the original, see :func:`noting_encodes`); a call that did not
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
    calls: MethodCalls,
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


def noting_encodes(encode_fn: Callable[..., Any], inside: threading.local, pipeline: Any) -> Callable[..., Any]:
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


class WholeCalls:
    """Strategy: each call keyed whole, one entry per call. ``infer``: a miss may suggest a row layout, which
    its rows, encoded alone, then have to match before it is adopted."""

    def __init__(self, calls: MethodCalls, *, infer: bool = False) -> None:
        self.calls = calls
        self.infer = infer

    def serve(self, args: tuple, kwargs: dict, call: ReadCall) -> Any:
        """Serve a call past its method's first use, as :meth:`CallKeyBuilder.read` found it."""
        return self.call(args, kwargs, call.arguments, infer=self.infer, held=call.held, key=call.key)

    def call(
        self,
        args: tuple,
        kwargs: dict,
        arguments: dict[str, Any],
        *,
        rows: int | None = None,
        why: str | None = None,
        infer: bool = False,
        held: tuple | None = None,
        key: CallKey | Bypass | None = None,
    ) -> Any:
        """Serve the call under one key; ``rows``: how many rows it encodes, when a layout says; ``why``:
        why a call with a row layout is keyed whole; ``held``: the pipeline state the key also holds;
        ``key``: the key, when it was read already.

        ``infer``: on a miss, try to infer a row layout from the call and its output (then check it).
        """
        calls = self.calls
        encoded: list[Any] = []

        def encode() -> Any:
            result, trace, gate_run = calls.first_use.encode_traced(args, kwargs)
            encoded.append(result)
            return seal(pack(unaliased(result, (args, kwargs)), calls.state.replayed(trace)), gate_run.kept_record)

        def count(outcome: Outcome, reason: str | None) -> None:  # a miss or bypass; a hit counts once proven
            calls.count(tally(outcome, reason=reason, whole_call=why, rows_encoded=rows or 0))

        if key is None:
            key = calls.key_builder.build_from_arguments(arguments, held=held)
        if type(key) is Bypass:
            count(Outcome.BYPASS, key.reason)
            result = calls.encode_fn(*args, **kwargs)
            encoded.append(result)
            return result
        made_under = calls.lookups.ticket
        try:
            value = calls.lookups.serve(key, encode, count, calls.method)
        except Learned as learned:  # the key grew while encoding: kept under the key it has now
            calls.settle(learned.verdict | Verdict(whole_only=True))
            return calls.first_use.keep_learned(args, kwargs, arguments, learned, made_under)
        if not encoded:  # an entry, another call's encode, a lower tier's file: proven first
            return self._found(args, kwargs, Found(key, value, whole_found(why, rows), made_under))
        value = unseal(value)[0]  # this call encoded: the pipeline holds what it wrote already
        result = value[1] if is_packed(value) else value
        if infer and calls.proof.claim_inference():
            adopted = None
            try:
                adopted = self._infer(arguments, encoded[0], held)
            finally:
                calls.end_inference(adopted)
        return result

    def _found(self, args: tuple, kwargs: dict, found: Found) -> Any:
        """Serve a call whose key found an entry (see :meth:`MethodCalls.serve_found`), its first hit checked."""
        calls, state = self.calls, self.calls.state
        # The first hit's check encodes on the state the call had, not on the writes the hit replays.
        before = {name: current_attribute(calls.instance, name) for name in state.writes} if state.check_pending else {}
        result = calls.serve_found(args, kwargs, found)
        if found.proven is not False and state.check_pending:
            result, verdict = calls.first_use.first_hit_check(args, kwargs, result, before)
            calls.settle(verdict)
        return result

    def _infer(self, arguments: dict[str, Any], output: Any, held: tuple | None) -> RowLayout | None:
        """Return the layout a missed call suggests if its rows, encoded alone, assemble to ``output``."""
        layout = infer_layout(self.calls.signature, arguments, output)
        if type(layout) is str:
            if layout != ONE_ROW:  # a one-row call says nothing: not worth a reason
                self.calls.count(tally(whole_call=f"no row layout inferred: {layout}"))
            return None
        return layout if RowCalls(self.calls, layout).check_inferred(arguments, output, held) else None


def whole_found(why: str | None, rows: int | None) -> FoundCounts:
    """Return what a whole call that found an entry counts: served (proven or not), or encoded instead."""
    if why is None:
        return WHOLE_FOUND
    hit = tally(Outcome.HIT, whole_call=why)
    return FoundCounts(hit, {**hit, PROVEN_HITS: 1}, tally(Outcome.MISS, whole_call=why, rows_encoded=rows or 0))
