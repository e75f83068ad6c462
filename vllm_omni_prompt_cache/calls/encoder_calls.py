"""How a text encoder's calls are intercepted and served: each keyed by what reaches it, answered with what the
encoder returned for those very inputs, or encoded and kept. Everything around the encoder runs for real.

An encoder's forward is a function of its inputs and its weights; the code around it is not. So the cache keeps what
the encoder computes, under the content of its inputs (the module's path, its mode and dtype, every argument by
value: :func:`~.call_key.value_key`, the bytes compared on every hit), and lets the encode method run as written: its
tokenizer, its template, its random draws, its writes and branches are its own, on every call, as uncached.

Each text encoder's outermost calls reach :class:`EncoderCalls` before any hook or forward (:mod:`.intercepted`). A
batched call is served row by row (:mod:`.row_calls`). What an entry keeps of an output is what encodes read of it
(:mod:`.outputs`). Design: docs/design.md, "Encoder calls".
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from vllm_omni_prompt_cache.counts.counters import ROW_HIT as ONE_ROW_HIT
from vllm_omni_prompt_cache.counts.counters import Count, Outcome, tally
from vllm_omni_prompt_cache.encoders.fingerprint import ENCODE_DEVICE
from vllm_omni_prompt_cache.encoders.forms import (
    ENTRY_TAG,
    Unkeepable,
    is_entry,
    kept,
    skeleton,
    take_apart,
)
from vllm_omni_prompt_cache.encoders.intercepted import EncoderState, intercept, release
from vllm_omni_prompt_cache.encoders.outputs import Reads, reading, served
from vllm_omni_prompt_cache.encoders.residency import on_encode_device
from vllm_omni_prompt_cache.encoders.text_encoders import (
    TABLES_NOTED,
    modules_held_by,
    paths_to_embeddings,
    text_encoders,
)
from vllm_omni_prompt_cache.keys.call_key import Bypass, CallKey, value_key
from vllm_omni_prompt_cache.logs import logger, warn_once
from vllm_omni_prompt_cache.store.audit import audited
from vllm_omni_prompt_cache.store.prompt_embed_cache import PromptEmbedCache

#: Why an encoder call runs uncached (the ``reason`` label of ``bypass_reasons``).
UNKEEPABLE = "the text encoder's output holds an object no entry can keep"
DISABLED = "cache disabled"
#: Why a batched encoder call is keyed whole (the ``reason`` label of ``whole_call_reasons``).
ROWS_DEPEND = "its encoder's rows were not shown independent"

#: A real call of the intercepted module: ``run(args, kwargs)``.
Run = Callable[[tuple, dict], Any]


@dataclasses.dataclass
class EncodeTally:
    """What the encoder calls of one call (of a wrapped method, or one encoder call alone) came to."""

    answered: int = 0  # encoder calls answered without encoding (every row found)
    encoded: int = 0  # encoder calls that ran the encoder (some rows, or all)
    rows_hit: int = 0
    rows_missed: int = 0
    rows_encoded: int = 0
    bypassed: Counter[str] = dataclasses.field(default_factory=Counter)
    row_bypassed: Counter[str] = dataclasses.field(default_factory=Counter)  # rows encoded uncached, by reason
    whole: str | None = None  # why a batched encoder call was keyed whole

    def add(self, *, answered: int = 0, encoded: int = 0) -> None:
        """Count one encoder call keyed whole, of ``answered`` rows found or ``encoded`` rows encoded."""
        if encoded:
            self.encoded += 1
            self.rows_missed += encoded
            self.rows_encoded += encoded
        else:
            self.answered += 1
            self.rows_hit += answered

    def counts(self) -> Mapping[Count, Any] | None:
        """Return what the call adds to its method's counters (None: it reached no text encoder): a miss if it
        encoded, else a hit if an encoder call was answered, else a bypass with why its encoder calls ran uncached."""
        if not (self.encoded or self.answered or self.bypassed):
            return None
        if self.encoded:
            outcome, reason = Outcome.MISS, None
        elif self.answered:
            if self.rows_hit == 1 and self.answered == 1 and not self.whole:
                return ONE_ROW_HIT
            outcome, reason = Outcome.HIT, None
        else:
            outcome, reason = Outcome.BYPASS, next(iter(self.bypassed))
        return tally(
            outcome,
            reason=reason,
            rows_hit=self.rows_hit,
            rows_missed=self.rows_missed,
            rows_encoded=self.rows_encoded,
            row_reasons=self.row_bypassed,
            whole_call=self.whole,
        )


@dataclasses.dataclass
class Site:
    """One kind of encoder call (a module, an output of one form): what its encodes read, whether its rows are
    independent (None: not shown yet)."""

    keep: set[int] | None = None
    rows: bool | None = None


class EncoderCalls:
    """Serves the calls of one pipeline's text encoders from its store (see the module docstring).

    ``found()``: names the method an encoder call made outside every wrapped method is counted under (None: the
    encoder's path). ``rows``: serves a batched call row by row (:class:`~.row_calls.RowCalls`, set by the
    installation; None: batched calls are keyed whole).
    """

    def __init__(
        self,
        pipeline: Any,
        store: PromptEmbedCache,
        tag: str,
        found: Callable[[str], str | None] | None = None,
        digest: Callable[[Any], bytes] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.digest = digest  # what digests input arrays (None: xxh3-128)
        self.found = found
        self.rows: Callable[..., Any] | None = None
        self.store = store
        self.lookups = store.lookups
        self.tag = tag
        self.local = threading.local()  # .tally, .method: the open call; .pending: entries to trim; .passing
        self.sites: dict[tuple, Site] = {}
        self.states: dict[str, EncoderState] = {}  # each hooked module's encoder's state, by path
        self.modules: list[torch.nn.Module] = []
        self._lock = threading.Lock()
        self._held = modules_held_by(pipeline)  # the live mapping the pipeline's children are in
        self._children_seen: dict[str, int] = {}
        self._hooked: dict[str, int] = {}  # each text encoder hooked, by name: its id
        self.hook()

    @property
    def encoders(self) -> list[str]:
        return sorted({path.partition(".")[0].partition(":")[0] for path in self.states})

    # --- which modules are intercepted --------------------------------------------------------------------

    def hook(self) -> None:
        """Intercept the calls of every text encoder the pipeline holds now."""
        with self._lock:
            release(self.modules, self)
            hooked, states, modules = [], {}, []
            encoders = text_encoders(self.pipeline)
            self._hooked = {name: id(module) for name, module in encoders.items()}
            for name, module in encoders.items():
                state = EncoderState(module)
                for path, part in paths_to_embeddings(name, module):
                    hooked.append((path, part, part is module))
                    states[path] = state
                    modules.append(part)
            self.states, self.modules = states, modules
            intercept(hooked, self)
            self._children_seen = self._children_now()

    def refresh(self) -> None:
        """Intercept the text encoders the pipeline holds now, if a child module was replaced (or a token table
        recognised) since it last looked; a text encoder replaced empties the cache (its entries are the old one's)."""
        seen = self._children_now()
        if seen == self._children_seen:  # the common case, on every call
            return
        before = dict(self._hooked)
        encoders = {name: id(module) for name, module in text_encoders(self.pipeline).items()}
        if encoders != before:
            replaced = [name for name, ident in before.items() if encoders.get(name, ident) != ident]
            self.hook()
            if replaced:
                self._state_changed(", ".join(replaced), "it was replaced")
        self._children_seen = seen

    def _children_now(self) -> dict[str, int]:
        held = dict(self._held)  # a copy made at once: another thread may add an attribute meanwhile
        seen = {name: id(value) for name, value in held.items() if isinstance(value, torch.nn.Module)}
        seen[""] = TABLES_NOTED[0]
        return seen

    def remove(self) -> None:
        with self._lock:
            release(self.modules, self)
            self.modules, self.states = [], {}

    # --- one call of a wrapped method: its encoder calls tallied together -----------------------------------

    def open_call(self, method: str) -> tuple[EncodeTally | None, str | None]:
        """Begin tallying this thread's encoder calls into one call of ``method``; return what was open before."""
        local = self.local
        outer = (getattr(local, "tally", None), getattr(local, "method", None))
        if outer[0] is None:
            self.refresh()
        local.tally, local.method = EncodeTally(), method
        return outer

    def close_call(self, outer: tuple[EncodeTally | None, str | None]) -> EncodeTally:
        """End the call begun by :meth:`open_call`; return its tally. Entries made while what their site's encodes
        read was not known yet keep only what was read from now on."""
        local = self.local
        done = local.tally
        local.tally, local.method = outer
        if outer[0] is None and getattr(local, "pending", None):
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
        """Make what this thread's encodes read the leaves their sites keep from now on, and trim the entries made
        before that was known (in memory: the lower tiers keep the file written with the encode)."""
        pending, self.local.pending = self.local.pending, []
        for key, value, reads, site, method, ticket in pending:
            with self._lock:
                was = site.keep
                site.keep = reads.kept() if was is None else was | reads.kept()
                keep = site.keep
            if was is not None:
                continue
            if key is None:
                continue
            found, current = self.lookups.get(key, method)  # the entry as kept (detached), if still there
            if found and is_entry(current) and current[1] == value[1]:
                leaves = tuple(leaf if index in keep else None for index, leaf in enumerate(current[2]))
                self.lookups.put(key, (ENTRY_TAG, current[1], leaves), method, ticket, write=False)

    def reached(self, method: str | None, args: tuple, kwargs: dict) -> None:
        """Count a call of an encoder's own method that, run for the first time, reached the encoder."""
        self.count(method or "", lambda tally_now: tally_now.add(encoded=_rows_of(args, kwargs)))

    def count(self, method: str, update: Callable[[EncodeTally], None]) -> None:
        """Add to the open call's tally, or count an encoder call made outside every wrapped method on its own."""
        open_tally = getattr(self.local, "tally", None)
        if open_tally is not None:
            update(open_tally)
            return
        alone = EncodeTally()
        update(alone)
        self.store.record(method, alone.counts() or {})

    # --- one encoder call ---------------------------------------------------------------------------------

    def __call__(self, path: str, module: torch.nn.Module, run: Run, args: tuple, kwargs: dict) -> Any:
        local = self.local
        if getattr(local, "passing", False):
            return run(args, kwargs)
        if getattr(local, "tally", None) is None:  # outside every wrapped method
            if getattr(local, "pending", None):
                self.settle()
            method = (self.found(path) if self.found is not None else None) or path
        else:
            method = local.method
        store = self.store
        if not store.enabled:
            self.count(method, lambda t: t.bypassed.update([store.off_reason or DISABLED]))
            return run(args, kwargs)
        state = self.states.get(path)
        state_key: tuple = ()
        if state is not None:
            state_key, changed = state.key()
            if changed is not None:
                self._state_changed(path, changed)
            placed_on = vars(state.module).get(ENCODE_DEVICE)  # set as a plain attribute (no module lookup)
            if placed_on is not None:
                run = on_encode_device(run, placed_on)
        with torch.inference_mode(False):
            keyed = value_key((self.tag, path, state_key, args, kwargs), self.digest)
        if type(keyed) is Bypass:
            self.count(method, lambda t: t.bypassed.update([f"text encoder input: {keyed.reason}"]))
            return run(args, kwargs)
        if self.rows is not None and _maybe_batched(args, kwargs):
            served_rows = self.rows(path, run, args, kwargs, state_key, method)
            if served_rows is not NOT_ROWS:
                return served_rows
        return self.whole(path, run, args, kwargs, CallKey(*keyed), method)

    def _state_changed(self, path: str, why: str) -> None:
        entries = len(self.store)
        self.store.clear()
        logger.info("Prompt-embed cache: %s.%s: %s; its %d entries were dropped.", self.tag, path, why, entries)

    def site(self, path: str, form: tuple) -> Site:
        """Return what is known of the calls of ``path`` whose outputs have ``form``'s shape (any sizes)."""
        shape = (path, skeleton(form))
        found = self.sites.get(shape)
        if found is None:
            with self._lock:
                found = self.sites.setdefault(shape, Site())
        return found

    def whole(self, path: str, run: Run, args: tuple, kwargs: dict, key: CallKey, method: str) -> Any:
        """Serve the call under one key: its entry, another call's encode of it, a lower tier's, or an encode."""
        encoded: dict[str, Any] = {}

        def encode() -> Any:
            output = run(args, kwargs)
            try:
                form, leaves = take_apart(output)
            except Unkeepable as why:
                encoded["unkept"] = True  # counted as a bypass, not a miss
                raise _Unkept(output, str(why)) from None
            site = self.site(path, form)
            value = kept(form, leaves, site.keep)
            encoded.update(output=output, form=form, site=site, value=value)
            return value

        rows = _rows_of(args, kwargs)

        def count(outcome: Outcome, reason: str | None) -> None:
            if outcome is Outcome.BYPASS:
                self.count(method, lambda t: t.bypassed.update([reason or ""]))
            elif "unkept" not in encoded:
                self.count(method, lambda t: t.add(encoded=rows))

        try:
            value = self.lookups.serve(key, encode, count, method)
        except _Unkept as unkept:
            encoded["unkept"] = True
            warn_once(f"{self.tag}.{path}'s output cannot be kept ({unkept.why}): its calls run uncached")
            self.count(method, lambda t: t.bypassed.update([UNKEEPABLE]))
            return unkept.output
        if encoded:
            return self.read(encoded["output"], encoded["form"], encoded["site"], [(key, encoded["value"])], method)
        self.count(method, lambda t: t.add(answered=rows))
        output = self.served(value, args, kwargs, run, path, key, method)
        audit = self.store.audit
        if audit is not None and audit.due():
            return audited(self.store, type(self.pipeline), self.tag, output, value, lambda: run(args, kwargs), method)
        return output

    def read(self, output: Any, form: tuple, site: Site, made: list[tuple[CallKey, tuple]], method: str) -> Any:
        """Hand the encode the real output, noting what it reads: the site keeps that from the call's end on, and
        entries made before it was known are trimmed then (:meth:`settle`)."""
        reads = Reads()
        pending = getattr(self.local, "pending", None)
        if pending is None:
            pending = self.local.pending = []
        ticket = self.lookups.ticket  # a clear() meanwhile voids the trimmed entry as it voided the first
        pending.extend((key, value, reads, site, method, ticket) for key, value in made or [(None, None)])
        return reading(output, form, reads)

    def served(
        self, value: tuple, args: tuple, kwargs: dict, run: Run, path: str, key: CallKey | None, method: str
    ) -> Any:
        """Return the output an entry stands for, on the device of the call's inputs; a leaf it does not keep is
        fetched by running the encoder on (a copy of) this call's inputs, and kept from then on."""
        device = _device_of(args, kwargs)
        if not any(leaf is None for leaf in value[2]):  # by identity: ``in`` would compare tensors with None
            return served(value, device, _never)
        inputs = _owned(args, kwargs)
        modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())  # the call's: a fetch runs in them
        ticket = self.lookups.ticket  # a clear() before the fetch voids what it keeps
        fresh: list[Any] = []

        def fetch(index: int) -> Any:
            if not fresh:
                with torch.inference_mode(modes[1]), torch.set_grad_enabled(modes[0]):
                    fresh.append(take_apart(run(*inputs)))
            form, leaves = fresh[0]
            site = self.site(path, form)
            with self._lock:
                grown = site.keep is None or index not in site.keep
                site.keep = {index} if site.keep is None else site.keep | {index}
            if grown and key is not None:  # kept from now on
                self.lookups.put(key, kept(form, leaves, site.keep), method, ticket, write=False)
            return leaves[index]

        return served(value, device, fetch)


#: What :attr:`EncoderCalls.rows` returns for a call it does not serve row by row (keyed whole).
NOT_ROWS = object()


class _Unkept(Exception):
    def __init__(self, output: Any, why: str) -> None:
        self.output, self.why = output, why


def _rows_of(args: tuple, kwargs: dict) -> int:
    """Return how many prompt rows a call keyed whole carries: its ids' leading size (1 for one prompt)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and not value.is_floating_point():
            return int(value.shape[0])
    return 1


def _never(index: int) -> Any:
    raise AssertionError("an entry that keeps every leaf has nothing to fetch")


def _maybe_batched(args: tuple, kwargs: dict) -> bool:
    """Return True when a tensor input leads with more than one row (a batch of one is served whole, at once)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] > 1:
            return True
    return False


def _device_of(args: tuple, kwargs: dict) -> torch.device | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _owned(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Return the call's inputs with each tensor copied: a fetch later runs on what the call was given."""
    copy = lambda value: value.clone() if isinstance(value, torch.Tensor) else value  # noqa: E731
    return tuple(copy(value) for value in args), {name: copy(value) for name, value in kwargs.items()}
