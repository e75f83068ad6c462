"""What the cache learns about one wrapped method from the calls it traces (:class:`MethodState`, filled by
:meth:`MethodState.learn`): the data its key holds, the components guarding it, the writes a hit replays, and
why it may be refused; what a trace shows a call changed; and how an output carries the writes a hit replays
(:func:`pack`; a hit unpacks them with :func:`.reads.unpack`: an encode that stashes its result for the forward,
as UniRL's MiniMax-H3 pipeline keeps ``_rl_text_embeddings``, leaves the pipeline as a miss would).

A hit only reads a state (:func:`.reads.held_state`, bound as :meth:`MethodState.state_argument`); every
change is made here, by a call that learns.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_omni_prompt_cache.keys.call_key import Bypass, value_identity
from vllm_omni_prompt_cache.keys.reads import (
    ABSENT,
    COMPONENT,
    DATA,
    EFFECTS,
    FROM_OUTPUT,
    RECORDED_VALUE,
    Trace,
    attributes_of,
    classify,
    current_attribute,
    held_state,
    is_absent,
)


def _output_path(value: Any, output: Any) -> tuple[int, ...] | None:
    """Return where ``value`` sits in ``output`` (itself, or an item of a tuple or list), or None."""
    if value is output:
        return ()
    if isinstance(output, (tuple, list)):
        for index, item in enumerate(output):
            if value is item:
                return (index,)
    return None


def pack(output: Any, writes: Mapping[str, Any]) -> Any:
    """Return what an entry holds for a call that returned ``output`` and made ``writes``."""
    if not writes:
        return output
    recorded = []
    for name, value in writes.items():
        path = _output_path(value, output)
        recorded.append((name, FROM_OUTPUT, list(path)) if path is not None else (name, RECORDED_VALUE, value))
    return (EFFECTS, output, tuple(recorded))


def unreplayable(writes: Mapping[str, Any], output: Any) -> str | None:
    """Return why a hit could not replay ``writes`` (a value that is not data nor part of the output), or None."""
    for name, value in writes.items():
        if _output_path(value, output) is not None or is_absent(value):
            continue
        if classify(name, value) is not DATA or type(value_identity(value)) is Bypass:
            return f"writes self.{name} (a {type(value).__qualname__}), which a hit could not replay"
    return None


def changed_state(trace: Trace) -> bool:
    """Return True when the call has written an attribute, or changed one it read in place, so far."""
    return bool(trace.writes) or bool(mutated_in_place(trace))


def read_early_and_late(trace: Trace, name: str, *, changed_late: bool) -> bool:
    """Return True when ``name`` was read before the text-encoder call and read (or ``changed_late``) after it."""
    return name not in trace.read_late and (name in trace.used_late or changed_late)


def changed_after_encoder(trace: Trace, name: str) -> bool:
    """Return True when the call wrote ``name``, or changed it in place, after reaching its text encoder."""
    if name in trace.written_late:
        return True
    at_encoder = trace.identities_at_encoder.get(name)
    return at_encoder is not None and value_identity(attributes_of(trace.instance).get(name, ABSENT)) != at_encoder


def changed_writes(trace: Trace) -> dict[str, Any]:
    """Return the writes that left an attribute other than it was before the call (a value swapped in
    and restored, as verl-omni's MiniMax-H3 adapter does with its tokenizer, is no write)."""
    return {
        name: value
        for name, value in trace.writes.items()
        if value is not trace.reads.get(name, trace.overwritten.get(name, ABSENT))
        and not (is_absent(value) and is_absent(trace.overwritten.get(name, ABSENT)))
    }


def mutated_in_place(trace: Trace) -> list[str]:
    """Return the data attributes this call read and then changed in place (not by assignment)."""
    changed = []
    instance_dict = attributes_of(trace.instance)
    for name, identity in trace.read_identities.items():
        if name in trace.writes or type(identity) is Bypass:
            continue
        if value_identity(instance_dict.get(name, ABSENT)) != identity:
            changed.append(name)
    return changed


def instance_attributes(instance: Any) -> dict[str, Any]:
    """Return a shallow copy of ``instance``'s own attributes (what it holds now; {} if it has no ``__dict__``)."""
    return dict(attributes_of(instance))


@dataclass
class MethodState:
    """What the cache knows about one wrapped method.

    Every change goes through a method below that holds ``lock``, so calls that learn or refuse it at once
    merge what they saw and finish or refuse it once. A hit reads the fields without the lock, which stays
    cheap and safe because each is replaced whole, never changed in place: :meth:`learn` publishes new lists
    and dicts, the flags are single assignments. A reader sees the old value or the new one, never a half-made one.
    """

    name: str
    source: str  # how it was found, for stats and logs
    inferred: bool  # found by watching the encoders (its first hit is checked against an uncached call)
    learning: bool = True  # its next call runs uncached and observed
    observed: bool = False  # an encode of it ran under observation (modules, collectives)
    data: list[str] = field(default_factory=list)  # attributes keyed by content, in the order first read
    components: dict[str, Any] = field(default_factory=dict)  # attributes keyed by name, guarded by identity
    writes: list[str] = field(default_factory=list)  # attributes its calls were seen to write (replayed on hits)
    #: attributes its calls read and then change (counters, counts, timings): instrumentation, not an input
    accumulators: list[str] = field(default_factory=list)
    refusal: str | None = None  # why no call is cached (None: they are)
    check_pending: bool = False  # its first hit is encoded again and compared
    recorded: bool = False  # its encodes record what reaches their text encoder: an entry without a record is proven
    #: the instance's attributes when the cache was installed: an object already held then that no key can
    #: hold by content (a config, a parallel group) is configuration, keyed by identity; one that appears later
    #: is per-request state, and a method that reads it is not cached
    configuration: Mapping[str, Any] = field(default_factory=dict, repr=False)
    checks: int = 0  # first hits checked (begun)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def note_observed(self) -> None:
        """Note that an encode of it ran under observation."""
        with self.lock:
            self.observed = True

    def note_recorded(self) -> None:
        """Note that its encodes record what reaches their text encoder."""
        with self.lock:
            self.recorded = True

    def relearn(self, instance: Any) -> list[str]:
        """Guard it by the components ``instance`` holds now and serve its next call uncached and observed;
        return the names of those replaced since they were observed (empty: another call took them already)."""
        with self.lock:
            now = {name: current_attribute(instance, name) for name in self.components}
            replaced = [name for name, component in self.components.items() if now[name] is not component]
            if replaced:
                self.components, self.learning = now, True
            return replaced

    def finish_learning(self, *, check: bool) -> bool:
        """End its first use, its first hit checked when ``check``; return False when another call already ended
        it or refused the method (then that call confirmed it, and the first hit is not checked twice)."""
        with self.lock:
            if not self.learning or self.refusal is not None:
                return False
            # check_pending may already be set by another call's learn() since ``check`` was computed: kept.
            self.learning, self.observed, self.check_pending = False, True, check or self.check_pending
            return True

    def take_check(self) -> bool:
        """Return True for the one call that checks its first hit (the check is pending; it is taken and counted)."""
        with self.lock:
            if not self.check_pending:
                return False
            self.check_pending = False
            self.checks += 1
            return True

    def refuse(self, why: str) -> bool:
        """Stop caching it for ``why``; return False when it was refused already (the first reason stands)."""
        with self.lock:
            if self.refusal is not None:
                return False
            self.refusal = why
            return True

    @property
    def rows_allowed(self) -> bool:
        """Rows of a call carry the state it read in their keys, but a hit replays one call's writes, not a row's."""
        return not self.writes

    def keyed_on(self) -> list[str]:
        """Return what a call's key holds, for stats and logs."""
        return [
            "arguments",
            *(f"self.{name} (content)" for name in self.data),
            *(f"self.{name} (identity)" for name in self.components),
        ]

    def describe(self) -> dict[str, Any]:
        return {
            "found": self.source,
            "keyed_on": self.keyed_on(),
            "writes_replayed": [f"self.{name}" for name in self.writes],
            "instrumentation": [f"self.{name}" for name in self.accumulators],
            "state": "refused" if self.refusal else "learning" if self.learning else "cached",
            "refusal": self.refusal,
            "first_hit_checked": self.checks > 0,
        }

    def replayed(self, trace: Trace) -> dict[str, Any]:
        """Return what a hit of the traced call replays: its writes, instrumentation left out."""
        return {name: value for name, value in changed_writes(trace).items() if name not in self.accumulators}

    #: What a hit reads of the instance: defined with the reads (:func:`.reads.held_state`), where a hit's code
    #: lives.
    state_argument = held_state

    def state_argument_before(self, trace: Trace, instance: Any) -> tuple | None:
        """Return the key part the instance held before the traced call (what the call wrote undone)."""
        if not self.data:
            return None
        parts = []
        for name in self.data:
            if name in trace.reads:
                parts.append((name, trace.reads[name]))
            elif name in trace.overwritten:
                parts.append((name, trace.overwritten[name]))
            else:
                parts.append((name, current_attribute(instance, name)))
        return tuple(parts)

    def learn(self, trace: Trace, output: Any) -> tuple[bool, str | None]:
        """Merge what a traced call read and wrote; return ``(grew, refusal)``: whether what a key holds
        (the data read) or what a hit replays (the writes) grew, and why the method cannot be cached, if so.
        Merged into copies, published whole: a hit iterating the lists and dicts it holds never sees them change."""
        with self.lock:
            draft = copy.copy(self)
            draft.data, draft.writes, draft.accumulators = [*self.data], [*self.writes], [*self.accumulators]
            draft.components = {**self.components}
            try:
                return draft._merge(trace, output)
            finally:
                self.accumulators, self.components, self.data = draft.accumulators, draft.components, draft.data
                self.writes, self.check_pending = draft.writes, draft.check_pending

    def _merge(self, trace: Trace, output: Any) -> tuple[bool, str | None]:
        """Merge a traced call into this draft (see :meth:`learn`)."""
        grew = per_call = False
        # What a call reads and then changes (a counter it bumps, a dict of counts, a list of timings it
        # appends to) is instrumentation: neither keyed nor replayed. Changed before the text encoder, a hit's
        # proof changes it too; first read after it, it cannot have shaped the encoder's input, and a hit leaves
        # it as it is. Read before the encoder and read or changed again after it (a cursor moved once encoded,
        # a count the output is scaled by), it is state a hit could not treat as a miss does. Where no encoder
        # was seen there is no proof: only a number (a counter) is instrumentation, the rest is keyed and
        # replayed as any data. A call that reads one and leaves it alone shows it is not instrumentation (a
        # value set once and kept, such as a crop offset computed on the first call): from then on it is keyed.
        changed = changed_writes(trace)
        mutated = mutated_in_place(trace)
        changing = [*mutated, *(name for name in changed if name in trace.reads)]
        self.accumulators[:] = [name for name in self.accumulators if name not in trace.reads or name in changing]
        for name in changing:
            if not trace.encoder_reached and type(trace.reads.get(name)) not in (int, float):
                if name in mutated:
                    return grew, f"changes self.{name} in place, which a hit could not repeat"
                continue
            changed_late = changed_after_encoder(trace, name)
            if trace.encoder_reached and read_early_and_late(trace, name, changed_late=changed_late):
                return (
                    grew,
                    f"changes self.{name}, read before its text encoder and again after: a hit could not repeat it",
                )
            if name not in self.accumulators and name not in self.data:
                self.accumulators.append(name)
        for name, value in trace.reads.items():
            if name in self.accumulators:
                continue
            kind = COMPONENT if name in trace.shared_objects else classify(name, value)
            if kind is COMPONENT and name not in self.components:
                self.components[name] = value  # a guard, not part of the key: the key did not grow
            elif kind is DATA and name not in self.data and name not in self.components:
                if type(value_identity(value)) is not Bypass:
                    self.data.append(name)
                    grew = True
                    # Data held since install (a template, a max length) is configuration; data set since is
                    # per-call state (stashed ids, pending conditioning), whose inference the first hit checks.
                    per_call = per_call or self.configuration.get(name, ABSENT) is not value
                elif self.configuration.get(name, ABSENT) is value:  # held since install: configuration
                    self.components[name] = value
                elif not trace.encoder_reached or name in trace.used_late:  # read after the encoder call too
                    return grew, f"reads self.{name} (a {type(value).__qualname__}), which cannot be keyed"
                # else: read before the encoder call only: in what reached the encoder, which a hit's proof compares
        changed = self.replayed(trace)
        why = unreplayable(changed, output)
        if why is not None:
            return grew, why
        for name in changed:
            if name not in self.writes:
                self.writes.append(name)
                grew = True
        if per_call or (grew and changed):
            self.check_pending = True  # the key came to hold per-call state or writes: its next hit is checked
        return grew, None
