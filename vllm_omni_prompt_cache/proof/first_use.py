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
from vllm_omni_prompt_cache.keys.call_key import Bypass, CallKey, CallKeyBuilder, seal
from vllm_omni_prompt_cache.keys.method_state import MethodState, pack
from vllm_omni_prompt_cache.keys.reads import CannotTrace, Snapshot, Trace, current_attribute, is_absent, traced
from vllm_omni_prompt_cache.proof.discovery import observed
from vllm_omni_prompt_cache.proof.encoder_gate import (
    EncoderGate,
    GateRun,
)
from vllm_omni_prompt_cache.proof.hit_proof import HitProof, copied
from vllm_omni_prompt_cache.proof.verdicts import (
    NO_VERDICT,
    Encode,
    Learned,
    NotRun,
    Verdict,
    collectives_refusal,
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
        self.hits = HitProof(self)  # proves its hits (hit_proof.py: a proven hit enters no module above it)

    def refusal(self, why: str) -> Verdict:
        """Stop caching the method at once (the calls after bypass, and no encode ending after it is kept); the
        verdict says so, once."""
        return Verdict(refusal=why) if self.state.refuse(why) else NO_VERDICT

    def _encode(self, args: tuple, kwargs: dict, *, observe: bool | None = None) -> Encode:
        """Run the call traced (what it reads and writes on the instance) in a gate run (what reaches each of its text
        encoder calls), then once more with each encoder call answered by a stand-in, which completes the record an
        entry of it keeps (:meth:`reference`): a first use, every later encode, a proof that encodes. ``observe``:
        also watch which modules and collectives run (None: while no encode was watched; a hit would skip
        collectives on one rank)."""
        observe = not self.state.observed if observe is None else observe
        before, pristine = Snapshot(self.instance), copied(args, kwargs)  # what the reference run starts from
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
            self.hits.reference(*pristine, encode, before)
        return encode

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
