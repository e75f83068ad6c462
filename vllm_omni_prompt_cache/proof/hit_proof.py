"""The proof of a hit: the call run again with each text-encoder call answered by its stand-in, compared with what
the entry's encode did (see :mod:`.encoder_gate`); and the reference run that completes that record after every
encode. A call not proven is encoded as a miss is, by the method's :class:`~.first_use.FirstUse`. A proven hit runs
here and in the modules below, never in :mod:`.first_use`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from vllm_omni_prompt_cache.encoders.residency import PLACEMENT_ATTRIBUTE
from vllm_omni_prompt_cache.keys.call_key import Bypass, CallKey, result_digest, with_encoder_input
from vllm_omni_prompt_cache.keys.reads import Snapshot, Trace, refill, traced
from vllm_omni_prompt_cache.logs import logger
from vllm_omni_prompt_cache.proof.encoder_gate import (
    DIFFERED_AFTER,
    NO_RECORD,
    UNRECORDED,
    Record,
    Refuted,
    parse,
)
from vllm_omni_prompt_cache.proof.stand_ins import Draws, ProofGuard
from vllm_omni_prompt_cache.proof.verdicts import (
    LEARNED_REASON,
    LEFT_BEHIND,
    NO_VERDICT,
    Encode,
    Learned,
    Unproven,
    drawing_refusal,
)


class HitProof:
    """Proves the hits of one wrapped method, and runs the reference run of each of its encodes; what is not proven
    is encoded by ``first_use``, the method's."""

    def __init__(self, first_use: Any) -> None:
        self.first_use = first_use  # a FirstUse: the encodes a proof falls back to, and the method's parts

    def prove(
        self, args: tuple, kwargs: dict, found: CallKey, record: str, *, rows: bool = False
    ) -> tuple[Any, Unproven | None]:
        """Run the call with each text-encoder call answered by its stand-in, and compare what reaches each call and
        what the run returns with ``record``, what the encode of the entry under ``found`` did. Return ``(value,
        None)`` when all are equal (``value``: the entry kept beside ``found``'s that was proven instead, or None:
        the one compared); no encoder ran, and the instance is as it was at the first encoder call. Otherwise the
        call was encoded, as a miss is, and judged as one: ``(None, Unproven)``, its result, what to keep of it and
        what it decided (see :mod:`.encoder_gate`)."""
        first_use = self.first_use
        expected = parse(record) if record != NO_RECORD else None
        main_input = expected.calls[0].inputs if expected is not None and expected.calls else None
        placed = getattr(first_use.pipeline, PLACEMENT_ATTRIBUTE, None) is not None
        guard = ProofGuard()
        # What a later run starts from (its reference run, an encode instead): the instance (the trace's ``before``),
        # and the arguments as the caller gave them (an encode may change them in place: vLLM-Omni's Z-Image templates
        # its prompt list).
        given = copied(args, kwargs)
        gate_run = trace = None
        try:
            with (
                guard,
                first_use.gate.run(expected or Record((), ""), abort_on_refute=placed, guard=guard) as gate_run,
            ):
                gate_run.on_refute, gate_run.alternative = first_use.note_encoded, self._alternative(found)
                with traced(first_use.instance, proof_run=True) as trace:
                    gate_run.trace = trace
                    result = first_use.original(*args, **kwargs)
        except Refuted:  # stand-ins were handed out, or its encoders wait off the device: encoded again
            assert gate_run is not None and trace is not None  # raised by the run's encoder calls
            return None, self._again(trace, args, kwargs, given, gate_run.why_unproven, rows, main_input)
        except Draws as draws:
            return None, self._drew(trace, str(draws), args, kwargs, given)
        except Exception as error:
            if gate_run is None or trace is None or not gate_run.calls or gate_run.went_on:
                raise  # before any stand-in: raised as the uncached call would
            why = f"its proof run raised {type(error).__qualname__}"  # on stand-in data: encoded again
            return None, self._again(trace, args, kwargs, given, why, rows, main_input)
        if gate_run.went_on:  # its first encoder input differed: the run went on through the encoder, a miss's
            encode = Encode(result, trace, gate_run, None)
            assert trace.before is not None
            self.reference(*given, encode, trace.before)
            why = UNRECORDED if expected is None and gate_run.unreadable is None else gate_run.why_unproven
            return None, self._unproven(encode, rows, why, main_input)
        if guard.draw is not None:  # a draw the run's own code caught
            return None, self._drew(trace, guard.draw, args, kwargs, given)
        if gate_run.differed is not None:  # a Refuted the run's own code caught
            return None, self._again(trace, args, kwargs, given, gate_run.why_unproven, rows, main_input)
        if not gate_run.calls:  # it reached no encoder: its own result is served
            return None, Unproven(result, None, None, gate_run.why_unproven)
        trace.undo_after_encoder(release=True)  # first: what it wrote on the instance a hit replays
        left = guard.left_behind(result)  # before the caller's arguments are refilled: what they kept counts
        put_back(args, kwargs, given)
        assert gate_run.expected is not None
        complete = len(gate_run.calls) == len(gate_run.expected.calls)
        if complete and result_digest(result) == gate_run.expected.result:
            if left:
                verdict = first_use.refusal(LEFT_BEHIND)
                return None, Unproven(first_use.encode_fn(*args, **kwargs), None, None, LEFT_BEHIND, verdict)
            return gate_run.beside, None
        return None, self._encoded_again(args, kwargs, DIFFERED_AFTER, rows, main_input)

    def _again(
        self,
        trace: Trace,
        args: tuple,
        kwargs: dict,
        given: tuple[tuple, dict],
        reason: str,
        rows: bool,
        main_input: str | None,
    ) -> Unproven:
        """Put back what a stopped proof run changed (the instance after its encoder call, the caller's arguments) and
        encode the call as a miss."""
        trace.undo_after_encoder()
        put_back(args, kwargs, given)
        return self._encoded_again(args, kwargs, reason, rows, main_input)

    def _drew(self, trace: Trace | None, draw: str, args: tuple, kwargs: dict, given: tuple[tuple, dict]) -> Unproven:
        """Refuse a method whose proof run drew random numbers (undone); encode the call uncached, as given."""
        if trace is not None:
            trace.undo_after_encoder()
        put_back(args, kwargs, given)
        why = drawing_refusal(draw)
        verdict = self.first_use.refusal(why)
        return Unproven(self.first_use.encode_fn(*args, **kwargs), None, None, why, verdict)

    def _encoded_again(self, args: tuple, kwargs: dict, reason: str, rows: bool, main_input: str | None) -> Unproven:
        """Encode a call whose proof run was answered by stand-ins and did not prove it, as a miss."""
        return self._unproven(self.first_use._encode(args, kwargs), rows, reason, main_input)

    def _unproven(self, encode: Encode, rows: bool, reason: str, main_input: str | None) -> Unproven:
        """Judge an encode made instead of a hit as a miss is judged; return what the call serves and keeps."""
        try:
            result, trace, gate_run = self.first_use._judged(encode, rows=rows, in_flight=False)
        except Learned as learned:  # it read or wrote what the key does not hold: served, not kept
            return Unproven(learned.result, None, None, learned.reason or LEARNED_REASON, learned.verdict)
        first = gate_run.first_input if type(gate_run.first_input) is str else None
        # A run whose key grew read state this key lacks: served, not kept beside under it.
        kept = None if gate_run.grew or gate_run.whole is None else trace
        return Unproven(result, kept, gate_run.whole, reason, NO_VERDICT, None if first == main_input else first)

    def _alternative(self, found: CallKey) -> Callable[[str], tuple[bool, Any]]:
        """Return the look-up of the entry kept beside ``found``'s for another first encoder input (not counted)."""
        return lambda first_input: self.first_use.store.peek(
            with_encoder_input(found, first_input), self.first_use.method
        )

    def reference(self, args: tuple, kwargs: dict, encode: Encode, before: Snapshot) -> None:
        """Complete the record of a real encode: run the method once more on the state it started from, each encoder
        call answered by its stand-in, and keep the digest of what it returns (see :mod:`.encoder_gate`).
        ``before``: the instance before the encode (what it wrote and changed in place is undone for the run); it is
        left as the encode left it. Sets ``gate_run.whole``, or ``gate_run.unprovable`` with why no hit
        of this method could be proven."""
        first_use = self.first_use
        gate_run = encode.gate_run
        recorded = gate_run.recorded
        if recorded is None:
            return
        touched = touched_by(encode.trace)
        after = Snapshot(first_use.instance)
        before.restore(names=touched)
        guard = ProofGuard()
        result: Any = None
        why = None
        again = Trace(first_use.instance)
        run_args, run_kwargs = copied(args, kwargs)  # ``args`` stay as the caller gave them
        try:
            with (
                guard,
                first_use.gate.run(recorded, reference=True, guard=guard) as reference,
                traced(first_use.instance) as again,
            ):
                again.setters_from_start, reference.trace = True, again
                result = first_use.original(*run_args, **run_kwargs)
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
            logger.debug("Prompt-embed cache: the reference run of %s raised.", first_use.method, exc_info=True)
        finally:
            again.undo_setters()
            touched |= touched_by(again)
            again.release()
            after.restore(names=touched)
        if why is None and guard.draw is not None:  # drawn and caught by the run's own code
            why = drawing_refusal(guard.draw)
        digest = result_digest(result) if why is None else None
        if type(digest) is Bypass:
            why = f"what its encode returns cannot be compared ({digest.reason})"
        del run_args, run_kwargs
        if guard.left_behind(result):
            # Stand-in data stayed where the cache cannot put it back: the real encode writes it over, once.
            why = why or LEFT_BEHIND
            with contextlib.suppress(Exception):  # the call was served already: this is the cache's own repair
                again_args, again_kwargs = copied(args, kwargs)
                first_use.encode_fn(*again_args, **again_kwargs)
        if why is not None:
            gate_run.unprovable = why
        else:
            gate_run.whole = Record(recorded.calls, digest).spell()


def copied(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Return the call's arguments with every list, dict, tuple and set in them copied (what they hold is shared)."""
    return _containers_copied(args), _containers_copied(kwargs)


def put_back(args: tuple, kwargs: dict, given: tuple[tuple, dict]) -> None:
    """Refill the caller's lists, dicts and sets among ``args`` and ``kwargs`` with what they held when given (their
    copies in ``given``): what a proof run wrote into them may be stand-in data."""
    for now, then in ((args, given[0]), (kwargs, given[1])):
        for key in range(len(now)) if isinstance(now, tuple) else now:
            if type(now[key]) in (list, dict, set):
                refill(now[key], then[key])


def _containers_copied(value: Any, depth: int = 0) -> Any:
    if depth > 32:
        return value
    if type(value) in (list, tuple, set):
        return type(value)(_containers_copied(item, depth + 1) for item in value)
    if type(value) is dict:
        return {key: _containers_copied(item, depth + 1) for key, item in value.items()}
    return value


def touched_by(trace: Trace) -> set[str]:
    """Return the instance attributes a traced call read or wrote (what its runs may have changed)."""
    return {*trace.reads, *trace.writes, *trace.overwritten, *trace.read_identities}
