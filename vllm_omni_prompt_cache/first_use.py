"""How a wrapped method earns the cache's trust, and what its calls teach it.

:class:`FirstUse` runs every traced encode of a method: its first use, its misses, a hit's proof. A
method's first call (for a method found by watching, or wherever several ranks run) is served uncached
and observed (:meth:`FirstUse.learn`); every encode after is traced (:meth:`FirstUse.encode_traced`), and
what it read beyond the method's key grows the key. A call whose key grew is kept under the grown key,
never under the one it was looked up with. Every encode records what reached its first text encoder, and
a hit of an entry with a record is proven against it before it is served (:meth:`FirstUse.prove`, see
:mod:`.encoder_inputs`). The first hit of an inferred key is encoded again and compared
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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from vllm_omni_prompt_cache.counters import Outcome, tally
from vllm_omni_prompt_cache.discovery import Observation, observed
from vllm_omni_prompt_cache.encoder_inputs import EncoderGate, GateRun, Proven, Refuted, seal, with_encoder_input
from vllm_omni_prompt_cache.flights import Ticket
from vllm_omni_prompt_cache.keys import Bypass, CallKey, CallKeyBuilder
from vllm_omni_prompt_cache.proofs import compare_outputs
from vllm_omni_prompt_cache.reads import (
    CannotTrace,
    MethodState,
    Trace,
    current_attribute,
    is_absent,
    pack,
    traced,
)
from vllm_omni_prompt_cache.residency import PLACEMENT_ATTRIBUTE
from vllm_omni_prompt_cache.store import PromptEmbedCache
from vllm_omni_prompt_cache.values import unaliased

#: Bypass reason for a row call whose encode read or wrote pipeline state earlier calls had not.
LEARNED_REASON = "its encode read or wrote pipeline state no earlier call had: served whole and uncached"


class Verdict(NamedTuple):
    """What a call decided about its method, for the front to act on (:meth:`~.method_calls.MethodCalls.settle`)."""

    refusal: str | None = None  # the method is not cached from now on (already in its state): say why, once
    rejection: str | None = None  # a candidate found by watching is not an encode: unwrap it, for this reason
    confirmed: bool = False  # its first use ended: it is cached from now on
    whole_only: bool = False  # its calls read or write pipeline state: keyed whole, no row layout
    restrategize: bool = False  # its calls were seen to write pipeline state: choose how calls are served again

    def __or__(self, other: Verdict) -> Verdict:
        """Both verdicts: the first refusal and rejection stand, the flags add up."""
        return Verdict(
            self.refusal or other.refusal,
            self.rejection or other.rejection,
            self.confirmed or other.confirmed,
            self.whole_only or other.whole_only,
            self.restrategize or other.restrategize,
        )


#: A call that decided nothing about its method.
NO_VERDICT = Verdict()


class NotRun(NamedTuple):
    """A call :meth:`FirstUse.learn` left for the front to run once it has acted on the verdict."""

    bypass: str | None  # run uncached, counted as a bypass for this reason; None: not an encode, run outside the cache


class Learned(BaseException):
    """Raised out of an encode that read or wrote more than the method's key holds (or cannot be cached):
    its result must not be kept under the key the call was looked up with. A BaseException, so that no
    handler of encoder failures takes it for one. ``record``: what reached its text encoder; ``verdict``:
    what it decided about the method."""

    def __init__(
        self, result: Any, trace: Trace, refusal: str | None, record: str | None = None, verdict: Verdict = NO_VERDICT
    ) -> None:
        super().__init__(refusal or LEARNED_REASON)
        self.result, self.trace, self.reason, self.record, self.verdict = result, trace, refusal, record, verdict


class Encode(NamedTuple):
    """One traced encode (see :meth:`FirstUse._encode`)."""

    result: Any  # what the method returned
    trace: Trace  # what it read from and wrote to the instance
    gate_run: GateRun  # what reached its first text encoder, and what a proof run found
    observation: Observation | None  # which modules and collectives it ran (None: not watched)


class Unproven(NamedTuple):
    """A call that found an entry it could not be proven equal to: it encoded instead."""

    result: Any  # what the call returns: its own encode
    trace: Trace | None  # what that encode read and wrote; None: not to be kept (its key lacked state)
    record: str | None  # what reached its text encoder, for the entry that replaces the old one
    reason: str  # why the entry was not served (see encoder_inputs)
    verdict: Verdict = NO_VERDICT  # what its encode decided about the method


def unprovable_refusal(why: Bypass) -> str:
    """Return why a method whose text encoder takes inputs no key can hold is not cached."""
    return f"its text encoder's inputs cannot be keyed ({why.reason}), so no hit could be proven equal to an encode"


def collectives_refusal(collectives: Sequence[str]) -> str:
    """Return why a method whose encode runs collectives is not cached."""
    return (
        f"it runs collectives ({', '.join(collectives)}): a hit would skip them on one rank while another rank "
        "runs them"
    )


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

    def _encode(
        self,
        args: tuple,
        kwargs: dict,
        *,
        expected: str | None = None,
        alternative: Callable[[str], tuple[bool, Any]] | None = None,
        observe: bool | None = None,
    ) -> Encode:
        """Run the call traced (what it reads and writes on the instance) in a gate run (what reaches its first text
        encoder): a first use, every later encode and a hit's proof. ``observe``: also watch which modules and
        collectives run (None: while no encode was watched; a hit would skip collectives on one rank).
        ``expected``: a proof's entry record: the original runs unplaced and raises :class:`~.encoder_inputs.Proven`
        when what reaches the encoder equals it, or ``alternative`` finds an entry made with it."""
        observe = not self.state.observed if observe is None else observe
        encode_fn = self.encode_fn if expected is None else self.original
        placed = expected is not None and getattr(self.pipeline, PLACEMENT_ATTRIBUTE, None) is not None
        with self.gate.run(expected, abort_on_refute=placed) as gate_run:
            gate_run.on_refute, gate_run.alternative = self.note_encoded, alternative
            if not observe:  # a hit's proof run, and every encode after the first: traced only
                with traced(self.instance) as trace:
                    gate_run.trace = trace
                    result = encode_fn(*args, **kwargs)
                return Encode(result, trace, gate_run, None)
            with observed(self.pipeline) as observation, traced(self.instance) as trace:
                gate_run.trace = trace
                result = encode_fn(*args, **kwargs)
        if not gate_run.proven:  # a proof whose method swallowed the Proven ran no whole encode: watch the next
            self.state.note_observed()
        return Encode(result, trace, gate_run, observation)

    def _judge(self, encode: Encode, refusal: str | None = None) -> tuple[bool, str | None]:
        """Merge what an encode read and wrote into the method's state (unless ``refusal`` already says why it is
        not cached); return whether its key grew, and why the method cannot be cached, if so. A first use and
        every later encode are judged alike: collectives, then what it read and wrote, then its encoder's input."""
        if encode.gate_run.kept_record is not None:
            self.state.note_recorded()
        if refusal is None and encode.observation is not None and encode.observation.collectives:
            refusal = collectives_refusal(encode.observation.collectives)
        grew = False
        if refusal is None:
            grew, refusal = self.state.learn(encode.trace, encode.result)
        if refusal is None and type(encode.gate_run.record) is Bypass:
            refusal = unprovable_refusal(encode.gate_run.record)
        return grew, refusal

    def encode_traced(self, args: tuple, kwargs: dict, *, rows: bool = False) -> tuple[Any, Trace, GateRun]:
        """Encode, seeing what the call reads from and writes to the pipeline and what reaches its first text
        encoder (the returned :class:`~.encoder_inputs.GateRun`); raise :class:`Learned` when that is more than
        earlier calls showed (the call's key lacked it) or cannot be cached, with what it decided."""
        return self._judged(self._encode(args, kwargs), rows=rows, in_flight=True)

    def _judged(self, encode: Encode, *, rows: bool, in_flight: bool) -> tuple[Any, Trace, GateRun]:
        """Judge an encode past the method's first use (see :meth:`encode_traced`); ``in_flight``: it computes a
        store flight's value (a proof's encode does not)."""
        state = self.state
        result, trace, gate_run = encode.result, encode.trace, encode.gate_run
        if gate_run.proven:  # the method's own code swallowed the Proven: the run's trace and result are no encode's
            return result, trace, gate_run
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
            raise Learned(result, trace, refusal, gate_run.kept_record, verdict)
        if grew and in_flight:  # a row: kept, then moved to a key holding what it read (keep_rows), no file
            self.store.withhold_write_through()
        gate_run.grew = grew
        return result, trace, gate_run

    def prove(
        self, args: tuple, kwargs: dict, found: CallKey, record: str, *, rows: bool = False
    ) -> tuple[Any, Unproven | None]:
        """Run the call up to its first text-encoder call and compare what would reach the encoder with
        ``record``, what reached it when the entry under ``found`` was made. Return ``(value, None)`` when equal,
        or when an entry made with the input it has now is found (``value`` is that entry's; None: the one
        compared): the run stopped there, before the encoder. Otherwise the call ran on through the encoder, as
        a miss does, and is judged as one: ``(None, Unproven)``, its result, what to keep of it and what it decided
        (see :mod:`.encoder_inputs`)."""
        try:
            try:
                encode = self._encode(args, kwargs, expected=record, alternative=self._alternative(found))
            except Refuted:  # its encoders wait off the device: encoded again, placed, as a miss is
                encode = self._encode(args, kwargs)
            result, trace, gate_run = self._judged(encode, rows=rows, in_flight=False)
            gate_run.expected = record
        except Proven as proven:
            return proven.args[0] if proven.args else None, None
        except Learned as learned:  # it read or wrote what the key does not hold: served, not kept
            return None, Unproven(learned.result, None, None, learned.reason or LEARNED_REASON, learned.verdict)
        if gate_run.proven:  # proven, but the method's own code swallowed the Proven and went on
            return gate_run.beside, None
        # A run whose key grew read state this key lacks: served, not kept beside under it.
        return None, Unproven(result, None if gate_run.grew else trace, gate_run.kept_record, gate_run.why_unproven)

    def _alternative(self, found: CallKey) -> Callable[[str], tuple[bool, Any]]:
        """Return the look-up of the entry kept beside ``found``'s for another encoder input (not counted)."""
        return lambda record: self.store.peek(with_encoder_input(found, record), self.method)

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
        key, value = self._entry(args, kwargs, arguments, result, trace, encode.gate_run.kept_record)
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
