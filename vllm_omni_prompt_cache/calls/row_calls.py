"""How a batched text-encoder call is served row by row: each distinct row from its entry, the missing ones encoded
together as one sub-batch, the output reassembled.

Rows are cut where they reach the encoder (:mod:`.encoder_rows`), so every adapter's batch splits the same way,
whatever its encode does around the encoder. That a row's output does not depend on the rows beside it is shown
once per encoder, on its first batched call: served uncached (its rows counted in ``layout_check_rows``), its
distinct rows encoded alone, kept, and compared with it (``layout_checks``; a difference, ``layout_mismatches``, keys
that encoder's batched calls whole from then on). Each
row is claimed in the store like any key (hit, own its flight, join another call's flight, or encode it uncached
after a collision), so rows share entries, single-flight and verification with whole calls; a call encodes the rows
it owns before it waits for rows other calls are encoding, so two calls waiting on each other cannot deadlock.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_prompt_cache.calls.encoder_calls import (
    NOT_ROWS,
    ROWS_DEPEND,
    EncoderCalls,
    EncodeTally,
    Run,
    Site,
    _Unkept,
)
from vllm_omni_prompt_cache.encoders.forms import (
    ENTRY_TAG,
    Unkeepable,
    form_of,
    kept,
    row_form,
    spelled,
    splits,
    take_apart,
    whole,
)
from vllm_omni_prompt_cache.keys.call_key import Bypass, CallKey, value_key
from vllm_omni_prompt_cache.logs import logger
from vllm_omni_prompt_cache.rows.encoder_rows import batch_size, compare_outputs, rows_of
from vllm_omni_prompt_cache.store.audit import audited
from vllm_omni_prompt_cache.store.flights import Claim
from vllm_omni_prompt_cache.store.lookups import COLLISION_REASON

#: What a row of a call is spelled with in its key, after the module path: no argument encodes to it.
_ROW = ("row",)


class RowCalls:
    """Serves one pipeline's batched encoder calls row by row (see the module docstring)."""

    def __init__(self, calls: EncoderCalls) -> None:
        self.calls = calls
        self.lookups = calls.lookups

    def __call__(self, path: str, run: Run, args: tuple, kwargs: dict, state_key: tuple, method: str) -> Any:
        """Serve the call row by row; :data:`NOT_ROWS` when it is not rows (or its encoder's rows depend on each
        other), to be keyed whole."""
        calls = self.calls
        size = batch_size(args, kwargs)
        if size is None:
            return NOT_ROWS
        rows_site = calls.sites.get((path, "rows"))
        if rows_site is None:
            rows_site = calls.sites.setdefault((path, "rows"), Site())
        if rows_site.rows is False:
            calls.count(method, _whole_because_rows_depend)
            return NOT_ROWS
        keys: list[CallKey] = []
        with torch.inference_mode(False):
            for row in range(size):
                keyed = value_key((calls.tag, path, state_key, _ROW, *rows_of(args, kwargs, [row])), calls.digest)
                if type(keyed) is Bypass:
                    return NOT_ROWS
                keys.append(CallKey(*keyed))
        if rows_site.rows is None:
            firsts, _ = _distinct(keys)
            if not all(self.lookups.get(keys[row], method)[0] for row in firsts):
                return self._first(path, run, args, kwargs, size, keys, rows_site, method)
            # Every row is an entry already, which only a check of this encoder (in this process, or another of the
            # directory's namespace: the same code, configuration and weights) makes: the rows are shown.
            rows_site.rows = True
        try:
            return self._rows(path, run, args, kwargs, size, keys, method)
        except _Unkept:  # a sub-batch's output did not split: this encoder's calls are keyed whole from now on
            rows_site.rows = False
            return NOT_ROWS

    def _claims(self, keys: list[CallKey], firsts: list[int], method: str) -> tuple[dict, list, list, list]:
        """Claim each distinct row: return the rows found (by row), and those owned, joined and to encode uncached."""
        values: dict[int, tuple] = {}
        owned, joined, direct = [], [], []
        for row, (decision, claimed) in zip(
            firsts, self.lookups.claim([keys[row] for row in firsts], method), strict=True
        ):
            if decision is Claim.HIT:
                values[row] = claimed
            elif decision is Claim.OWN:
                owned.append((row, claimed))
            elif decision is Claim.JOIN:
                joined.append((row, claimed))
            else:
                direct.append(row)
        return values, owned, joined, direct

    def _rows(self, path: str, run: Run, args: tuple, kwargs: dict, size: int, keys: list[CallKey], method: str) -> Any:
        calls, lookups = self.calls, self.lookups
        firsts, copies = _distinct(keys)
        values, owned, joined, direct = self._claims(keys, firsts, method)
        fresh: dict[int, tuple] = {}  # rows this call encoded and offered to the store
        encoded = [0]
        hit = len(values) + len(copies)  # found, and rows repeating another of this call
        bypassed: list[str] = []

        def encode(row: int, remaining: list[int]) -> tuple:
            """Encode ``remaining`` (owned rows not served yet, ``row`` first) as one sub-batch, once."""
            if row not in fresh:
                output = run(*rows_of(args, kwargs, remaining))
                encoded[0] += len(remaining)
                form, leaves = take_apart(output)
                if not splits(form, len(remaining)):
                    raise _Unkept(output, "its output does not split into rows")
                one = row_form(form, 1)
                keep = calls.site(path, one).keep
                for position, each in enumerate(remaining):
                    cut = [leaf[position : position + 1] if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
                    fresh[each] = kept(one, cut, keep)
            return fresh[row]

        try:
            for position, (row, flight) in enumerate(owned):
                remaining = [later for later, _ in owned[position:] if later not in fresh]
                values[row], _ = lookups.complete(
                    keys[row], flight, lambda r=row, rest=remaining: encode(r, rest), method
                )
        except BaseException:
            lookups.abandon([(keys[row], flight) for row, flight in owned if row not in values])
            raise
        for row in direct:  # a digest collision: encoded alone, not kept
            values[row] = _alone(run, args, kwargs, row)
            encoded[0] += 1
            bypassed.append(COLLISION_REASON)
        for row, flight in joined:
            if flight.wait():
                values[row] = flight.value
                hit += 1
            else:  # its owner's call raised: encode it ourselves, alone
                values[row] = lookups.serve(keys[row], lambda r=row: _alone(run, args, kwargs, r), _uncounted, method)
                encoded[0] += 1
                fresh[row] = values[row]
        for row, first in copies:
            values[row] = values[first]
        made = [(keys[row], value) for row, value in fresh.items() if values.get(row) is value]
        for row, value in fresh.items():  # a sub-batch's rows that a lower tier served instead count as found
            hit += values.get(row) is not value
        missed = size - hit - len(bypassed)

        def update(tally_now: EncodeTally) -> None:
            tally_now.rows_hit += hit
            tally_now.rows_missed += missed
            tally_now.row_bypassed.update(bypassed)
            tally_now.rows_encoded += encoded[0]
            if encoded[0]:
                tally_now.encoded += 1
            else:
                tally_now.answered += 1

        calls.count(method, update)
        assembled = _assembled([values[row] for row in range(size)])
        output = calls.served(assembled, args, kwargs, run, path, None, method)
        audit = calls.store.audit
        if hit and audit is not None and audit.due():  # rows found: the batch encoded again and compared
            kind = type(calls.pipeline)
            return audited(calls.store, kind, calls.tag, output, assembled, lambda: run(args, kwargs), method)
        site = calls.site(path, form_of(values[0][1]))
        if made:  # what the encode reads of rows it encoded is what the site keeps
            return calls.read(output, form_of(assembled[1]), site, made, method)
        return output

    def _first(
        self,
        path: str,
        run: Run,
        args: tuple,
        kwargs: dict,
        size: int,
        keys: list[CallKey],
        rows_site: Site,
        method: str,
    ) -> Any:
        """The first batched call of an encoder: served uncached, its distinct rows encoded alone and compared."""
        calls = self.calls
        ticket = self.lookups.ticket  # a clear() meanwhile (a replaced encoder) voids the rows kept below
        output = run(args, kwargs)
        firsts, _ = _distinct(keys)
        try:
            form, leaves = take_apart(output)
        except Unkeepable:
            form, leaves = None, []
        why, gap = None, 0.0
        alone: dict[int, tuple] = {}
        if form is None or not splits(form, size):
            why = "its output does not split into rows"
        else:
            for row in firsts:
                alone[row] = take_apart(run(*rows_of(args, kwargs, [row])))
                mine = [leaf for leaf in alone[row][1] if isinstance(leaf, torch.Tensor)]
                expected = [leaf[row : row + 1] for leaf in leaves if isinstance(leaf, torch.Tensor)]
                why, measured = compare_outputs(mine, expected)
                gap = max(gap, measured)
                if why is not None:
                    break
        rows_site.rows = why is None
        calls.store.record_layout_check(size, gap if why is None else None, method=method)
        if why is not None:
            logger.warning(
                "Prompt-embed cache: %s.%s: a row of its batched calls differs when encoded alone (%s); its batched "
                "calls are keyed whole.",
                calls.tag,
                path,
                why,
            )
        made = []
        if why is None:
            for row in firsts:
                one_form, one_leaves = alone[row]
                keep = calls.site(path, one_form).keep
                value = kept(one_form, one_leaves, keep)
                self.lookups.put(keys[row], value, method, ticket)
                made.append((keys[row], value))

        def update(tally_now: EncodeTally) -> None:
            # The batch, served uncached, is the check (layout_check_rows); the rows kept are those encoded alone.
            tally_now.encoded += 1
            tally_now.rows_missed += len(firsts)
            tally_now.rows_hit += size - len(firsts)
            tally_now.rows_encoded += len(alone)

        calls.count(method, update)
        if form is None:
            return output
        return calls.read(output, form, calls.site(path, row_form(form, 1)), made, method)


def _whole_because_rows_depend(tally_now: EncodeTally) -> None:
    tally_now.whole = ROWS_DEPEND


def _uncounted(outcome: Any, reason: str | None) -> None:
    return None


def _alone(run: Run, args: tuple, kwargs: dict, row: int) -> tuple:
    form, leaves = take_apart(run(*rows_of(args, kwargs, [row])))
    return kept(form, leaves, None)


def _distinct(keys: list[CallKey]) -> tuple[list[int], list[tuple[int, int]]]:
    """Return the first row of each distinct key (identity and bytes), and ``(row, first row with its key)``."""
    firsts: list[int] = []
    copies: list[tuple[int, int]] = []
    seen: dict[tuple, int] = {}
    for row, key in enumerate(keys):
        spelled = (key.identity, tuple(bytes(part) for part in key.witness))
        first = seen.get(spelled)
        if first is None:
            seen[spelled] = row
            firsts.append(row)
        else:
            copies.append((row, first))
    return firsts, copies


def _assembled(values: list[tuple]) -> tuple:
    """Return the entry value a batched call's rows stand for: their tensors stacked along the first dimension."""
    form = spelled(row_form(form_of(values[0][1]), len(values)))
    leaves = []
    for index in range(len(values[0][2])):
        parts = [whole(value[2][index]) for value in values]
        leaves.append(None if any(part is None for part in parts) else torch.cat(parts))
    return (ENTRY_TAG, form, tuple(leaves))
