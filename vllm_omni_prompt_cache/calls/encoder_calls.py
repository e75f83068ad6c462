"""How a text encoder's calls are served: each keyed by what reaches it, answered with what the encoder returned for
those very inputs, or encoded and kept. Everything around the encoder runs for real on every call.

An encoder's forward is a function of its inputs and its weights; the code around it is not. So the cache keeps what
the encoder computes, under the content of its inputs (the module's path, its mode and dtype, every argument by
value: :func:`~.call_key.value_key`, the bytes compared on every hit), and lets the encode method run as written:
its tokenizer, its template, its random draws, its writes and branches are its own, on every call, as uncached. A
batched call is served row by row (:mod:`.encoder_rows`): only its missing rows reach the encoder, as one
sub-batch, once the encoder's rows were shown independent on the first batched call of each site. What an entry
keeps of an output is what encodes read of it (:mod:`.outputs`). Design: docs/design.md, "Encoder calls".
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

from vllm_omni_prompt_cache.counts.counters import Outcome, tally
from vllm_omni_prompt_cache.encoders.encoder_state import EncoderState
from vllm_omni_prompt_cache.encoders.fingerprint import ENCODE_DEVICE
from vllm_omni_prompt_cache.encoders.interception import intercept, release
from vllm_omni_prompt_cache.encoders.outputs import (
    ENTRY_TAG,
    Deferred,
    Reads,
    Unkeepable,
    is_entry,
    kept,
    reading,
    row_form,
    served,
    splits,
    take_apart,
    tensor_leaves,
)
from vllm_omni_prompt_cache.encoders.text_encoders import paths_to_embeddings, text_encoders
from vllm_omni_prompt_cache.keys.call_key import Bypass, CallKey, value_key
from vllm_omni_prompt_cache.logs import logger, warn_once
from vllm_omni_prompt_cache.rows.encoder_rows import batch_size, rows_of
from vllm_omni_prompt_cache.rows.encoder_rows import compare_outputs
from vllm_omni_prompt_cache.store.audit import turn_off
from vllm_omni_prompt_cache.store.flights import Claim
from vllm_omni_prompt_cache.store.prompt_embed_cache import PromptEmbedCache

#: The reasons an encoder call runs uncached (the ``reason`` label of ``bypass_reasons``).
UNKEEPABLE = "the text encoder's output holds an object no entry can keep"
#: Why a batched encoder call is keyed whole (the ``reason`` label of ``whole_call_reasons``).
ROWS_DEPEND = "its encoder's rows were not shown independent"
#: What a row of a call is spelled with in its key, after the module path: no argument encodes to it.
_ROW = ("row",)


@dataclasses.dataclass
class EncodeTally:
    """What the encoder calls of one call (of a wrapped method, or one encoder call alone) came to."""

    answered: int = 0  # encoder calls answered without encoding (every row found)
    encoded: int = 0  # encoder calls that ran the encoder (some rows, or all)
    rows_hit: int = 0
    rows_missed: int = 0
    rows_encoded: int = 0
    bypassed: Counter[str] = dataclasses.field(default_factory=Counter)
    whole: str | None = None  # why a batched encoder call was keyed whole

    @property
    def reached(self) -> bool:
        return bool(self.answered or self.encoded or self.bypassed)

    def counts(self) -> dict:
        """Return what the call adds to its method's counters: a miss if it encoded, else a hit if any encoder
        call was answered, else a bypass with the reason its encoder calls ran uncached."""
        if self.encoded:
            outcome, reason = Outcome.MISS, None
        elif self.answered:
            outcome, reason = Outcome.HIT, None
        else:
            outcome, reason = Outcome.BYPASS, next(iter(self.bypassed), "")
        return tally(
            outcome,
            reason=reason,
            rows_hit=self.rows_hit,
            rows_missed=self.rows_missed,
            rows_encoded=self.rows_encoded,
            whole_call=self.whole,
        )


@dataclasses.dataclass
class Site:
    """One kind of encoder call (a module, an output of one form): what its encodes read, whether its rows are
    independent (None: not shown yet)."""

    keep: set[int] | None = None
    rows: bool | None = None


class EncoderCalls:
    """Serves the calls of one pipeline's text encoders from its store (see the module docstring)."""

    def __init__(
        self, pipeline: Any, store: PromptEmbedCache, tag: str, found: Callable[[], str | None] | None = None
    ) -> None:
        self.pipeline = pipeline
        self.found = found  # names the method an encoder call outside every wrapped one is counted under
        self.store = store
        self.lookups = store.lookups
        self.tag = tag
        self.local = threading.local()  # .tally: the open call's EncodeTally; .pending: entries to trim
        self.sites: dict[tuple, Site] = {}
        self.states: dict[str, EncoderState] = {}
        self.modules: list[torch.nn.Module] = []
        self._lock = threading.Lock()
        self.hook()

    @property
    def encoders(self) -> list[str]:
        return sorted({path.partition(".")[0] for path in self.states})

    def hook(self) -> None:
        """Intercept the calls of every text encoder the pipeline holds now (again, if one was replaced)."""
        with self._lock:
            release(self.modules)
            hooked, states, modules = [], {}, []
            for name, module in text_encoders(self.pipeline).items():
                state = EncoderState(module)
                for path, part in paths_to_embeddings(name, module):
                    hooked.append((path, part, part is module))
                    states[path] = state
                    modules.append(part)
            self.states, self.modules = states, modules
            intercept(hooked, self)

    def remove(self) -> None:
        with self._lock:
            release(self.modules)
            self.modules, self.states = [], {}

    # --- one call of a wrapped method: its encoder calls tallied together -----------------------------------

    def open_call(self, method: str) -> tuple[EncodeTally | None, str | None]:
        """Begin tallying this thread's encoder calls into one call of ``method``; return what was open before."""
        local = self.local
        outer = (getattr(local, "tally", None), getattr(local, "method", None))
        local.tally, local.method = EncodeTally(), method
        return outer

    def close_call(self, outer: tuple[EncodeTally | None, str | None]) -> EncodeTally:
        """End the call begun by :meth:`open_call`; return its tally. The entries it made while what its site's
        encodes read was not known yet keep now only what was read."""
        done = self.local.tally
        self.local.tally, self.local.method = outer
        if outer[0] is None:
            self.settle()
        return done

    @contextlib.contextmanager
    def passing(self) -> Iterator[None]:
        """Let this thread's encoder calls in the block run uncached and uncounted (a call the method bypassed)."""
        outer = getattr(self.local, "passing", False)
        self.local.passing = True
        try:
            yield
        finally:
            self.local.passing = outer

    def settle(self) -> None:
        pending = getattr(self.local, "pending", None)
        if not pending:
            return
        self.local.pending = []
        for key, value, reads, site, method in pending:
            with self._lock:
                site.keep = set(reads.leaves) if site.keep is None else site.keep | reads.leaves
                keep = site.keep
            trimmed = (ENTRY_TAG, value[1], tuple(leaf if index in keep else None for index, leaf in enumerate(value[2])))
            found, current = self.lookups.get(key, method)
            if found and current is value:
                self.lookups.put(key, trimmed, method)

    def _count(self, method: str, tally_update: Callable[[EncodeTally], None]) -> None:
        open_tally = getattr(self.local, "tally", None)
        if open_tally is not None:
            tally_update(open_tally)
            return
        alone = EncodeTally()
        tally_update(alone)
        self.store.record(method, alone.counts())

    # --- one encoder call ---------------------------------------------------------------------------------

    def __call__(
        self, path: str, module: torch.nn.Module, run: Callable[[tuple, dict], Any], args: tuple, kwargs: dict
    ) -> Any:
        local = self.local
        if getattr(local, "passing", False):
            return run(args, kwargs)
        if getattr(local, "tally", None) is None:
            self.settle()
            named = self.found() if self.found is not None else None
            method = named or path
        else:
            method = local.method
        store = self.store
        if not store.enabled:
            self._count(method, lambda t: t.bypassed.update([store.off_reason or "cache disabled"]))
            return run(args, kwargs)
        state = self.states.get(path)
        if state is not None:
            why = state.changed()
            if why is not None:
                self._state_changed(path, why)
        state_key = state.key() if state is not None else ()
        placed_on = getattr(state.module, ENCODE_DEVICE, None) if state is not None else None
        if placed_on is not None:
            run = _on_device(run, placed_on)
        with torch.inference_mode(False):
            keyed = value_key((self.tag, path, state_key, args, kwargs))
        if type(keyed) is Bypass:
            self._count(method, lambda t: t.bypassed.update([f"text encoder input: {keyed.reason}"]))
            return run(args, kwargs)
        size = batch_size(args, kwargs)
        if size is not None:
            site = self.sites.get((path, "rows"))
            if site is None or site.rows is not False:
                return self._rows(path, run, args, kwargs, size, state_key, method)
            self._count(method, lambda t: setattr(t, "whole", ROWS_DEPEND))
        return self._whole(path, run, args, kwargs, CallKey(*keyed), method)

    def _state_changed(self, path: str, why: str) -> None:
        entries = len(self.store)
        self.store.clear()
        logger.info(
            "Prompt-embed cache: %s.%s: %s; %d entries were dropped.", self.tag, path, why, entries
        )

    def site(self, path: str, form: tuple) -> Site:
        shape = (path, _skeleton(form))
        found = self.sites.get(shape)
        if found is None:
            with self._lock:
                found = self.sites.setdefault(shape, Site())
        return found

    def _whole(self, path: str, run: Callable[[tuple, dict], Any], args: tuple, kwargs: dict, key: CallKey, method: str) -> Any:
        encoded: dict[str, Any] = {}

        def encode() -> Any:
            output = run(args, kwargs)
            try:
                form, leaves = take_apart(output)
            except Unkeepable as why:
                raise _Unkept(output, str(why)) from None
            site = self.site(path, form)
            value = kept(form, leaves, site.keep)
            encoded.update(output=output, form=form, site=site, value=value)
            return value

        def count(outcome: Outcome, reason: str | None) -> None:
            if outcome is Outcome.BYPASS:
                self._count(method, lambda t: t.bypassed.update([reason or ""]))
            elif "unkept" not in encoded:
                self._count(method, _encoded_whole)

        try:
            value = self.lookups.serve(key, encode, count, method)
        except _Unkept as unkept:
            encoded["unkept"] = True
            warn_once(f"{self.tag}.{path}'s output cannot be kept ({unkept.why}): its calls run uncached")
            self._count(method, lambda t: t.bypassed.update([UNKEEPABLE]))
            return unkept.output
        if encoded:
            return self._read(encoded["output"], encoded["form"], encoded["site"], [(key, encoded["value"])], method)
        if not is_entry(value):
            raise TypeError(f"an entry under an encoder call's key holds a {type(value).__qualname__}")
        self._count(method, _answered)
        output = self._served(value, args, kwargs, run, key, method, path)
        audit = self.store.audit
        if audit is not None and audit.due():
            return self._audited(output, value, run, args, kwargs, method)
        return output

    def _audited(self, output: Any, value: tuple, run: Callable[[tuple, dict], Any], args: tuple, kwargs: dict, method: str) -> Any:
        """Encode an answered call again and compare what the entry keeps; on a difference serve the fresh output
        and turn the cache off for the pipeline's class (see :mod:`.audit`)."""
        try:
            fresh = run(args, kwargs)
            form, leaves = take_apart(fresh)
            kept_leaves = [(leaf, value[2][index]) for index, leaf in enumerate(leaves) if value[2][index] is not None]
            why = compare_outputs([stored for _, stored in kept_leaves], [leaf for leaf, _ in kept_leaves])[0]
            if form != value[1]:
                why = why or "its output has another form"
        except Exception as error:  # out of memory, say: the call was served; the audit is what failed
            warn_once(f"an audit's encode failed ({type(error).__qualname__}: {error}); the hit was served")
            return output
        self.store.record_audit(mismatch=why is not None, method=method)
        if why is None:
            return output
        turn_off(self.store, type(self.pipeline), self.tag, why.replace("assembled", "served"))
        return fresh

    def _read(self, output: Any, form: tuple, site: Site, made: list[tuple[CallKey, tuple]], method: str) -> Any:
        """Hand the encode the real output, noting what it reads: entries made before their site's reads were
        known keep only those once the call ends."""
        reads = Reads()
        if site.keep is not None:
            reads.leaves = site.keep  # later reads grow what the site keeps
        else:
            pending = getattr(self.local, "pending", None)
            if pending is None:
                pending = self.local.pending = []
            pending.extend((key, value, reads, site, method) for key, value in made)
        return reading(output, form, reads)

    def _served(
        self,
        value: tuple,
        args: tuple,
        kwargs: dict,
        run: Callable[[tuple, dict], Any],
        key: CallKey | None,
        method: str,
        path: str,
    ) -> Any:
        device = _device_of(args, kwargs)
        if all(leaf is not None for leaf in value[2]) and not any(part[0] == "object" for part in _objects(value[1])):
            return served(value, device, _never)
        inputs = _owned(args, kwargs)
        fresh: list[Any] = []

        def fetch(index: int) -> Any:
            """Run the encoder for real for a leaf the entry does not keep; keep it from now on."""
            if not fresh:
                output = run(*inputs)
                fresh.append(take_apart(output))
                if key is not None:
                    form, leaves = fresh[0]
                    site = self.site(path, form)
                    with self._lock:
                        site.keep = {index} if site.keep is None else site.keep | {index}
                    self.lookups.put(key, kept(form, leaves, site.keep), method)
            return fresh[0][1][index]

        return served(value, device, fetch)

    # --- a batched call, row by row -------------------------------------------------------------------------

    def _rows(
        self,
        path: str,
        run: Callable[[tuple, dict], Any],
        args: tuple,
        kwargs: dict,
        size: int,
        state_key: tuple,
        method: str,
    ) -> Any:
        keys: list[CallKey] = []
        with torch.inference_mode(False):
            for row in range(size):
                keyed = value_key((self.tag, path, state_key, _ROW, *rows_of(args, kwargs, [row])))
                if type(keyed) is Bypass:
                    keyed = value_key((self.tag, path, state_key, args, kwargs))
                    return self._whole(path, run, args, kwargs, CallKey(*keyed), method)  # type: ignore[misc]
                keys.append(CallKey(*keyed))
        rows_site = self.sites.setdefault((path, "rows"), Site())
        if rows_site.rows is None:
            return self._first_rows(path, run, args, kwargs, size, keys, rows_site, method)
        firsts, copies = _distinct(keys)
        values: dict[int, tuple] = {}
        claims = self.lookups.claim([keys[row] for row in firsts], method)
        owned = [(row, flight) for row, (decision, flight) in zip(firsts, claims, strict=True) if decision is Claim.OWN]
        joined = [(row, flight) for row, (decision, flight) in zip(firsts, claims, strict=True) if decision is Claim.JOIN]
        direct = [row for row, (decision, _) in zip(firsts, claims, strict=True) if decision is Claim.DIRECT]
        for row, (decision, claimed) in zip(firsts, claims, strict=True):
            if decision is Claim.HIT:
                values[row] = claimed
        hit = len(values)
        fresh_rows: dict[int, tuple] = {}
        encoded_rows = 0
        if owned:
            batch: dict[int, tuple] = {}

            def encode(row: int, remaining: list[int]) -> tuple:
                nonlocal encoded_rows
                if row not in batch:
                    output = run(*rows_of(args, kwargs, remaining))
                    encoded_rows += len(remaining)
                    form, leaves = take_apart(output)
                    if not splits(form, len(remaining)):
                        raise _Unkept(output, "its output does not split into rows")
                    one = row_form(form, 1)
                    site = self.site(path, one)
                    for position, each in enumerate(remaining):
                        cut = [leaf[position : position + 1] if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
                        batch[each] = kept(one, cut, site.keep)
                        fresh_rows[each] = batch[each]
                return batch[row]

            try:
                for position, (row, flight) in enumerate(owned):
                    remaining = [later for later, _ in owned[position:] if later not in batch]
                    values[row], _ = self.lookups.complete(
                        keys[row], flight, lambda row=row, remaining=remaining: encode(row, remaining), method
                    )
            except BaseException:
                self.lookups.abandon([(keys[row], flight) for row, flight in owned if row not in values])
                raise
        for row in direct:  # a collision: encoded alone, not kept
            output = run(*rows_of(args, kwargs, [row]))
            encoded_rows += 1
            form, leaves = take_apart(output)
            values[row] = kept(form, leaves, None)
        for row, flight in joined:
            if flight.wait():
                values[row] = flight.value
                hit += 1
            else:  # its owner failed: encode it ourselves, alone
                values[row] = self.lookups.serve(keys[row], lambda row=row: _alone(run, args, kwargs, row), _ignore, method)
                encoded_rows += 1
        for row, first in copies:
            values[row] = values[first]
        missed = len(fresh_rows)

        def update(t: EncodeTally) -> None:
            t.rows_hit += size - missed
            t.rows_missed += missed
            t.rows_encoded += encoded_rows
            if encoded_rows:
                t.encoded += 1
            else:
                t.answered += 1

        self._count(method, update)
        assembled = _assembled([values[row] for row in range(size)])
        if encoded_rows:
            site = self.site(path, assembled[1])
            made = [(keys[row], value) for row, value in fresh_rows.items()]
            return self._served_rows(assembled, args, kwargs, run, method, made, site, path)
        return self._served(assembled, args, kwargs, run, None, method, path)

    def _served_rows(
        self,
        assembled: tuple,
        args: tuple,
        kwargs: dict,
        run: Callable[[tuple, dict], Any],
        method: str,
        made: list[tuple[CallKey, tuple]],
        site: Site,
        path: str,
    ) -> Any:
        output = self._served(assembled, args, kwargs, run, None, method, path)
        if site.keep is None:
            return self._read(output, assembled[1], site, made, method)
        return output

    def _first_rows(
        self,
        path: str,
        run: Callable[[tuple, dict], Any],
        args: tuple,
        kwargs: dict,
        size: int,
        keys: list[CallKey],
        rows_site: Site,
        method: str,
    ) -> Any:
        """The first batched call of an encoder: served uncached, its rows encoded alone and compared with it."""
        output = run(args, kwargs)
        firsts, _ = _distinct(keys)
        try:
            form, leaves = take_apart(output)
        except Unkeepable:
            form, leaves = None, []
        why = None
        gap = 0.0
        alone: dict[int, tuple] = {}
        if form is None or not splits(form, size):
            why = "its output does not split into rows"
        else:
            for row in firsts:
                single = run(*rows_of(args, kwargs, [row]))
                alone[row] = take_apart(single)
                expected = [leaf[row : row + 1] for leaf in leaves if isinstance(leaf, torch.Tensor)]
                mine = [leaf for leaf in alone[row][1] if isinstance(leaf, torch.Tensor)]
                why, measured = compare_outputs(mine, expected)
                gap = max(gap, measured)
                if why is not None:
                    break
        rows_site.rows = why is None
        self.store.record_layout_check(len(alone), gap if why is None else None, method=method)
        if why is not None:
            logger.warning(
                "Prompt-embed cache: %s.%s: its rows are not independent (%s); its batched calls are keyed whole.",
                self.tag,
                path,
                why,
            )
        made = []
        if why is None:
            for row in firsts:
                one_form, one_leaves = alone[row]
                site = self.site(path, one_form)
                value = kept(one_form, one_leaves, site.keep)
                self.lookups.put(keys[row], value, method)
                made.append((keys[row], value))

        def update(t: EncodeTally) -> None:
            t.encoded += 1
            t.rows_missed += size
            t.rows_encoded += size

        self._count(method, update)
        if form is None:
            return output
        return self._read(output, form, self.site(path, row_form(form, 1)), made, method)


class _Unkept(Exception):
    def __init__(self, output: Any, why: str) -> None:
        self.output, self.why = output, why


def _encoded_whole(t: EncodeTally) -> None:
    t.encoded += 1
    t.rows_encoded += 0


def _answered(t: EncodeTally) -> None:
    t.answered += 1


def _ignore(outcome: Outcome, reason: str | None) -> None:
    return None


def _never(index: int) -> Any:
    raise AssertionError("an entry that keeps every leaf has nothing to fetch")


def _alone(run: Callable[[tuple, dict], Any], args: tuple, kwargs: dict, row: int) -> tuple:
    form, leaves = take_apart(run(*rows_of(args, kwargs, [row])))
    return kept(form, leaves, None)


def _distinct(keys: list[CallKey]) -> tuple[list[int], list[tuple[int, int]]]:
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
    form = row_form(values[0][1], len(values))
    leaves = []
    for index in range(len(values[0][2])):
        parts = [value[2][index] for value in values]
        leaves.append(None if any(part is None for part in parts) else torch.cat(parts))
    return (ENTRY_TAG, form, tuple(leaves))


def _objects(form: tuple) -> list[tuple]:
    tag = form[0]
    if tag == "object":
        return [form]
    if tag in ("tuple", "list"):
        return [part for item in form[1] for part in _objects(item)]
    if tag == "dict":
        return [part for _, item in form[1] for part in _objects(item)]
    if tag == "output":
        return [part for _, item in form[2] for part in _objects(item)]
    return []


def _skeleton(form: tuple) -> tuple:
    tag = form[0]
    if tag == "tensor":
        return ("tensor", form[1], len(form[2]), form[3])
    if tag in ("tuple", "list"):
        return (tag, tuple(_skeleton(item) for item in form[1]))
    if tag == "dict":
        return (tag, tuple((key, _skeleton(item)) for key, item in form[1]))
    if tag == "output":
        return (tag, form[1], tuple((key, _skeleton(item)) for key, item in form[2]))
    return form


def _device_of(args: tuple, kwargs: dict) -> torch.device | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _on_device(run: Callable[[tuple, dict], Any], device: torch.device) -> Callable[[tuple, dict], Any]:
    """Return ``run`` for an encoder that waits off its device between calls (an offload, a placement on a miss):
    inputs that code put where the encoder waited go where it runs, and its output comes back beside them."""

    def placed(args: tuple, kwargs: dict) -> Any:
        given = _device_of(args, kwargs)
        if given is None or given == device:
            return run(args, kwargs)
        moved = tree_map(lambda value: value.to(device) if isinstance(value, torch.Tensor) else value, (args, kwargs))
        output = run(*moved)
        return tree_map(lambda value: value.to(given) if isinstance(value, torch.Tensor) else value, output)

    return placed


def _owned(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Return the call's inputs with each tensor copied: a fetch later runs on what the call was given."""
    copy = lambda value: value.clone() if isinstance(value, torch.Tensor) else value  # noqa: E731
    return tuple(copy(value) for value in args), {name: copy(value) for name, value in kwargs.items()}


__all__ = ["Deferred", "EncodeTally", "EncoderCalls", "tensor_leaves"]
