"""How a wrapped method earns the cache's trust, and what its calls teach it.

:class:`FirstUse` runs every traced encode of a method: its first use, its misses, a hit's proof. A
method's first call (for a method found by watching, or wherever several ranks run) is served uncached
and observed (:meth:`FirstUse.learn`); every encode after is traced (:meth:`FirstUse.encode_traced`), and
what it read beyond the method's key grows the key. A call whose key grew is kept under the grown key,
never under the one it was looked up with. Every encode records what reached its first text encoder, and
a hit of an entry with a record is proven against it before it is served (:meth:`FirstUse.prove`, see
:mod:`.encoder_gate`). The first hit of an inferred key is encoded again and compared
(:meth:`FirstUse.first_hit_check`).

What a call decides about its method comes back as a :class:`Verdict`, which the front
(:class:`~.method_calls.MethodCalls`) acts on in one place: a candidate that is not an encode, a method
refused, a first use confirmed, calls to be keyed whole. A refusal is written into the method's state at
once, so that the calls after it bypass and no encode judged after it is kept; the verdict carries the
saying of it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

from vllm_omni_prompt_cache.counts.counters import Outcome, tally
from vllm_omni_prompt_cache.encoders.residency import PLACEMENT_ATTRIBUTE
from vllm_omni_prompt_cache.keys.call_key import Bypass, CallKey, CallKeyBuilder, seal, with_encoder_input
from vllm_omni_prompt_cache.keys.method_state import MethodState, pack
from vllm_omni_prompt_cache.keys.reads import CannotTrace, Snapshot, Trace, current_attribute, is_absent, refill, traced
from vllm_omni_prompt_cache.logs import logger
from vllm_omni_prompt_cache.proof.discovery import observed
from vllm_omni_prompt_cache.proof.encoder_gate import (
    DIFFERED_AFTER,
    NO_RECORD,
    UNRECORDED,
    EncoderGate,
    GateRun,
    Record,
    Refuted,
    parse,
)
from vllm_omni_prompt_cache.proof.stand_ins import Draws, ProofGuard, result_digest
from vllm_omni_prompt_cache.proof.verdicts import (
    LEARNED_REASON,
    LEFT_BEHIND,
    NO_VERDICT,
    Encode,
    Learned,
    NotRun,
    Unproven,
    Verdict,
    collectives_refusal,
    drawing_refusal,
    unprovable_refusal,
)
from vllm_omni_prompt_cache.rows.layout_proofs import compare_outputs
from vllm_omni_prompt_cache.store.flights import Ticket
from vllm_omni_prompt_cache.store.prompt_embed_cache import PromptEmbedCache
from vllm_omni_prompt_cache.store.values import unaliased


class FirstUse:
    """The traced encodes of one wrapped method's calls: first use, misses, a hit's proof, first-hit checks; each
    hands back what it decided (a :class:`Verdict`)."""

    def __init__(
        self,
        store: PromptEmbedCache,
        state: MethodState,
        key_builder: CallKeyBuilder,
        gate: EncoderGate,
        *,
        method: str,
        pipeline: Any,
        instance: Any,
        encode_fn: Callable[..., Any],
        original: Callable[..., Any],
        inside: threading.local,
    ) -> None:
        self.store = store
        self.state = state
        self.key_builder = key_builder
        self.gate = gate  # what records and compares the inputs of the pipeline's text encoders
        self.method = method
        self.count = store.recorder(method)
        self.pipeline = pipeline  # whose modules an observed encode watches, and where a placement is
        self.instance = instance  # whose attributes a call reads and writes (see MethodCalls.instance)
        self.encode_fn = encode_fn  # the method, noting that the call encoded and placed for it
        self.original = original  # the method as the pipeline had it: what a proof run calls, unplaced
        self.inside = inside  # .encoded: the current call ran the text encoder

    def refusal(self, why: str) -> Verdict:
        """Stop caching the method at once (the calls after bypass, and no encode ending after it is kept); the
        verdict says so, once."""
        return Verdict(refusal=why) if self.state.refuse(why) else NO_VERDICT

    def _encode(self, args: tuple, kwargs: dict, *, observe: bool | None = None) -> Encode:
        """Run the call traced (what it reads and writes on the instance) in a gate run (what reaches each of its text
        encoder calls), then once more with each encoder call answered by a stand-in, which completes the record an
        entry of it keeps (:meth:`_reference`): a first use, every later encode, a proof that encodes. ``observe``:
        also watch which modules and collectives run (None: while no encode was watched; a hit would skip
        collectives on one rank)."""
        observe = not self.state.observed if observe is None else observe
        before, pristine = Snapshot(self.instance), _copied(args, kwargs)  # what the reference run starts from
        with self.gate.run() as gate_run:
            gate_run.on_refute = self.note_encoded
            if not observe:  # every encode after the first: traced only
                with traced(self.instance) as trace:
                    gate_run.trace = trace
                    result = self.encode_fn(*args, **kwargs)
                observation = None
            else:
                with observed(self.pipeline) as observation, traced(self.instance) as trace:
                    gate_run.trace = trace
                    result = self.encode_fn(*args, **kwargs)
        if observe:
            self.state.note_observed()
        encode = Encode(result, trace, gate_run, observation)
        if observation is None or not observation.collectives:  # one that runs them is refused, on every rank
            self._reference(*pristine, encode, before)
        return encode

    def _reference(self, args: tuple, kwargs: dict, encode: Encode, before: Snapshot) -> None:
        """Complete the record of a real encode: run the method once more on the state it started from, each encoder
        call answered by its stand-in, and keep the digest of what it returns (see :mod:`.encoder_gate`).
        ``before``: the instance before the encode (what it wrote and changed in place is undone for the run); it is
        left as the encode left it. Sets ``gate_run.whole``, or ``gate_run.unprovable`` with why no hit
        of this method could be proven."""
        gate_run = encode.gate_run
        recorded = gate_run.recorded
        if recorded is None:
            return
        touched = _touched(encode.trace)
        after = Snapshot(self.instance)
        before.restore(names=touched)
        guard = ProofGuard()
        result: Any = None
        why = None
        again = Trace(self.instance)
        run_args, run_kwargs = _copied(args, kwargs)  # ``args`` stay as the caller gave them
        try:
            with (
                guard,
                self.gate.run(recorded, reference=True, guard=guard) as reference,
                traced(self.instance) as again,
            ):
                again.setters_from_start, reference.trace = True, again
                result = self.original(*run_args, **run_kwargs)
            if reference.differed is not None:  # the run's own code caught the Refuted
                why = "its encode, run again, gave its text encoders other inputs: no hit could be proven"
            elif len(reference.calls) != len(recorded.calls):
                why = "its encode, run again, called its text encoders otherwise: no hit could be proven"
        except Draws as draws:
            why = drawing_refusal(str(draws))
        except Refuted:
            why = "its encode, run again, gave its text encoders other inputs: no hit could be proven"
        except Exception as error:
            why = (
                f"its encode, run again with its text encoders answered by stand-ins, raised {type(error).__qualname__}"
            )
            logger.debug("Prompt-embed cache: the reference run of %s raised.", self.method, exc_info=True)
        finally:
            again.undo_setters()
            touched |= _touched(again)
            again.release()
            after.restore(names=touched)
        if why is None and guard.drew() is not None:  # drawn and caught by the run's own code
            why = drawing_refusal(str(guard.drew()))
        digest = result_digest(result) if why is None else None
        if type(digest) is Bypass:
            why = f"what its encode returns cannot be compared ({digest.reason})"
        del run_args, run_kwargs
        if guard.left_behind(result):
            # Stand-in data stayed where the cache cannot put it back: the real encode writes it over, once.
            why = why or LEFT_BEHIND
            with contextlib.suppress(Exception):  # the call was served already: this is the cache's own repair
                self.encode_fn(*_copied(args, kwargs)[0], **_copied(args, kwargs)[1])
        if why is not None:
            gate_run.unprovable = why
        else:
            gate_run.whole = Record(recorded.calls, digest).spell()

    def _judge(self, encode: Encode, refusal: str | None = None) -> tuple[bool, str | None]:
        """Merge what an encode read and wrote into the method's state (unless ``refusal`` already says why it is
        not cached); return whether its key grew, and why the method cannot be cached, if so. A first use and
        every later encode are judged alike: collectives, then what it read and wrote, then its encoder's input."""
        # An encode that recorded, or ran a text encoder only watching it recognised (its entry holds no proof):
        # from now on an entry without a record is not served on its key alone.
        gate_run = encode.gate_run
        if gate_run.whole is not None or (encode.observation is not None and encode.observation.new_tables):
            self.state.note_recorded()
        if refusal is None and encode.observation is not None and encode.observation.collectives:
            refusal = collectives_refusal(encode.observation.collectives)
        grew = False
        if refusal is None:
            grew, refusal = self.state.learn(encode.trace, encode.result)
        unreadable = encode.gate_run.unreadable
        if refusal is None and unreadable is not None:
            refusal = unprovable_refusal(unreadable)
        if refusal is None and encode.gate_run.unprovable is not None:
            refusal = encode.gate_run.unprovable
        return grew, refusal

    def encode_traced(self, args: tuple, kwargs: dict, *, rows: bool = False) -> tuple[Any, Trace, GateRun]:
        """Encode, seeing what the call reads from and writes to the pipeline and what reaches its first text
        encoder (the returned :class:`~.encoder_gate.GateRun`); raise :class:`Learned` when that is more than
        earlier calls showed (the call's key lacked it) or cannot be cached, with what it decided."""
        return self._judged(self._encode(args, kwargs), rows=rows, in_flight=True)

    def _judged(self, encode: Encode, *, rows: bool, in_flight: bool) -> tuple[Any, Trace, GateRun]:
        """Judge an encode past the method's first use (see :meth:`encode_traced`); ``in_flight``: it computes a
        store flight's value (a proof's encode does not)."""
        state = self.state
        result, trace, gate_run = encode.result, encode.trace, encode.gate_run
        # Writes another call learned meanwhile count as this one's: it is then served, not kept (the safe side).
        writes_before = len(state.writes)
        grew, refusal = self._judge(encode)
        verdict = NO_VERDICT if refusal is None else self.refusal(refusal)
        if len(state.writes) > writes_before:  # its calls write state: rows are off from the next call
            verdict |= Verdict(restrategize=True)
        # A row is never kept for a method whose calls write state (a hit replays a call's writes, not a row's),
        # whichever strategy the call was served by.
        written = len(state.writes) > writes_before or (rows and not state.rows_allowed)
        if refusal is None and state.refusal is not None:  # another call refused the method while this one ran
            refusal = state.refusal
        if refusal is not None or (grew and not rows) or written:
            raise Learned(result, trace, refusal, gate_run.whole, verdict)
        if grew and in_flight:  # a row: kept, then moved to a key holding what it read (keep_rows), no file
            self.store.withhold_write_through()
        gate_run.grew = grew
        return result, trace, gate_run

    def prove(
        self, args: tuple, kwargs: dict, found: CallKey, record: str, *, rows: bool = False
    ) -> tuple[Any, Unproven | None]:
        """Run the call with each text-encoder call answered by its stand-in, and compare what reaches each call and
        what the run returns with ``record``, what the encode of the entry under ``found`` did. Return ``(value,
        None)`` when all are equal (``value``: the entry kept beside ``found``'s that was proven instead, or None:
        the one compared); no encoder ran, and the instance is as it was at the first encoder call. Otherwise the
        call was encoded, as a miss is, and judged as one: ``(None, Unproven)``, its result, what to keep of it and
        what it decided (see :mod:`.encoder_gate`)."""
        expected = parse(record) if record != NO_RECORD else None
        main_input = expected.first_input if expected is not None and expected.calls else None
        placed = getattr(self.pipeline, PLACEMENT_ATTRIBUTE, None) is not None
        guard = ProofGuard()
        # What a later run starts from (its reference run, an encode instead): the instance, and the arguments as the
        # caller gave them (an encode may change them in place: vLLM-Omni's Z-Image templates its prompt list).
        before, given = Snapshot(self.instance), _copied(args, kwargs)
        gate_run = GateRun()
        trace = Trace(self.instance)
        try:
            with guard, self.gate.run(expected or Record((), ""), abort_on_refute=placed, guard=guard) as gate_run:
                gate_run.on_refute, gate_run.alternative = self.note_encoded, self._alternative(found)
                with traced(self.instance) as trace:
                    trace.snapshot_at_encoder, gate_run.trace = True, trace
                    result = self.original(*args, **kwargs)
        except Refuted:  # stand-ins were handed out, or its encoders wait off the device: encoded again
            return None, self._again(trace, before, args, kwargs, given, gate_run.why_unproven, rows, main_input)
        except Draws as draws:
            return None, self._drew(trace, before, str(draws), args, kwargs, given)
        except Exception as error:
            if not gate_run.calls or gate_run.went_on:  # before any stand-in: raised as the uncached call would
                raise
            why = f"its proof run raised {type(error).__qualname__}"  # on stand-in data: encoded again
            return None, self._again(trace, before, args, kwargs, given, why, rows, main_input)
        if gate_run.went_on:  # its first encoder input differed: the run went on through the encoder, a miss's
            encode = Encode(result, trace, gate_run, None)
            self._reference(*given, encode, before)
            why = UNRECORDED if expected is None and gate_run.unreadable is None else gate_run.why_unproven
            return None, self._unproven(encode, rows, why, main_input)
        if guard.drew() is not None:  # a draw the run's own code caught
            return None, self._drew(trace, before, str(guard.drew()), args, kwargs, given)
        if gate_run.differed is not None:  # a Refuted the run's own code caught
            return None, self._again(trace, before, args, kwargs, given, gate_run.why_unproven, rows, main_input)
        if not gate_run.calls:  # it reached no encoder: its own result is served
            return None, Unproven(result, None, None, gate_run.why_unproven)
        trace.undo_after_encoder(release=True, since=before)  # first: what it wrote on the instance a hit replays
        left = guard.left_behind(result)  # before the caller's arguments are refilled: what they kept counts
        _put_back(args, kwargs, given)
        assert gate_run.expected is not None
        complete = len(gate_run.calls) == len(gate_run.expected.calls)
        if complete and result_digest(result) == gate_run.expected.result:
            if left:
                verdict = self.refusal(LEFT_BEHIND)
                return None, Unproven(self.encode_fn(*args, **kwargs), None, None, LEFT_BEHIND, verdict)
            return gate_run.beside, None
        return None, self._encoded_again(args, kwargs, DIFFERED_AFTER, rows, main_input)

    def _again(
        self,
        trace: Trace,
        before: Snapshot,
        args: tuple,
        kwargs: dict,
        given: tuple[tuple, dict],
        reason: str,
        rows: bool,
        main_input: str | None,
    ) -> Unproven:
        """Put back what a stopped proof run changed (the instance after its encoder call, the caller's arguments) and
        encode the call as a miss."""
        trace.undo_after_encoder(since=before)
        _put_back(args, kwargs, given)
        return self._encoded_again(args, kwargs, reason, rows, main_input)

    def _drew(
        self, trace: Trace, before: Snapshot, draw: str, args: tuple, kwargs: dict, given: tuple[tuple, dict]
    ) -> Unproven:
        """Refuse a method whose proof run drew random numbers (undone); encode the call uncached, as given."""
        trace.undo_after_encoder(since=before)
        _put_back(args, kwargs, given)
        why = drawing_refusal(draw)
        verdict = self.refusal(why)
        return Unproven(self.encode_fn(*args, **kwargs), None, None, why, verdict)

    def _encoded_again(self, args: tuple, kwargs: dict, reason: str, rows: bool, main_input: str | None) -> Unproven:
        """Encode a call whose proof run was answered by stand-ins and did not prove it, as a miss."""
        return self._unproven(self._encode(args, kwargs), rows, reason, main_input)

    def _unproven(self, encode: Encode, rows: bool, reason: str, main_input: str | None) -> Unproven:
        """Judge an encode made instead of a hit as a miss is judged; return what the call serves and keeps."""
        try:
            result, trace, gate_run = self._judged(encode, rows=rows, in_flight=False)
        except Learned as learned:  # it read or wrote what the key does not hold: served, not kept
            return Unproven(learned.result, None, None, learned.reason or LEARNED_REASON, learned.verdict)
        first = gate_run.first_input if type(gate_run.first_input) is str else None
        # A run whose key grew read state this key lacks: served, not kept beside under it.
        kept = None if gate_run.grew or gate_run.whole is None else trace
        return Unproven(result, kept, gate_run.whole, reason, NO_VERDICT, None if first == main_input else first)

    def _alternative(self, found: CallKey) -> Callable[[str], tuple[bool, Any]]:
        """Return the look-up of the entry kept beside ``found``'s for another first encoder input (not counted)."""
        return lambda first_input: self.store.peek(with_encoder_input(found, first_input), self.method)

    def note_encoded(self) -> None:
        """Note that the current call ran the text encoder (a proof run that went on through it)."""
        self.inside.encoded = True

    def keep_learned(
        self, args: tuple, kwargs: dict, arguments: dict[str, Any], learned: Learned, made_under: Ticket
    ) -> Any:
        """Keep a whole call's result under the key its grown state gives it (the values before it ran), unless a
        clear() came since ``made_under`` was the store's ticket (before it encoded); return the result."""
        if self.state.refusal is None and self.key_builder.precomputed(arguments) is None:
            key, value = self._entry(args, kwargs, arguments, learned.result, learned.trace, learned.record)
            if type(key) is not Bypass:
                self.store.keep(key, value, made_under)
        return learned.result

    def _entry(
        self, args: tuple, kwargs: dict, arguments: dict[str, Any], result: Any, trace: Trace, record: str | None
    ) -> tuple[CallKey | Bypass, Any]:
        """Return the key a call whose encode was traced is kept under (the state it read, as it was before the
        call wrote it) and the entry: its result, the writes a hit replays, what reached its text encoder."""
        state = self.state
        key = self.key_builder.build_from_arguments(arguments, held=state.state_argument_before(trace, self.instance))
        return key, seal(pack(unaliased(result, (args, kwargs)), state.replayed(trace)), record)

    def learn(self, args: tuple, kwargs: dict, arguments: dict[str, Any]) -> tuple[Any, Verdict]:
        """Serve a method's first call uncached and watch it: what it reads and writes, which modules and
        collectives it runs; keep its result if it may be cached. Return the result, or :class:`NotRun` for a call
        left to the front (a pass-through, arguments no key holds, an instance that cannot be traced, a candidate
        whose arguments show it is not an encode), and what the call decided (see :mod:`.discovery`)."""
        state = self.state
        precomputed = self.key_builder.precomputed(arguments)
        if precomputed is not None:  # a pass-through teaches nothing
            return NotRun(precomputed.reason), NO_VERDICT
        before = self.key_builder.build_from_arguments(arguments)
        if type(before) is Bypass:
            if state.inferred:
                return NotRun(None), Verdict(rejection=f"its arguments cannot be keyed ({before.reason})")
            return NotRun(before.reason), NO_VERDICT
        made_under = self.store.lookups.ticket  # a clear() while it encodes (a component replaced, say) voids its entry
        try:
            encode = self._encode(args, kwargs, observe=True)
        except CannotTrace as error:
            return NotRun(str(error)), self.refusal(str(error))
        result, trace, observation = encode.result, encode.trace, encode.observation
        assert observation is not None
        if state.inferred:
            others = observation.other_modules()
            why = "it returns nothing" if result is None else f"it also runs {', '.join(others)}" if others else None
            if why is not None:
                return result, Verdict(rejection=why)
            if not observation.encoders:  # this call encoded nothing: learn from a later one
                return result, NO_VERDICT
        after = self.key_builder.build_from_arguments(arguments)
        changed = type(after) is Bypass or after.identity != before.identity
        refusal = self._judge(
            encode, "it changes its arguments in place, which a hit could not repeat" if changed else None
        )[1]
        if refusal is not None:
            verdict = self.refusal(refusal)
            self.count(tally(Outcome.BYPASS, reason=refusal))
            return result, verdict
        # Calls that learn at once each keep their encode; the one that ends the first use confirms it.
        ended = state.finish_learning(check=state.inferred or bool(state.data) or bool(state.writes))
        verdict = Verdict(confirmed=ended, whole_only=True)
        if state.refusal is not None:  # another call refused the method while this one ran: not kept
            self.count(tally(Outcome.BYPASS, reason=state.refusal))
            return result, verdict
        key, value = self._entry(args, kwargs, arguments, result, trace, encode.gate_run.whole)
        if type(key) is Bypass:
            self.count(tally(Outcome.BYPASS, reason=key.reason))
            return result, verdict
        counted: list[tuple[Outcome, str | None]] = []  # a miss, or a collision's bypass
        self.store.lookups.serve(key, lambda: value, lambda *outcome: counted.append(outcome), self.method, made_under)
        outcome, reason = counted[0] if counted else (Outcome.MISS, None)  # the key was held: it encoded all the same
        self.count(tally(outcome, reason=reason))
        return result, verdict

    def first_hit_check(self, args: tuple, kwargs: dict, served: Any, before: Mapping[str, Any]) -> tuple[Any, Verdict]:
        """Encode the first hit of a method whose key was inferred again, and compare output and writes;
        a difference serves the fresh encode and refuses the method. Counted as an audit. ``before``:
        what the attributes the hit replayed held before it did (the encode runs on that state, as the call's).
        Return what the call gets and what the check decided."""
        state = self.state
        if not state.take_check():
            return served, NO_VERDICT
        replayed = {name: current_attribute(self.instance, name) for name in state.writes}
        for name, value in before.items():
            if is_absent(value):
                with contextlib.suppress(AttributeError):
                    delattr(self.instance, name)
            else:
                setattr(self.instance, name, value)
        verdict = NO_VERDICT
        try:
            fresh, trace, _ = self.encode_traced(args, kwargs)
        except Learned as learned:
            fresh, trace, verdict = learned.result, learned.trace, learned.verdict
        why = compare_outputs(served, fresh)[0]
        for name, written in state.replayed(trace).items():
            if why is None and (differs := compare_outputs(replayed.get(name), written)[0]) is not None:
                why = f"self.{name}: {differs}"
        self.store.record_audit(mismatch=why is not None, method=self.method)
        if why is None:
            for name, value in replayed.items():  # the pipeline holds what the hit replayed, as on any hit
                setattr(self.instance, name, value)
            return served, verdict
        return fresh, verdict | self.refusal(f"its first hit differed from an uncached call ({why})")


def _copied(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Return the call's arguments with every list, dict, tuple and set in them copied (what they hold is shared)."""
    return _containers_copied(args), _containers_copied(kwargs)


def _put_back(args: tuple, kwargs: dict, given: tuple[tuple, dict]) -> None:
    """Refill the caller's lists, dicts and sets among ``args`` and ``kwargs`` with what they held when given (their
    copies in ``given``): what a proof run wrote into them may be stand-in data."""
    for now, then in ((args, given[0]), (kwargs, given[1])):
        for key in range(len(now)) if isinstance(now, tuple) else now:
            if type(now[key]) in (list, dict, set):
                refill(now[key], then[key])


def _touched(trace: Trace) -> set[str]:
    """Return the instance attributes a traced call read or wrote (what its runs may have changed)."""
    return {*trace.reads, *trace.writes, *trace.overwritten, *trace.read_identities}


def _containers_copied(value: Any, depth: int = 0) -> Any:
    if depth > 32:
        return value
    if type(value) in (list, tuple, set):
        return type(value)(_containers_copied(item, depth + 1) for item in value)
    if type(value) is dict:
        return {key: _containers_copied(item, depth + 1) for key, item in value.items()}
    return value
