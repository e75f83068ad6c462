"""Strategy: each row of a batched call served from an entry of its own under a row layout (see
:mod:`~vllm_omni_prompt_cache.rows.layout`), checked against the uncached call on first use; the call's output
assembled from the rows. The front (:class:`~.method_calls.MethodCalls`) chooses it and hands it each call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from vllm_omni_prompt_cache.calls.found import (
    LAYOUT_DROPPED_REASON,
    ROW_FOUND,
    UNSTACKABLE_REASON,
    Found,
    kept_under,
    transient,
)
from vllm_omni_prompt_cache.calls.row_batches import RowTally, serve_rows
from vllm_omni_prompt_cache.counts.counters import (
    Outcome,
    tally,
)
from vllm_omni_prompt_cache.keys.call_key import Bypass, CallKey, ReadCall, seal, unseal
from vllm_omni_prompt_cache.proof.encoder_gate import NO_RECORD, NOT_REACHED
from vllm_omni_prompt_cache.rows.layout import LayoutMismatch, RowLayout, RowSplit, SingleRow, UnstackableRows
from vllm_omni_prompt_cache.rows.layout_proofs import compare_outputs, row_strength
from vllm_omni_prompt_cache.store.flights import Ticket
from vllm_omni_prompt_cache.store.values import unaliased


class RowCalls:
    """Strategy: each distinct row of a call served from the cache or one encode of it alone under ``layout``,
    the call's output assembled from them. A call that goes beyond what checks have proven the layout for
    is served from the uncached call and compared with its assembled rows (:meth:`check`)."""

    def __init__(self, calls: Any, layout: RowLayout) -> None:  # calls: the front, a MethodCalls
        self.calls = calls
        self.layout = layout

    def serve(self, args: tuple, kwargs: dict, call: ReadCall) -> Any:
        """Serve a call past its method's first use, as :meth:`CallKeyBuilder.read` found it."""
        calls, layout = self.calls, self.layout
        arguments, held = call.arguments, call.held
        try:
            single = layout.single_row_key(arguments)
            split = None
            if single is None or (single.text and not calls.proof.trusted):
                split = layout.split(arguments)
        except Exception as error:  # hostile arguments: reading them as rows must not fail the call
            why = f"rows could not be read: {type(error).__qualname__} raised"
            return calls.whole.call(args, kwargs, arguments, why=why, held=held)
        # A prompt's row is shared by its forms ("a" and ["a"]), which a layout the class does not vouch
        # for must have passed a check on before one is served for the other.
        if single is not None and (
            split is None or (type(split) is RowSplit and calls.proof.has_checked(layout, split))
        ):
            return self._single_row(args, kwargs, single, held)
        if type(split) is not RowSplit:
            rows = layout.batch_size(arguments)
            return calls.whole.call(args, kwargs, arguments, rows=rows, why=split, held=held)
        keys = self._row_keys(split, held)
        if type(keys) is Bypass:  # a shared argument no key can hold: no row can be keyed
            return calls.uncached(args, kwargs, tally(Outcome.BYPASS, reason=keys.reason, rows_encoded=split.batch))
        return self._by_rows(split, keys, args, kwargs)

    def _single_row(self, args: tuple, kwargs: dict, single: SingleRow, held: tuple | None) -> Any:
        """Serve a call that is its own only row, keyed as :meth:`RowLayout.single_row_key` reads it."""
        calls = self.calls
        key = calls.key_builder.build_from_arguments(
            single.arguments, held=held, row=True, host_views=single.host_views
        )
        if type(key) is Bypass:
            return calls.uncached(args, kwargs, tally(Outcome.BYPASS, reason=key.reason, rows_encoded=1))
        known = len(calls.state.data)
        encoded: list[bool] = []

        def encode() -> Any:
            encoded.append(True)
            return self._encode_to_keep(args, kwargs, self.layout.check_row)

        made_under = calls.lookups.ticket
        try:
            value = calls.lookups.serve(key, encode, self._count_row, calls.method)
            if len(calls.state.data) > known:  # its encode read more state: keep it under the key that holds it
                self.keep_rows([single.arguments], [key], [value], made_under, single.host_views)
            if encoded:
                return unseal(value)[0]
            return calls.serve_found(args, kwargs, Found(key, value, ROW_FOUND, made_under), row=self.layout.check_row)
        except LayoutMismatch as error:  # the row was not stored; serve the call whole and uncached
            calls.refute(self.layout, str(error))
            return calls.uncached(args, kwargs, tally(whole_call=LAYOUT_DROPPED_REASON, rows_encoded=1))

    def keep_rows(
        self,
        arguments: list[Mapping[str, Any]],
        served_under: list[CallKey],
        values: list[Any],
        made_under: Ticket,
        host_views: Mapping[int, Any] | None = None,
    ) -> None:
        """Move rows served while the method's key grew to the keys that hold the state they read (their
        encodes write nothing, so that state is the state now); no later lookup builds their old keys. Not kept
        if a clear() came since ``made_under``, the store's ticket before they were looked up (their encoder
        may have been replaced meanwhile)."""
        calls = self.calls
        held = calls.state.state_argument(calls.instance)
        if type(held) is Bypass:
            return
        for row_arguments, old, value in zip(arguments, served_under, values, strict=True):
            new = calls.key_builder.build_from_arguments(row_arguments, held=held, row=True, host_views=host_views)
            if type(new) is not Bypass:
                calls.store.rekey(old, new, value, made_under, calls.method)

    def _count_row(self, outcome: Outcome, reason: str | None) -> None:
        """Count a call that is one row, missed or bypassed, as a call and as a row (a hit counts once it is
        proven: serve_found)."""
        self.calls.count(
            tally(
                outcome,
                reason=reason,
                rows_missed=int(outcome is Outcome.MISS),
                row_reasons=None if reason is None else {reason: 1},
                rows_encoded=1,
            )
        )

    def _by_rows(self, split: RowSplit, keys: list[CallKey], args: tuple, kwargs: dict) -> Any:
        """Serve each distinct row from the cache or one encode of it alone; assemble the call's output."""
        calls, layout = self.calls, self.layout
        rows = RowTally()
        call = Outcome.MISS  # unless every row was served without encoding and the output assembles
        dropped = tally(whole_call=LAYOUT_DROPPED_REASON, rows_encoded=split.batch)  # then served uncached
        known = len(calls.state.data)
        encoded: set[int] = set()
        made_under = calls.lookups.ticket  # rows moved to grown keys are not kept across a clear() since
        try:
            try:
                values = serve_rows(calls.lookups, keys, self._row_encoder(split, encoded), rows, calls.method)
                if len(calls.state.data) > known:  # a row's encode read more state: keep them under keys holding it
                    served = [split.key_arguments(index) for index in range(split.batch)]
                    self.keep_rows(served, keys, values, made_under)
                values = self._proven_rows(split, keys, values, encoded, rows)
            except LayoutMismatch as error:
                calls.refute(layout, str(error))
                return calls.uncached(args, kwargs, dropped)
            except Exception as error:
                if calls.proof.trusted or calls.proof.has_checked(layout, split) or transient(error):
                    raise  # the encoder itself failed, as it would uncached
                # Rows cut by a layout no check has passed yet for such calls: the cut is the suspect.
                calls.refute(layout, f"its row calls raised {type(error).__qualname__}: {error}")
                return calls.uncached(args, kwargs, dropped)
            if not calls.proof.settled(layout, split):  # measuring what the rows exercise costs comparisons
                strength = row_strength(split, values)
                if calls.proof.needs_check(layout, split, strength):  # the check encodes the whole call
                    return self.check(split, values, strength, calls.encode_fn(*args, **kwargs))
            try:
                assembled = split.assemble(values)
            except UnstackableRows:
                return calls.uncached(args, kwargs, tally(whole_call=UNSTACKABLE_REASON, rows_encoded=split.batch))
            call = Outcome.MISS if rows.encoded else Outcome.HIT
            return assembled
        finally:  # the rows and the call, counted whatever happened (an encode or an assembly that raised too)
            calls.count(rows.counts(call))

    def check_inferred(self, arguments: dict[str, Any], output: Any, held: tuple | None) -> bool:
        """Return True when the rows of a missed call, encoded alone under this (inferred) layout, assemble to
        ``output``, the call's uncached output; the rows are kept and counted."""
        calls, layout = self.calls, self.layout
        split = layout.split(arguments)
        keys = None if type(split) is not RowSplit else self._row_keys(split, held)
        if keys is None or type(keys) is Bypass:
            calls.count(tally(whole_call="no row layout inferred: the call could not be split into rows"))
            return False
        rows = RowTally()
        try:
            values = serve_rows(calls.lookups, keys, self._row_encoder(split), rows, calls.method)
        except LayoutMismatch as error:
            calls.refute(layout, str(error), inferred=True)
            return False
        finally:
            calls.count(rows.counts(None))
        values = [unseal(value)[0] for value in values]  # compared with the uncached call, not served
        strength = row_strength(split, values)
        return self.check(split, values, strength, output, inferred=True) is not None

    def check(
        self, split: RowSplit, values: list[Any], strength: tuple, expected: Any, *, inferred: bool = False
    ) -> Any:
        """Compare ``expected`` (the uncached call) with the call's rows assembled; return ``expected``.

        A match proves the layout for calls like this one; a mismatch turns rows off for the class.
        For an inferred layout, returns None on a mismatch (the caller already holds ``expected``).
        """
        calls = self.calls
        try:
            why, gap = compare_outputs(split.assemble(values), expected)
        except UnstackableRows as error:
            why, gap = str(error), 0.0
        calls.store.record_layout_check(split.batch, None if why else gap, method=calls.method)
        if why is None:
            calls.proof.prove(self.layout, split, strength)
            return expected
        calls.refute(self.layout, why, inferred=inferred)
        return None if inferred else expected

    def _row_keys(self, split: RowSplit, held: tuple | None) -> list[CallKey] | Bypass:
        keys = []
        for index in range(split.batch):
            key = self.calls.key_builder.build_from_arguments(split.key_arguments(index), held=held, row=True)
            if type(key) is Bypass:
                return key
            keys.append(key)
        return keys

    def _row_encoder(self, split: RowSplit, encoded: set[int] | None = None) -> Callable[[int], Any]:
        """Return ``encode_row(i)``, which encodes row ``i`` alone (noting ``i`` in ``encoded``)."""

        def encode_row(index: int) -> Any:
            if encoded is not None:
                encoded.add(index)
            args, kwargs = row_call(self.calls.signature, split, index)
            return self._encode_to_keep(args, kwargs, split.check_row)

        return encode_row

    def _proven_rows(
        self, split: RowSplit, keys: list[CallKey], values: list[Any], encoded: set[int], rows: RowTally
    ) -> list[Any]:
        """Return what each row of a call is served: the rows it encoded as they are; every other distinct entry
        once proven (see :meth:`MethodCalls.serve_found`), or that row encoded alone instead."""
        served = {id(values[index]): unseal(values[index])[0] for index in encoded}
        assembled = []
        for index, value in enumerate(values):
            row = served.get(id(value))
            if row is None:
                row = served[id(value)] = self._proven_row(split, keys[index], index, value, rows)
            assembled.append(row)
        return assembled

    def _proven_row(self, split: RowSplit, key: CallKey, index: int, value: Any, rows: RowTally) -> Any:
        """Return row ``index``'s entry ``value`` once proven (or the entry kept beside it for the input that reaches
        the encoder now), else the row encoded alone, kept beside it."""
        row, record = unseal(value)
        if record is None and self.calls.state.recorded:
            record = NO_RECORD
        if record is None:
            rows.key_only += 1
            return row
        args, kwargs = row_call(self.calls.signature, split, index)
        made_under = self.calls.lookups.ticket
        beside, unproven = self.calls.first_use.hits.prove(args, kwargs, key, record, rows=True)
        if unproven is None:
            rows.proven += 1
            return row if beside is None else unseal(beside)[0]
        self.calls.settle(unproven.verdict)
        if unproven.reason == NOT_REACHED:  # it ran, but encoded nothing
            rows.hit -= 1
            rows.bypassed[NOT_REACHED] += 1
        else:
            rows.not_proven(unproven.reason)
        fresh = split.check_row(unaliased(unproven.result, (args, kwargs)))
        if (
            unproven.trace is not None and unproven.record is not None
        ):  # kept beside (or over) the entry it differed from
            self.calls.store.keep(kept_under(key, unproven), seal(fresh, unproven.record), made_under)
        return fresh

    def _encode_to_keep(self, args: tuple, kwargs: dict, check_row: Callable[[Any], Any]) -> Any:
        """Run the encoder for a row the cache keeps (keyed arguments only: bounded, acyclic), checked by
        ``check_row``; outputs that are the call's own input tensors are copied. Returns the entry's value."""
        # A row's encode that reads more state than the rows' keys hold is kept under those keys, which no
        # later lookup builds (the state's names are in every key); one that writes state raises Learned.
        result, _, gate_run = self.calls.first_use.encode_traced(args, kwargs, rows=True)
        return seal(check_row(unaliased(result, (args, kwargs))), gate_run.kept_record)


def row_call(signature: inspect.Signature, split: RowSplit, index: int) -> tuple[tuple, dict]:
    """Return the positional and keyword arguments of a call of row ``index`` alone."""
    bound = inspect.BoundArguments(signature, split.call_arguments(index))  # type: ignore[arg-type]
    return bound.args, bound.kwargs
