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
miss would. Nothing here knows about vLLM-Omni.
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable, Iterator, Mapping
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

    def reach_encoder(self) -> None:
        """Note that the call reached its first text-encoder call (see encoder_inputs.py)."""
        self.encoder_reached = True
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
