"""How a wrapped method earns the cache's trust, and what its calls taught it.

A method's first call (for a method found by watching, or wherever several ranks run) is served
uncached and observed (:meth:`FirstUse._learn`); every encode after is traced
(:meth:`FirstUse.encode_traced`), and what it read beyond the method's key grows the key. A call whose
key grew is kept under the grown key, never under the one it was looked up with. Every encode records
what reached its first text encoder, and a hit of an entry with a record is proven against it before it is served
(:meth:`FirstUse.prove`, see :mod:`.encoder_inputs`). The first hit of an inferred key is encoded again
and compared (:meth:`FirstUse.first_hit_check`). ``FirstUse`` is
mixed into :class:`~.method_calls.MethodCalls`, whose attributes it uses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from vllm_omni_prompt_cache.counters import Outcome, tally
from vllm_omni_prompt_cache.discovery import observed
from vllm_omni_prompt_cache.encoder_inputs import GateRun, Proven, Refuted, seal, with_encoder_input
from vllm_omni_prompt_cache.flights import Ticket
from vllm_omni_prompt_cache.keys import Bypass, CallKey
from vllm_omni_prompt_cache.proofs import LayoutProof, compare_outputs
from vllm_omni_prompt_cache.reads import CannotTrace, Trace, current_attribute, is_absent, pack, traced
from vllm_omni_prompt_cache.residency import PLACEMENT_ATTRIBUTE
from vllm_omni_prompt_cache.values import unaliased

#: Bypass reason for a row call whose encode read or wrote pipeline state earlier calls had not.
LEARNED_REASON = "its encode read or wrote pipeline state no earlier call had: served whole and uncached"


class Learned(BaseException):
    """Raised out of an encode that read or wrote more than the method's key holds (or cannot be cached):
    its result must not be kept under the key the call was looked up with. A BaseException, so that no
    handler of encoder failures takes it for one. ``record``: what reached its text encoder."""

    def __init__(self, result: Any, trace: Trace, refusal: str | None, record: str | None = None) -> None:
        super().__init__(refusal or LEARNED_REASON)
        self.result, self.trace, self.reason, self.record = result, trace, refusal, record


class Unproven(NamedTuple):
    """A call that found an entry it could not be proven equal to: it encoded instead."""

    result: Any  # what the call returns: its own encode
    trace: Trace | None  # what that encode read and wrote; None: not to be kept (its key lacked state)
    record: str | None  # what reached its text encoder, for the entry that replaces the old one
    reason: str  # why the entry was not served (see encoder_inputs)


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
    """First use, learning and refusal of one wrapped method (mixed into the wrapper's method server)."""

    def keep_rows(
        self,
        arguments: list[Mapping[str, Any]],
        served_under: list[CallKey],
        values: list[Any],
        host_views: Mapping[int, Any] | None = None,
    ) -> None:
        """Move rows served while the method's key grew to the keys that hold the state they read (their
        encodes write nothing, so that state is the state now); no later lookup builds their old keys."""
        held = self.state.state_argument(self.instance)
        if type(held) is Bypass:
            return
        for row_arguments, old, value in zip(arguments, served_under, values, strict=True):
            new = self.key_builder.build_from_arguments(row_arguments, held=held, row=True, host_views=host_views)
            if type(new) is not Bypass:
                self.store.rekey(old, new, value)

    def encode_traced(
        self,
        args: tuple,
        kwargs: dict,
        *,
        rows: bool = False,
        expected: str | None = None,
        alternative: Callable[[str], tuple[bool, Any]] | None = None,
    ) -> tuple[Any, Trace, GateRun]:
        """Encode, seeing what the call reads from and writes to the pipeline and what reaches its first text
        encoder (the returned :class:`~.encoder_inputs.GateRun`); raise :class:`Learned` when that is more than
        earlier calls showed (the call's key lacked it) or cannot be cached.

        ``expected``: an entry's encoder-input record, for a proof run (see :meth:`prove`): the original runs
        unplaced and raises :class:`~.encoder_inputs.Proven` when what reaches the encoder equals it, or when
        ``alternative`` finds an entry made with what reaches it (the Proven carries that entry's value)."""
        state, gate = self.state, self.gate
        encode_fn = self.encode_fn if expected is None else self.original
        placed = expected is not None and getattr(self.pipeline, PLACEMENT_ATTRIBUTE, None) is not None
        with gate.run(expected, abort_on_refute=placed) as gate_run:
            gate_run.on_refute, gate_run.alternative = self.note_encoded, alternative
            if not state.observed:  # the first encode: which collectives run (a hit would skip them on one rank)
                with observed(self.pipeline) as observation, traced(self.instance) as trace:
                    gate_run.trace = trace
                    result = encode_fn(*args, **kwargs)
                state.note_observed()
                if observation.collectives:
                    self._refuse(collectives_refusal(observation.collectives))
                    raise Learned(result, trace, state.refusal)
            else:
                with traced(self.instance) as trace:
                    gate_run.trace = trace
                    result = encode_fn(*args, **kwargs)
        if gate_run.proven:  # the method's own code swallowed the Proven: the run's trace and result are no encode's
            return result, trace, gate_run
        if gate_run.kept_record is not None:
            state.note_recorded()
        # Writes another call learned meanwhile count as this one's: it is then served, not kept (the safe side).
        writes_before = len(state.writes)
        grew, refusal = state.learn(trace, result)
        if refusal is None and type(gate_run.record) is Bypass:
            refusal = unprovable_refusal(gate_run.record)
        if refusal is not None:
            self._refuse(refusal)
        if len(state.writes) > writes_before:  # its calls write state: rows are off from the next call
            self.choose_strategy()
        if refusal is not None or (grew and not rows) or len(state.writes) > writes_before:
            raise Learned(result, trace, refusal, gate_run.kept_record)
        if grew and expected is None:  # a row: kept, and moved to a key holding what it read (keep_rows), no file
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
        a miss does: ``(None, its result and what to keep of it)`` (see :mod:`.encoder_inputs`)."""
        try:
            try:
                result, trace, gate_run = self.encode_traced(
                    args, kwargs, rows=rows, expected=record, alternative=self._alternative(found)
                )
            except Refuted:  # its encoders wait off the device: encoded again, placed, as a miss is
                result, trace, gate_run = self.encode_traced(args, kwargs, rows=rows)
                gate_run.expected = record
        except Proven as proven:
            return proven.args[0] if proven.args else None, None
        except Learned as learned:  # it read or wrote what the key does not hold: served, not kept
            return None, Unproven(learned.result, None, None, learned.reason or LEARNED_REASON)
        if gate_run.proven:  # proven, but the method's own code swallowed the Proven and went on
            return gate_run.beside, None
        # A run whose key grew read state this key lacks: served, not kept beside under it.
        return None, Unproven(result, None if gate_run.grew else trace, gate_run.kept_record, gate_run.why_unproven)

    def _alternative(self, found: CallKey) -> Callable[[str], tuple[bool, Any]]:
        """Return the look-up of the entry kept beside ``found``'s for another encoder input (not counted)."""
        return lambda record: self.store.peek(with_encoder_input(found, record), self.method)

    def note_encoded(self) -> None:
        """Note that the current call ran the text encoder (a proof run that went on through it)."""
        self.host.inside.encoded = True

    def keep_learned(
        self, args: tuple, kwargs: dict, arguments: dict[str, Any], learned: Learned, made_under: Ticket
    ) -> Any:
        """Keep a whole call's result under the key its grown state gives it (the values before it ran), unless a
        clear() came since ``made_under`` was the store's ticket (before it encoded)."""
        state = self.state
        if state.refusal is None and self.key_builder.precomputed(arguments) is None:
            held = state.state_argument_before(learned.trace, self.instance)
            key = self.key_builder.build_from_arguments(arguments, held=held)
            if type(key) is not Bypass:
                kept = pack(unaliased(learned.result, (args, kwargs)), self.state.replayed(learned.trace))
                self.store.keep(key, seal(kept, learned.record), made_under)
        self._rows_off()
        return learned.result

    def _rows_off(self) -> None:
        """Key this method's calls whole: its calls read or write pipeline state that rows cannot split."""
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

    def _learn(self, args: tuple, kwargs: dict, arguments: dict[str, Any]) -> Any:
        """Serve a method's first call uncached and watch it: what it reads and writes, which modules and
        collectives it runs; keep its result if it may be cached, else say why not (see :mod:`.discovery`)."""
        state, pipeline = self.state, self.pipeline
        precomputed = self.key_builder.precomputed(arguments)
        if precomputed is not None:  # a pass-through teaches nothing
            return self.uncached(args, kwargs, tally(Outcome.BYPASS, reason=precomputed.reason))
        before = self.key_builder.build_from_arguments(arguments)
        if type(before) is Bypass:
            if state.inferred:
                return self._not_an_encode(args, kwargs, f"its arguments cannot be keyed ({before.reason})")
            return self.uncached(args, kwargs, tally(Outcome.BYPASS, reason=before.reason))
        made_under = self.store.ticket()  # a clear() while it encodes (a component replaced, say) voids its entry
        try:
            with self.gate.run() as gate_run, observed(pipeline) as observation, traced(self.instance) as trace:
                gate_run.trace = trace
                result = self.encode_fn(*args, **kwargs)
        except CannotTrace as error:
            self._refuse(str(error))
            return self.uncached(args, kwargs, tally(Outcome.BYPASS, reason=str(error)))
        if state.inferred:
            others = observation.other_modules()
            why = "it returns nothing" if result is None else f"it also runs {', '.join(others)}" if others else None
            if why is not None:
                self.host.reject(self.method, why)
                return result
            if not observation.encoders:  # this call encoded nothing: learn from a later one
                return result
        after = self.key_builder.build_from_arguments(arguments)
        refusal = None
        if type(after) is Bypass or after.identity != before.identity:
            refusal = "it changes its arguments in place, which a hit could not repeat"
        elif observation.collectives:
            refusal = collectives_refusal(observation.collectives)
        refusal = refusal or state.learn(trace, result)[1]
        if refusal is None and type(gate_run.record) is Bypass:
            refusal = unprovable_refusal(gate_run.record)
        if refusal is not None:
            self._refuse(refusal)
            self.count(tally(Outcome.BYPASS, reason=refusal))
            return result
        # Calls that learn at once each keep their encode; the one that ends the first use confirms it.
        ended = state.finish_learning(check=state.inferred or bool(state.data) or bool(state.writes))
        self._rows_off()
        if ended:
            self.host.confirmed(state)
        held = state.state_argument_before(trace, self.instance)
        key = self.key_builder.build_from_arguments(arguments, held=held)
        if type(key) is Bypass:
            self.count(tally(Outcome.BYPASS, reason=key.reason))
            return result
        if gate_run.kept_record is not None:
            state.note_recorded()
        value = seal(pack(unaliased(result, (args, kwargs)), state.replayed(trace)), gate_run.kept_record)

        counted: list[Outcome] = []

        def count(outcome: Outcome, reason: str | None) -> None:
            counted.append(outcome)
            self.count(tally(outcome, reason=reason))

        self.store.serve(key, lambda: value, count, self.method, made_under)
        if not counted:  # the store held the key already; this call encoded all the same: a miss
            self.count(tally(Outcome.MISS))
        return result

    def first_hit_check(self, args: tuple, kwargs: dict, served: Any, before: Mapping[str, Any]) -> Any:
        """Encode the first hit of a method whose key was inferred again, and compare output and writes;
        a difference serves the fresh encode and stops caching the method. Counted as an audit. ``before``:
        what the attributes the hit replayed held before it did (the encode runs on that state, as the call's)."""
        state = self.state
        if not state.take_check():
            return served
        replayed = {name: current_attribute(self.instance, name) for name in state.writes}
        for name, value in before.items():
            if is_absent(value):
                with contextlib.suppress(AttributeError):
                    delattr(self.instance, name)
            else:
                setattr(self.instance, name, value)
        try:
            fresh, trace, _ = self.encode_traced(args, kwargs)
        except Learned as learned:
            fresh, trace = learned.result, learned.trace
        why = compare_outputs(served, fresh)[0]
        for name, written in state.replayed(trace).items():
            if why is None and (differs := compare_outputs(replayed.get(name), written)[0]) is not None:
                why = f"self.{name}: {differs}"
        self.store.record_audit(mismatch=why is not None, method=self.method)
        if why is None:
            for name, value in replayed.items():  # the pipeline holds what the hit replayed, as on any hit
                setattr(self.instance, name, value)
            return served
        self._refuse(f"its first hit differed from an uncached call ({why})")
        return fresh

    def _not_an_encode(self, args: tuple, kwargs: dict, why: str) -> Any:
        """Unwrap a candidate found by watching that is not an encode; run it so the methods it calls are seen."""
        host = self.host
        host.reject(self.method, why)
        host.inside.active = False
        try:
            return self.encode_fn(*args, **kwargs)
        finally:
            host.inside.active = True

    def _refuse(self, why: str) -> None:
        self.host.refused(self.state, why)
