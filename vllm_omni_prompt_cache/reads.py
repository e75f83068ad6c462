"""What an encode read from its pipeline and wrote back, seen while it ran.

An encode method may depend on more than its arguments: verl-omni's MiniMax-H3 adapter stashes a
request's token ids on the pipeline and then calls ``encode_prompt(prompt="[pretokenized]")`` with
the same arguments for every prompt. Keying such a call on its arguments alone serves one prompt's
embedding for another. So, like an incremental-computation framework that memoizes what a query
read rather than what it was handed, every call that encodes runs under a :class:`Trace`: the
pipeline instance's class is swapped, for that call and that thread only, for a subclass whose
``__getattribute__`` / ``__setattr__`` note each instance attribute read and written.

What a read is worth to a key (:func:`classify`):

* a component (a module, a tokenizer, a processor, a scheduler, a config: objects loaded with the
  weights, whose changes the cache already follows through weight loads and sleeps) stands in the
  key by its attribute name, guarded by its identity;
* data (tensors, arrays, strings, numbers, containers of them) stands in the key by content;
* code (functions, bound methods), locks, events and loggers do not enter the key;
* anything else cannot be keyed: the method is not cached, and the reason names the attribute.

A write is replayed on a hit (:func:`pack` / :func:`unpack`): an encode that stashes its result
for the forward (UniRL's MiniMax-H3 pipeline keeps ``_rl_text_embeddings``) leaves the pipeline as a
miss would.

:class:`MethodState`, the dependency record of one wrapped method, is filled from those traces
(:meth:`MethodState.learn`): what its key holds beyond the arguments, what a hit replays, how it was
found, whether its first hit still has to be checked, or why it is not cached. Nothing here knows
about vLLM-Omni.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import inspect
import logging
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni_prompt_cache.keys import Bypass, value_identity

#: Marks an entry whose value carries the writes its encode made: ``(EFFECTS, output, writes)``.
EFFECTS = "prompt-embed-cache:effects"
#: How a written value that is (part of) the output is recorded: replayed from the served output.
_FROM_OUTPUT = "output"
_VALUE = "value"
#: A dependency's value when the attribute is not set (a key part no attribute value encodes to).
ABSENT = ("prompt-embed-cache:absent",)


def is_absent(value: Any) -> bool:
    """Return True for :data:`ABSENT` (compared without comparing tensors)."""
    return type(value) is tuple and len(value) == 1 and type(value[0]) is str and value[0] == ABSENT[0]


COMPONENT = "component"
DATA = "data"

#: Names no key holds: dunders, and the cache's own attributes on the pipeline.
_SKIPPED = ("__", "_prompt_embed_cache")

_local = threading.local()  # .trace: the Trace this thread records into, if any
_swap_lock = threading.Lock()
_tracing_classes: dict[type, type] = {}
_swapped: dict[int, list] = {}  # id(instance) -> [original class, depth]


def _is_component(value: Any) -> bool:
    """Return True for objects loaded with the weights: modules, what ``from_pretrained`` / ``from_config`` build."""
    if isinstance(value, torch.nn.Module):
        return True
    kind = type(value)
    return any(hasattr(kind, name) for name in ("from_pretrained", "save_pretrained", "from_config"))


#: Objects that coordinate or report a call but hold nothing an encode computes with: locks, events,
#: conditions, semaphores, loggers. Reading one is not reading state.
_INFRASTRUCTURE: tuple[type, ...] = (
    type(threading.Lock()),
    type(threading.RLock()),
    threading.Event,
    threading.Condition,
    threading.Semaphore,
    logging.Logger,
)


def classify(name: str, value: Any) -> str | None:
    """Return how an instance attribute read stands in a key: COMPONENT, DATA, or None (code: not at all).

    Whether a DATA value can be keyed is found by keying it (see :meth:`MethodState.learn`).
    """
    if isinstance(value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, *_INFRASTRUCTURE)):
        return None
    if _is_component(value):
        return COMPONENT
    return DATA


@dataclass
class Trace:
    """What one call read from and wrote to one pipeline instance, on one thread."""

    instance: Any
    #: name -> value before the call, for every attribute read before this call wrote it
    reads: dict[str, Any] = field(default_factory=dict)
    #: name -> the content identity at that first read (to find in-place mutation afterwards)
    read_identities: dict[str, Any] = field(default_factory=dict)
    #: name -> last value written (ABSENT: deleted)
    writes: dict[str, Any] = field(default_factory=dict)
    #: name -> value before the call, for attributes written before any read
    overwritten: dict[str, Any] = field(default_factory=dict)
    #: class attributes read that hold objects no key can hold by content: guarded by identity
    shared_objects: set[str] = field(default_factory=set)
    #: set once the call reached its first text-encoder call (see encoder_inputs.py); what it read before is
    #: in what reached the encoder, which a hit's proof compares
    encoder_reached: bool = False
    #: attributes first read after that point: only the key can hold them; and every attribute read after it
    read_late: set[str] = field(default_factory=set)
    used_late: set[str] = field(default_factory=set)
    #: attributes written after that point, and the content of those read before it, as it was at that point
    written_late: set[str] = field(default_factory=set)
    identities_at_encoder: dict[str, Any] = field(default_factory=dict)
    #: a proof run's: the instance as it was at the first encoder call (see :meth:`undo_after_encoder`)
    snapshot_at_encoder: bool = False
    snapshot: Snapshot | None = None
    #: properties set through their setter (their value lives elsewhere), with what they read before: after the
    #: encoder call, or from the start when ``setters_from_start`` (a reference run, undone whole)
    setters_from_start: bool = False
    setters: dict[str, Any] = field(default_factory=dict)
    #: numbers this call set (attributes after the encoder call, properties): the value before its first write and
    #: its last, so that undoing them takes back this call's change only (other threads may count meanwhile)
    numbers: dict[str, list[Any]] = field(default_factory=dict)

    def note_number(self, name: str, before: Any, value: Any) -> None:
        if _is_number(value) and (name in self.numbers or _is_number(before)):
            self.numbers.setdefault(name, [before, value])[1] = value

    def undo_after_encoder(self, *, release: bool = False, since: Snapshot | None = None) -> None:
        """Put back what the call changed on the instance after its first encoder call: a proof run answered by
        stand-ins leaves nothing behind (a hit then replays the entry's writes, as it always does). ``since``: the
        instance before the call; what the call's own code put back as it was (a tokenizer swapped in and restored
        in a ``finally``) stays. ``release``: then drop the values this trace holds (see :meth:`release`)."""
        if self.snapshot is not None:
            touched = {*self.reads, *self.writes, *self.overwritten, *self.read_identities}
            self.snapshot.restore(skip=self.numbers, unless_as=since, names=touched)
        self.undo_setters()
        if release:
            self.release()

    def release(self) -> None:
        """Drop the values this trace holds (a proof run's carry stand-in data: nothing of it may stay alive)."""
        self.reads, self.writes, self.overwritten, self.setters, self.snapshot = {}, {}, {}, {}, None
        self.numbers = {}

    def undo_setters(self) -> None:
        """Take back what this call set through properties, and the numbers it changed (by what it added)."""
        instance_dict = _instance_dict(self.instance)
        for name, (before, last) in self.numbers.items():
            with contextlib.suppress(Exception):
                if name in self.setters:
                    setattr(self.instance, name, getattr(self.instance, name) - (last - before))
                elif _is_number(instance_dict.get(name)):
                    instance_dict[name] = instance_dict[name] - (last - before)
        for name, before in self.setters.items():
            if name not in self.numbers:
                with contextlib.suppress(Exception):
                    setattr(self.instance, name, before)

    def reach_encoder(self) -> None:
        """Note that the call reached its first text-encoder call (see encoder_inputs.py)."""
        self.encoder_reached = True
        if self.snapshot_at_encoder:
            self.snapshot = Snapshot(self.instance)
        instance_dict = _instance_dict(self.instance)
        self.identities_at_encoder = {
            name: value_identity(instance_dict.get(name, ABSENT)) for name in self.read_identities
        }

    def changed_state(self) -> bool:
        """Return True when the call has written an attribute, or changed one it read in place, so far."""
        return bool(self.writes) or bool(self.mutated())

    def read_early_and_late(self, name: str, *, changed_late: bool) -> bool:
        """Return True when ``name`` was read before the text-encoder call and read (or ``changed_late``) after it."""
        return name not in self.read_late and (name in self.used_late or changed_late)

    def changed_after_encoder(self, name: str) -> bool:
        """Return True when the call wrote ``name``, or changed it in place, after reaching its text encoder."""
        if name in self.written_late:
            return True
        at_encoder = self.identities_at_encoder.get(name)
        return at_encoder is not None and value_identity(_instance_dict(self.instance).get(name, ABSENT)) != at_encoder

    def read(self, name: str, value: Any, *, shared: bool = False) -> None:
        """Note a read of ``name``; ``shared``: a class attribute (an object there is configuration: keyed by
        identity when its content cannot be keyed)."""
        if self.encoder_reached:
            self.used_late.add(name)
        if name in self.reads or name in self.writes or name.startswith(_SKIPPED):
            return
        kind = classify(name, value)
        if kind is None:
            return
        self.reads[name] = value
        if self.encoder_reached:
            self.read_late.add(name)
        if kind is DATA:
            identity = value_identity(value)
            if shared and type(identity) is Bypass:
                self.shared_objects.add(name)
            else:
                self.read_identities[name] = identity

    def write(self, name: str, value: Any, before: Any) -> None:
        if name.startswith(_SKIPPED):
            return
        if name not in self.reads and name not in self.writes:
            self.overwritten[name] = before
        self.writes[name] = value
        if self.encoder_reached:
            self.written_late.add(name)
            if self.snapshot_at_encoder:
                self.note_number(name, before, value)

    def changed(self) -> dict[str, Any]:
        """Return the writes that left an attribute other than it was before the call (a value swapped in
        and restored, as verl-omni's MiniMax-H3 adapter does with its tokenizer, is no write)."""
        return {
            name: value
            for name, value in self.writes.items()
            if value is not self.reads.get(name, self.overwritten.get(name, ABSENT))
            and not (is_absent(value) and is_absent(self.overwritten.get(name, ABSENT)))
        }

    def mutated(self) -> list[str]:
        """Return the data attributes this call read and then changed in place (not by assignment)."""
        changed = []
        instance_dict = _instance_dict(self.instance)
        for name, identity in self.read_identities.items():
            if name in self.writes or type(identity) is Bypass:
                continue
            if value_identity(instance_dict.get(name, ABSENT)) != identity:
                changed.append(name)
        return changed


def current_attribute(instance: Any, name: str) -> Any:
    """Return attribute ``name`` as a read of it finds it now (a torch module's children, a class's plain data
    default), or ABSENT; never runs code."""
    attributes = _instance_dict(instance)
    if name in attributes:
        return attributes[name]
    for store in ("_modules", "_parameters", "_buffers"):
        held = attributes.get(store)
        if held is not None and name in held:
            return held[name]
    found = _class_attribute(original_class(instance), name)
    return ABSENT if hasattr(type(found), "__get__") else found


def is_packed(value: Any) -> bool:
    """Return True for an entry value that carries writes to replay (see :func:`pack`)."""
    return type(value) is tuple and len(value) == 3 and type(value[0]) is str and value[0] == EFFECTS


def _class_attribute(kind: type, name: str) -> Any:
    """Return ``name`` as ``kind``'s MRO defines it, without running descriptors (ABSENT if none does)."""
    for ancestor in kind.__mro__:
        if name in ancestor.__dict__:
            return ancestor.__dict__[name]
    return ABSENT


_OWN, _SHARED = "own", "shared"


def _state_kind(instance: Any, kind: type, name: str) -> str | None:
    """Return how reading ``name`` reads state: ``_OWN`` (an instance attribute), ``_SHARED`` (a class
    attribute that is plain data: a default the instance may shadow later), or None (code, or a
    descriptor such as a property, whose own reads of the instance are traced)."""
    if name in _instance_dict(instance):
        return _OWN
    found = _class_attribute(kind, name)
    return None if is_absent(found) or hasattr(type(found), "__get__") else _SHARED


def instance_attributes(instance: Any) -> dict[str, Any]:
    """Return a shallow copy of ``instance``'s own attributes (what it holds now; {} if it has no ``__dict__``)."""
    return dict(_instance_dict(instance))


def _instance_dict(instance: Any) -> dict[str, Any]:
    try:
        return object.__getattribute__(instance, "__dict__")
    except AttributeError:
        return {}


def _tracing_class(kind: type) -> type:
    """Return a subclass of ``kind`` that notes instance attribute reads and writes into the thread's trace."""
    tracing = _tracing_classes.get(kind)
    if tracing is not None:
        return tracing
    base_getattr = getattr(kind, "__getattr__", None)
    namespace: dict[str, Any] = {
        "__getattribute__": _noting_getattribute(kind, notes_absent=base_getattr is None),
        "__setattr__": _noting_setattr(kind.__setattr__),
        "__delattr__": _noting_delattr(kind.__delattr__),
        "__slots__": (),  # the same layout as ``kind``, so an instance's class may be swapped to it
        "__module__": kind.__module__,
        "__qualname__": kind.__qualname__,
    }
    if base_getattr is not None:  # torch modules: submodules, parameters and buffers (components all)
        namespace["__getattr__"] = _noting_getattr(base_getattr)
    tracing = type(kind.__name__, (kind,), namespace)
    _tracing_classes[kind] = tracing
    return tracing


def _tracing(instance: Any) -> Trace | None:
    """Return the trace this thread records ``instance``'s attributes into, if any."""
    trace = getattr(_local, "trace", None)
    return trace if trace is not None and trace.instance is instance else None


def _noting_getattribute(kind: type, *, notes_absent: bool) -> Callable[[Any, str], Any]:
    """Return ``kind``'s ``__getattribute__`` noting reads of state; ``notes_absent``: a missing attribute is
    noted too (no ``__getattr__`` of the class will note it)."""
    base_getattribute = kind.__getattribute__

    def __getattribute__(self: Any, name: str) -> Any:
        try:
            value = base_getattribute(self, name)
        except AttributeError:
            trace = _tracing(self)
            if trace is not None and notes_absent:
                trace.read(name, ABSENT)  # absent is an input too: a later call may find it set
            raise
        trace = _tracing(self)
        if trace is not None:
            where = _state_kind(self, kind, name)
            if where is not None:
                trace.read(name, value, shared=where is _SHARED)
        return value

    return __getattribute__


def _noting_setattr(base_setattr: Callable[[Any, str, Any], None]) -> Callable[[Any, str, Any], None]:
    """Return a ``__setattr__`` that notes writes of instance state."""

    def __setattr__(self: Any, name: str, value: Any) -> None:
        trace = _tracing(self)
        before = _instance_dict(self).get(name, ABSENT) if trace is not None else None
        if (
            trace is not None
            and (trace.encoder_reached or trace.setters_from_start)
            and name not in trace.setters
            and isinstance(inspect.getattr_static(type(self), name, None), property)
        ):
            with contextlib.suppress(Exception):
                trace.setters[name] = object.__getattribute__(self, name)
        if trace is not None and name in trace.setters:
            trace.note_number(name, trace.setters[name], value)
        base_setattr(self, name, value)
        # Instance state only: a property's setter keeps its value elsewhere, and its reads of self are traced.
        if trace is not None and name in _instance_dict(self):
            trace.write(name, value, before)

    return __setattr__


def _noting_delattr(base_delattr: Callable[[Any, str], None]) -> Callable[[Any, str], None]:
    """Return a ``__delattr__`` that notes a deletion as a write of :data:`ABSENT`."""

    def __delattr__(self: Any, name: str) -> None:
        trace = _tracing(self)
        before = _instance_dict(self).get(name, ABSENT) if trace is not None else None
        base_delattr(self, name)
        if trace is not None:
            trace.write(name, ABSENT, before)

    return __delattr__


def _noting_getattr(base_getattr: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    """Return a ``__getattr__`` (torch modules' submodules, parameters, buffers) that notes what it finds."""

    def __getattr__(self: Any, name: str) -> Any:
        trace = _tracing(self)
        try:
            value = base_getattr(self, name)
        except AttributeError:
            if trace is not None:
                trace.read(name, ABSENT)
            raise
        if trace is not None:
            trace.read(name, value)
        return value

    return __getattr__


_CONTAINERS = (list, dict, set, collections.deque, bytearray, collections.OrderedDict, collections.defaultdict)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


class Snapshot:
    """An instance's attributes at one moment, to put back: rebound ones set back, added ones removed, and
    containers changed in place (a list of timings, a dict of counts) refilled."""

    def __init__(self, instance: Any) -> None:
        self.instance = instance
        self.values = dict(_instance_dict(instance))
        self.copies = {
            name: copy.copy(value)
            for name, value in self.values.items()
            if type(value) in _CONTAINERS and name not in _MODULE_INTERNALS
        }

    def restore(
        self,
        skip: Mapping[str, Any] = types.MappingProxyType({}),
        unless_as: Snapshot | None = None,
        names: Iterable[str] | None = None,
    ) -> None:
        """Put back what changed since: only ``names`` when given (what one thread's calls touched; other threads'
        attributes stay as they are), never those in ``skip`` (numbers the caller takes back by difference), nor what
        is now as it was in ``unless_as`` (an earlier snapshot: put back already)."""
        now = _instance_dict(self.instance)
        earlier = unless_as.values if unless_as is not None else {}
        wanted = set(now) | set(self.values) if names is None else set(names)
        for name in wanted:
            if name in skip or name.startswith(_SKIPPED):
                continue
            current, value = now.get(name, ABSENT), self.values.get(name, ABSENT)
            if current is value or (unless_as is not None and current is earlier.get(name, ABSENT)):
                continue
            if is_absent(value):
                del now[name]
            else:
                now[name] = value
        for name, saved in self.copies.items():
            if name not in wanted or _same_items(self.values[name], saved):
                continue
            if (
                unless_as is not None
                and name in unless_as.copies
                and _same_items(self.values[name], unless_as.copies[name])
            ):
                continue
            refill(self.values[name], saved)


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def _same_items(container: Any, saved: Any) -> bool:
    """Return True when ``container`` holds the very items ``saved`` holds (compared by identity, in order)."""
    if len(container) != len(saved):
        return False
    if isinstance(container, dict):
        return all(key in saved and saved[key] is item for key, item in container.items())
    if isinstance(container, (set, bytearray)):
        return container == saved
    return all(item is kept for item, kept in zip(container, saved, strict=True))


def refill(container: Any, saved: Any) -> None:
    """Put ``saved``'s items back into ``container`` in place (a list, dict, set, deque or bytearray)."""
    if isinstance(container, dict):
        container.clear()
        container.update(saved)
    elif isinstance(container, (set, collections.deque)):
        container.clear()
        (container.update if isinstance(container, set) else container.extend)(saved)
    else:
        container[:] = saved


class CannotTrace(Exception):
    """The instance's class cannot be swapped for a tracing one (slots, a builtin type)."""


@contextmanager
def traced(instance: Any) -> Iterator[Trace]:
    """Record what this thread's code reads from and writes to ``instance`` inside the block."""
    outer = getattr(_local, "trace", None)
    trace = Trace(instance)
    with _swap_lock:
        held = _swapped.get(id(instance))
        if held is None:
            original = type(instance)
            try:
                object.__setattr__(instance, "__class__", _tracing_class(original))
            except TypeError as error:
                raise CannotTrace(f"{original.__qualname__} instances cannot be traced ({error})") from error
            _swapped[id(instance)] = [original, 1]
        else:
            held[1] += 1
    _local.trace = trace
    try:
        yield trace
    finally:
        _local.trace = outer
        with _swap_lock:
            held = _swapped[id(instance)]
            held[1] -= 1
            if held[1] == 0:
                object.__setattr__(instance, "__class__", held[0])
                del _swapped[id(instance)]


def original_class(instance: Any) -> type:
    """Return ``instance``'s own class, also while a trace has swapped it."""
    held = _swapped.get(id(instance))
    return held[0] if held is not None else type(instance)


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
        recorded.append((name, _FROM_OUTPUT, list(path)) if path is not None else (name, _VALUE, value))
    return (EFFECTS, output, tuple(recorded))


def unpack(value: Any, instance: Any) -> Any:
    """Return the output an entry holds, replaying the writes its encode made onto ``instance``."""
    if not is_packed(value):
        return value
    _, output, recorded = value
    for name, how, payload in recorded:
        if how == _FROM_OUTPUT:
            written = output
            for index in payload:
                written = written[index]
        else:
            written = payload
        if is_absent(written):
            if name in _instance_dict(instance):
                delattr(instance, name)
            continue
        setattr(instance, name, written)
    return output


def unreplayable(writes: Mapping[str, Any], output: Any) -> str | None:
    """Return why a hit could not replay ``writes`` (a value that is not data nor part of the output), or None."""
    for name, value in writes.items():
        if _output_path(value, output) is not None or is_absent(value):
            continue
        if classify(name, value) is not DATA or type(value_identity(value)) is Bypass:
            return f"writes self.{name} (a {type(value).__qualname__}), which a hit could not replay"
    return None


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
        return {name: value for name, value in trace.changed().items() if name not in self.accumulators}

    def state_argument(self, instance: Any) -> tuple | Bypass | None:
        """Return the part of a call's key that the instance holds now (None: nothing), or a Bypass when a
        component was replaced (then the method is learned again)."""
        for name, component in self.components.items():
            if current_attribute(instance, name) is not component:
                return Bypass(f"self.{name} was replaced since {self.name} was observed")
        if not self.data:
            return None
        return tuple((name, current_attribute(instance, name)) for name in self.data)

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
        changed = trace.changed()
        mutated = trace.mutated()
        changing = [*mutated, *(name for name in changed if name in trace.reads)]
        self.accumulators[:] = [name for name in self.accumulators if name not in trace.reads or name in changing]
        for name in changing:
            if not trace.encoder_reached and type(trace.reads.get(name)) not in (int, float):
                if name in mutated:
                    return grew, f"changes self.{name} in place, which a hit could not repeat"
                continue
            if trace.encoder_reached and trace.read_early_and_late(
                name, changed_late=trace.changed_after_encoder(name)
            ):
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
