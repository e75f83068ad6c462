"""What an encode read from its pipeline and wrote back, seen while it ran.

An encode may depend on more than its arguments: verl-omni's MiniMax-H3 adapter stashes a request's token ids on
the pipeline and calls ``encode_prompt(prompt="[pretokenized]")`` with the same arguments for every prompt. So, as an
incremental-computation framework memoizes what a query read, every call that encodes runs under a :class:`Trace`:
the instance's class is swapped, for that call and thread only, for a subclass whose ``__getattribute__`` /
``__setattr__`` note each attribute read and written (:mod:`.method_state` says what that means for a method).

What a read is worth to a key (:func:`classify`):

* a component (a module, a tokenizer, a processor, a scheduler, a config: objects loaded with the
  weights, whose changes the cache already follows through weight loads and sleeps) stands in the
  key by its attribute name, guarded by its identity;
* data (tensors, arrays, strings, numbers, containers of them) stands in the key by content;
* code (functions, bound methods), locks, events and loggers do not enter the key;
* anything else cannot be keyed: the method is not cached, and the reason names the attribute.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni_prompt_cache.keys.call_key import Bypass, value_identity

#: Marks an entry whose value carries the writes its encode made: ``(EFFECTS, output, writes)``.
EFFECTS = "prompt-embed-cache:effects"
#: How a written value that is (part of) the output is recorded: replayed from the served output.
FROM_OUTPUT = "output"
RECORDED_VALUE = "value"
ABSENT = ("prompt-embed-cache:absent",)  # an attribute not set (a key part no attribute value encodes to)


def is_absent(value: Any) -> bool:
    """Return True for :data:`ABSENT` (compared without comparing tensors)."""
    return type(value) is tuple and len(value) == 1 and type(value[0]) is str and value[0] == ABSENT[0]


COMPONENT, DATA = "component", "data"

_SKIPPED = ("__", "_prompt_embed_cache")  # names no key holds: dunders, the cache's own attributes on the pipeline

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
_LOCKS = (type(threading.Lock()), type(threading.RLock()), threading.Event, threading.Condition, threading.Semaphore)
_INFRASTRUCTURE: tuple[type, ...] = (*_LOCKS, logging.Logger)


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
    #: set at the call's first text-encoder call: what it read before is in what reached it (a proof compares it)
    encoder_reached: bool = False
    #: attributes first read after that point: only the key can hold them; and every attribute read after it
    read_late: set[str] = field(default_factory=set)
    used_late: set[str] = field(default_factory=set)
    #: attributes written after that point, and the content of those read before it, as it was at that point
    written_late: set[str] = field(default_factory=set)
    identities_at_encoder: dict[str, Any] = field(default_factory=dict)
    #: a proof run's (see :func:`traced`): the instance before the run, and as it was at its first encoder call
    before: Snapshot | None = None
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

    def undo_after_encoder(self, *, release: bool = False) -> None:
        """Put back what a proof run changed on the instance after its first encoder call (a hit replays the entry's
        writes); what its own code put back as it was before the run (a tokenizer swapped in and restored in a
        ``finally``) stays. ``release``: then drop the values this trace holds (stand-in data among them)."""
        if self.snapshot is not None:
            touched = {*self.reads, *self.writes, *self.overwritten, *self.read_identities}
            self.snapshot.restore(skip=self.numbers, unless_as=self.before, names=touched)
        self.undo_setters()
        if release:
            self.release()

    def release(self) -> None:
        """Drop the values this trace holds (a proof run's carry stand-in data: nothing of it may stay alive)."""
        self.reads, self.writes, self.overwritten, self.setters, self.snapshot = {}, {}, {}, {}, None
        self.numbers, self.before = {}, None

    def undo_setters(self) -> None:
        """Take back what this call set through properties, and the numbers it changed (by what it added)."""
        instance_dict = attributes_of(self.instance)
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
        """Note that the call reached its first text-encoder call (see encoder_gate.py)."""
        self.encoder_reached = True
        if self.before is not None:
            self.snapshot = Snapshot(self.instance)
        instance_dict = attributes_of(self.instance)
        self.identities_at_encoder = {
            name: value_identity(instance_dict.get(name, ABSENT)) for name in self.read_identities
        }

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
            if self.before is not None:
                self.note_number(name, before, value)


def current_attribute(instance: Any, name: str) -> Any:
    """Return attribute ``name`` as a read of it finds it now (a torch module's children, a class's plain data
    default), or ABSENT; never runs code."""
    attributes = attributes_of(instance)
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
    if name in attributes_of(instance):
        return _OWN
    if (kind, name) in _DESCRIPTORS:  # code (a method, a property): looked up once, as methods stay methods
        return None
    found = _class_attribute(kind, name)
    if hasattr(type(found), "__get__") and not is_absent(found):
        _DESCRIPTORS.add((kind, name))
    return None if is_absent(found) or hasattr(type(found), "__get__") else _SHARED


_DESCRIPTORS: set[tuple[type, str]] = set()  # (class, name): as many as the classes traced have methods


def attributes_of(instance: Any) -> dict[str, Any]:
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
        trace = getattr(_local, "trace", None)
        if trace is not None and trace.instance is self:  # _tracing(self), inlined: every attribute read passes here
            where = _state_kind(self, kind, name)
            if where is not None:
                trace.read(name, value, shared=where is _SHARED)
        return value

    return __getattribute__


def _noting_setattr(base_setattr: Callable[[Any, str, Any], None]) -> Callable[[Any, str, Any], None]:
    """Return a ``__setattr__`` that notes writes of instance state."""

    def __setattr__(self: Any, name: str, value: Any) -> None:
        trace = _tracing(self)
        before = attributes_of(self).get(name, ABSENT) if trace is not None else None
        if (
            trace is not None
            and (trace.encoder_reached or trace.setters_from_start)
            and name not in trace.setters
            and isinstance(_class_attribute(type(self), name), property)
        ):
            with contextlib.suppress(Exception):
                trace.setters[name] = object.__getattribute__(self, name)
        if trace is not None and name in trace.setters:
            trace.note_number(name, trace.setters[name], value)
        base_setattr(self, name, value)
        # Instance state only: a property's setter keeps its value elsewhere, and its reads of self are traced.
        if trace is not None and name in attributes_of(self):
            trace.write(name, value, before)

    return __setattr__


def _noting_delattr(base_delattr: Callable[[Any, str], None]) -> Callable[[Any, str], None]:
    """Return a ``__delattr__`` that notes a deletion as a write of :data:`ABSENT`."""

    def __delattr__(self: Any, name: str) -> None:
        trace = _tracing(self)
        before = attributes_of(self).get(name, ABSENT) if trace is not None else None
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
        self.values = dict(attributes_of(instance))
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
        now = attributes_of(self.instance)
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
def traced(instance: Any, *, proof_run: bool = False) -> Iterator[Trace]:
    """Record what this thread's code reads from and writes to ``instance`` inside the block; ``proof_run``: keep the
    instance as it was before and at its first encoder call too (see :meth:`Trace.undo_after_encoder`)."""
    outer = getattr(_local, "trace", None)
    trace = Trace(instance, before=Snapshot(instance) if proof_run else None)
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


def unpack(value: Any, instance: Any) -> Any:
    """Return the output an entry holds, replaying the writes its encode made onto ``instance``."""
    if not is_packed(value):
        return value
    _, output, recorded = value
    for name, how, payload in recorded:
        if how == FROM_OUTPUT:
            written = output
            for index in payload:
                written = written[index]
        else:
            written = payload
        if is_absent(written):
            if name in attributes_of(instance):
                delattr(instance, name)
            continue
        setattr(instance, name, written)
    return output


def held_state(self: Any, instance: Any) -> tuple | Bypass | None:
    """Return the part of a call's key that the instance holds now (None: nothing), or a Bypass when a
    component was replaced (then the method is learned again)."""
    for name, component in self.components.items():
        if current_attribute(instance, name) is not component:
            return Bypass(f"self.{name} was replaced since {self.name} was observed")
    if not self.data:
        return None
    return tuple((name, current_attribute(instance, name)) for name in self.data)
