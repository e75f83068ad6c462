"""What the text encoders were given and what the code around them did: recorded when an entry is encoded,
proven again before a hit is served.

An adapter can keep a request's token ids anywhere (its tokenizer, a helper object, a ``ContextVar``), but the
ids end up as the inputs of a text encoder's forward: the one input no adapter can hide. So every encode that
makes an entry runs under an :class:`EncoderGate`, which records every outermost call into a text encoder (see
:mod:`.text_encoders`): a digest of its inputs and the structure of its output; then the method runs once more
with each call answered by a stand-in (:mod:`.stand_ins`), and the digest of what it returns completes the
entry's :class:`Record` (kept with the entry by :func:`~.call_key.seal`). A hit runs the method the same way: every call
must get its recorded inputs, in order, and the run must return what the recorded run returned; a first call
with other inputs goes on through the encoder (a miss, kept beside the entry: :func:`~.call_key.with_encoder_input`).
An encode that reaches no encoder the gate sees has no record: served on its key alone (``key_only_hits``).
Design: docs/design.md, "Proven hits". Nothing here knows about vLLM-Omni.
"""

from __future__ import annotations

import functools
import json
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from vllm_omni_prompt_cache.encoders.text_encoders import (
    TABLES_NOTED,
    child_modules,
    is_text_encoder,
    modules_held_by,
    paths_to_embeddings,
)
from vllm_omni_prompt_cache.keys.call_key import Bypass, input_digest, unseal
from vllm_omni_prompt_cache.keys.method_state import changed_state
from vllm_omni_prompt_cache.proof.stand_ins import ProofGuard, StandIns, interned, structure_of

#: Why a hit could not be proven (the ``reason`` label of ``unproven_reasons``).
DIFFERED = "another input reached the text encoder"
DIFFERED_LATER = "another input reached a later text-encoder call"
DIFFERED_AFTER = "the code after the text encoder did otherwise with what it returned"
UNRECORDED = "the entry holds no encoder-input record"
#: What a proof run expects for an entry without a record, of a method whose encodes make records (a file
#: from another version, an entry made while a hook was being registered): no digest equals it.
NO_RECORD = ""
UNREADABLE = "the encoder's inputs cannot be keyed"
#: Why a found entry was not served, yet nothing was encoded: the method returned without calling an encoder
#: (its own cache, a precomputed input); its own result is served, counted as a bypass.
NOT_REACHED = "the call reached no text encoder: served by the method itself"


class Refuted(BaseException):
    """Raised out of an answered run when it must stop: a later encoder call's inputs differ (stand-ins were
    handed out already), or the first differs while the encoders wait off the device. The caller encodes again.
    A BaseException, so that no handler of encoder failures takes it."""


class CallRecord(NamedTuple):
    """One encoder call of an encode: which module, the digest of its inputs, the structure of its output."""

    path: str
    inputs: str
    output: Any


class Record(NamedTuple):
    """What an entry's encode did at its text encoders: each call, and the digest of what the encode returned when
    each call was answered by its stand-in."""

    calls: tuple[CallRecord, ...]
    result: str

    @property
    def first_input(self) -> str:
        return self.calls[0].inputs

    def spell(self) -> str:
        """Return the record as the string an entry keeps (entries hold plain strings and tensors)."""
        return json.dumps([[list(call) for call in self.calls], self.result], separators=(",", ":"))


@functools.lru_cache(maxsize=4096)
def parse(spelled: str) -> Record | None:
    """Return the :class:`Record` an entry keeps, or None for one no proof can use (another version's)."""
    try:
        calls, result = json.loads(spelled)
        return Record(tuple(CallRecord(path, inputs, interned(output)) for path, inputs, output in calls), result)
    except (ValueError, TypeError):
        return None


def record_of(name: str, args: tuple, kwargs: dict) -> str | Bypass:
    """Return the digest of a call of encoder module ``name`` with ``args`` and ``kwargs``, or why it has none."""
    return input_digest((name, args, kwargs))


#: What :meth:`GateRun.answer` returns for a call that goes on through the real encoder.
GO_ON = object()


@dataclass
class GateRun:
    """One run of a method under the gate, on one thread: each encoder call it made, and what a proof expects."""

    expected: Record | None = None  # a proof's or a reference run's record: its encoder calls are answered
    abort_on_refute: bool = False
    reference: bool = False  # the run that completes a miss's record: nothing to look up, nothing to go on to
    guard: ProofGuard | None = None
    stand_ins: StandIns | None = None  # the gate's: the numbers its answers copy
    #: each encoder call no other encloses: [module path, digest of its inputs (or why none), its output's structure]
    calls: list[list[Any]] = field(default_factory=list)
    depth: int = 0  # how deep in watched modules the run is now (recording)
    reached_inside: bool = False  # a watched module ran inside the encoder method being recorded
    on_refute: Callable[[], None] | None = None  # told when the run goes on through the encoder
    #: ``alternative(first_input)``: ``(True, entry)`` for an entry made with that first input, else ``(False, None)``
    alternative: Callable[[str], tuple[bool, Any]] | None = None
    trace: Any = None  # the run's :class:`~.reads.Trace`, told when the encoder is reached
    beside: Any = None  # the entry kept beside the one looked up, whose record the run was proven against
    went_on: bool = False  # a proof whose first encoder input differed went on through the encoder: a miss's encode
    differed: str | None = None  # why an answered run stopped (see Refuted)
    nested: bool = False  # a wrapped method called from another's encode: the outer run records
    grew: bool = False  # the key grew while it ran (set by the caller once the run has been learned from)
    whole: str | None = None  # the record an entry made by this run keeps (set once its reference run is done)
    unprovable: str | None = None  # why no hit of its method could be proven (set by its reference run)

    @property
    def kept_record(self) -> str | None:
        """Return the record an entry made by this run keeps (None: none to prove a hit with)."""
        return self.whole

    @property
    def answering(self) -> bool:
        return self.expected is not None and not self.went_on

    @property
    def record(self) -> str | Bypass | None:
        """Return the digest of what reached the run's first encoder call (None: none was reached)."""
        return self.first_input

    @property
    def first_input(self) -> str | Bypass | None:
        """Return the digest of what reached the run's first encoder call (None: none was reached)."""
        return self.calls[0][1] if self.calls else None

    @property
    def unreadable(self) -> Bypass | None:
        """Return why an encoder call's inputs could not be keyed, if one could not."""
        return next((call[1] for call in self.calls if type(call[1]) is Bypass), None)

    @property
    def recorded(self) -> Record | None:
        """Return the encoder calls a real encode made, ready for its reference run (None: nothing to prove with)."""
        if (
            not self.calls
            or self.nested
            or any(type(inputs) is not str or output is None for _, inputs, output in self.calls)
        ):
            return None
        return Record(tuple(CallRecord(*call) for call in self.calls), "")

    @property
    def why_unproven(self) -> str:
        """Return why this proof run did not prove its hit."""
        if not self.calls:
            return NOT_REACHED
        if self.unreadable is not None:
            return UNREADABLE
        if self.differed is not None:
            return self.differed
        return DIFFERED

    def answer(self, path: str, args: tuple, kwargs: dict) -> Any:
        """Answer an encoder call of an answered run with its stand-in, or say why it cannot be (see the module
        docstring); :data:`GO_ON` when the call goes on through the encoder. The run's guard does not watch this
        (the cache's own keying and stand-ins; a stand-in's tensors are noted as stand-in data)."""
        if self.guard is None:
            return self._answer(path, args, kwargs)
        with self.guard.paused():
            return self._answer(path, args, kwargs)

    def _answer(self, path: str, args: tuple, kwargs: dict) -> Any:
        index = len(self.calls)
        inputs = record_of(path, args, kwargs)
        if index == 0 and self.trace is not None:
            self.trace.reach_encoder()
        expected = self.expected
        assert expected is not None
        if (
            index == 0
            and self.alternative is not None
            and type(inputs) is str
            and not _matches(expected, 0, path, inputs)
        ):
            found, entry = self.alternative(inputs)
            beside = parse(unseal(entry)[1] or "") if found else None
            if beside is not None:  # an entry made with the very input that reaches the encoder now
                self.expected, self.beside, expected = beside, entry, beside
        if _matches(expected, index, path, inputs):
            structure = expected.calls[index].output
            self.calls.append([path, inputs, structure])
            assert self.stand_ins is not None, "an answered run is made by its gate, which hands it its stand-ins"
            return self.stand_ins.make(structure, str(index), _device_of(args, kwargs), self.guard)
        if index == 0 and not self.reference:
            # Encoders waiting off the device: encode again, placed, unless this run already changed pipeline state,
            # which a second run would change twice; then it goes on, the encoders placed at their forward.
            if self.abort_on_refute and not (self.trace is not None and changed_state(self.trace)):
                self.differed = DIFFERED
                raise Refuted
            self.went_on = True
            if self.guard is not None:
                self.guard.watching = False  # a miss's encode from here: its draws are a miss's
            if self.on_refute is not None:
                self.on_refute()
            return GO_ON
        self.differed = DIFFERED if index == 0 else DIFFERED_LATER
        raise Refuted


def _device_of(args: tuple, kwargs: dict) -> torch.device | None:
    """Return the device of the first tensor a call is handed (where its stand-in's tensors belong), if any."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _matches(expected: Record, index: int, path: str, inputs: str | Bypass) -> bool:
    return index < len(expected.calls) and expected.calls[index].path == path and expected.calls[index].inputs == inputs


class EncoderGate:
    """Hooks on the pipeline's text encoders (:func:`~.text_encoders.text_encoders`, and every module between each
    and its token tables) that record each encoder call of a run, and answer them in a proof run.

    Recording: forward pre- and post-hooks, first in each module's list, which cost one thread-local read outside
    a run. Answering: for the length of an answered run, the hooked modules' class is swapped for a subclass whose
    ``__call__`` hands this thread's call its stand-in before any hook (an offload's, the cache's own placement) or
    the forward runs; other threads' calls go through as before.
    """

    def __init__(self, pipeline: Any) -> None:
        self._children = functools.partial(child_modules, pipeline)  # the pipeline's child modules now, by name
        self._held = modules_held_by(pipeline)  # the live mapping they are among: looked at on every run
        self._local = threading.local()  # .run: the GateRun of this thread, if any
        self._handles: list[Any] = []
        self._hooked: dict[str, int] = {}  # child name -> id of the module hooked
        self._children_seen: dict[str, int] = {}  # every child's id when the gate last looked
        #: id of each hooked module -> (its path, itself, whether it is a text encoder itself, not a part of one)
        self._paths: dict[int, tuple[str, torch.nn.Module, bool]] = {}
        self._lock = threading.Lock()
        self.stand_ins = StandIns()  # what answers this pipeline's encoder calls in its proof and reference runs
        self.refresh()

    def refresh(self) -> None:
        """Hook the text encoders the pipeline holds now (again, if a child module was replaced since)."""
        held = dict(self._held)  # a copy made at once (see modules_held_by): others may add attributes meanwhile
        seen = {name: id(value) for name, value in held.items() if isinstance(value, torch.nn.Module)}
        seen[""] = TABLES_NOTED[0]  # a token table recognised since: look again
        if seen == self._children_seen:  # the common case, on every run: nothing was replaced
            return
        with self._lock:
            children = {name: module for name, module in self._children().items() if is_text_encoder(module)}
            if {name: id(module) for name, module in children.items()} == self._hooked:
                self._children_seen = seen  # another child changed (a DiT reloaded): the hooks stand
                return
            for handle in self._handles:
                handle.remove()
            self._handles, paths = [], {}
            for name, module in children.items():
                for path, part in paths_to_embeddings(name, module):
                    before, after = self._hooks(path)
                    self._handles.append(part.register_forward_pre_hook(before, with_kwargs=True, prepend=True))
                    self._handles.append(
                        part.register_forward_hook(after, with_kwargs=True, prepend=True, always_call=True)
                    )
                    paths[id(part)] = (path, part, part is module)
            self._paths = paths
            self._hooked = {name: id(module) for name, module in children.items()}
            self._children_seen = seen  # last: until the hooks are in place, every run takes the lock here

    def remove(self) -> None:
        with self._lock:
            for handle in self._handles:
                handle.remove()
            self._handles, self._hooked, self._children_seen, self._paths = [], {}, {}, {}

    @contextmanager
    def run(
        self,
        expected: Record | None = None,
        *,
        abort_on_refute: bool = False,
        reference: bool = False,
        guard: ProofGuard | None = None,
    ) -> Iterator[GateRun]:
        """Run the block as one gate run on this thread: each encoder call is recorded into the yielded
        :class:`GateRun`; with ``expected``, each is answered by its stand-in (see :meth:`GateRun.answer`). A run
        inside a run records nothing. The encoders the pipeline holds now are hooked first (see :meth:`refresh`)."""
        outer = getattr(self._local, "run", None)
        if outer is None:
            self.refresh()
        gate_run = GateRun(expected, abort_on_refute, reference, guard, self.stand_ins)
        if outer is not None:  # a wrapped method called from another's encode: the outer run records
            gate_run.nested = True
            gate_run.expected = None
        # Answered or recorded, a call of one of an encoder's own methods (``encode_ids``) counts as an encoder call.
        answered = list(self._paths.values()) if outer is None else []
        swapped: list[tuple[str, torch.nn.Module, bool]] = []
        try:
            self._local.run = gate_run if outer is None else outer
            _answer_calls(answered, self._local, swapped)
            yield gate_run
        finally:
            _stop_answering(swapped, self._local)
            self._local.run = outer

    def _hooks(self, path: str) -> tuple[Callable[..., None], Callable[..., None]]:
        local = self._local

        def before_encoder(module: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> None:
            gate_run = getattr(local, "run", None)
            if gate_run is None or kwargs is None or gate_run.answering:  # None: torch is still registering it
                return
            gate_run.depth += 1
            if gate_run.trace is not None and not gate_run.trace.encoder_reached:
                gate_run.trace.reach_encoder()
            if gate_run.depth > 1:  # inside another watched call (or an encoder's method): that is the encoder call
                gate_run.reached_inside = True
                return
            gate_run.calls.append([path, record_of(path, args, kwargs), None])

        def after_encoder(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            gate_run = getattr(local, "run", None)
            if gate_run is None or gate_run.answering or gate_run.depth == 0:
                return
            gate_run.depth -= 1
            if gate_run.depth == 0 and gate_run.calls and gate_run.calls[-1][2] is None:
                gate_run.calls[-1][2] = interned(structure_of(output))

        return before_encoder, after_encoder


# --- Answering: a hooked module's class swapped, for the length of an answered run --------------------------------

_swap_lock = threading.Lock()
#: id of a module swapped -> [its class, {id of a gate's thread-local: [that local, the module's path, runs]}]
_answered: dict[int, list[Any]] = {}
_answering_classes: dict[tuple[type, tuple[str, ...]], type] = {}
_own_methods_of: dict[type, tuple[str, ...]] = {}


def _own_methods(kind: type) -> tuple[str, ...]:
    """Return the names of the plain methods ``kind`` and its bases define below ``torch.nn.Module``."""
    found = _own_methods_of.get(kind)
    if found is None:
        names: dict[str, None] = {}
        for base in kind.__mro__:
            if base is torch.nn.Module or base is object:
                break
            for name, value in vars(base).items():
                if not name.startswith("__") and type(value) is types.FunctionType:
                    names.setdefault(name)
        found = _own_methods_of[kind] = tuple(names)
    return found


def _runs_of(module: torch.nn.Module) -> list[tuple[GateRun, str]]:
    held = _answered.get(id(module))
    if held is None:
        return []
    return [(gate_run, path) for local, path, _ in list(held[1].values()) if (gate_run := getattr(local, "run", None))]


def _answering_call_of(kind: type) -> Callable[..., Any]:
    """Return the ``__call__`` of ``kind``'s answering class: this thread's call of an answered run gets its stand-in
    before any hook or the forward runs; every other call goes through ``kind``'s own."""
    call = kind.__call__

    def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        for gate_run, path in _runs_of(self):
            if gate_run.answering and gate_run.depth == 0:
                answer = gate_run.answer(path, args, kwargs)
                if answer is not GO_ON:
                    return answer
            if gate_run.guard is not None:  # a real encoder's forward: not watched call by call
                with gate_run.guard.paused():
                    return call(self, *args, **kwargs)
        return call(self, *args, **kwargs)

    return __call__


def _answering_method(kind: type, name: str) -> Callable[..., Any]:
    """Return the override of a text encoder's own method ``name``: a call of it from outside the encoder that
    reaches the encoder's token table is an encoder call, recorded (or answered) as one."""
    original = getattr(kind, name)

    def method(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        for gate_run, path in _runs_of(self):
            if gate_run.depth:
                break
            spelled = f"{path}:{name}"
            if gate_run.answering:
                expected = gate_run.expected
                wanted = _expected_path(gate_run)
                # Not what the entry recorded next (a method that reaches no table, a part recorded instead): it runs,
                # its parts answered. An entry with no calls to compare: answered, so that the run goes on from here.
                if wanted != spelled and not (expected is not None and not expected.calls and not gate_run.calls):
                    break
                answer = gate_run.answer(spelled, args, kwargs)
                if answer is not GO_ON:
                    return answer
            position, inputs, outer = len(gate_run.calls), record_of(spelled, args, kwargs), gate_run.reached_inside
            gate_run.depth, gate_run.reached_inside = gate_run.depth + 1, False
            try:
                output = original(self, *args, **kwargs)
            finally:
                gate_run.depth -= 1
                reached, gate_run.reached_inside = gate_run.reached_inside, outer
            if reached:  # it reached the token table: an encoder call
                gate_run.calls.insert(position, [spelled, inputs, interned(structure_of(output))])
            return output
        return original(self, *args, **kwargs)

    method.__name__ = name
    return method


def _expected_path(gate_run: GateRun) -> str | None:
    expected = gate_run.expected
    index = len(gate_run.calls)
    return expected.calls[index].path if expected is not None and index < len(expected.calls) else None


def _answering_class(kind: type, methods: tuple[str, ...]) -> type:
    found = _answering_classes.get((kind, methods))
    if found is None:
        namespace: dict[str, Any] = {
            "__call__": _answering_call_of(kind),
            "__slots__": (),
            "__module__": kind.__module__,
        }
        namespace.update((name, _answering_method(kind, name)) for name in methods)
        found = type(kind.__name__, (kind,), namespace)
        found.__qualname__ = kind.__qualname__
        _answering_classes[(kind, methods)] = found
    return found


#: A hooked module's path, the module, and whether it is a text encoder itself (not a part of one).
_Hooked = tuple[str, torch.nn.Module, bool]


def _answer_calls(modules: list[_Hooked], local: threading.local, swapped: list[_Hooked]) -> None:
    """Swap each module's class for its answering class (counted per gate); note each one done in ``swapped``."""
    if not modules:
        return
    with _swap_lock:
        for path, module, encoder in modules:
            held = _answered.get(id(module))
            if held is None:
                original = type(module)
                methods = _own_methods(original) if encoder else ()
                object.__setattr__(module, "__class__", _answering_class(original, methods))
                held = _answered[id(module)] = [original, {}]
            runs = held[1].setdefault(id(local), [local, path, 0])
            runs[2] += 1
            swapped.append((path, module, encoder))


def _stop_answering(modules: list[_Hooked], local: threading.local) -> None:
    if not modules:
        return
    with _swap_lock:
        for _, module, _ in modules:
            held = _answered.get(id(module))
            if held is None:
                continue
            runs = held[1].get(id(local))
            if runs is not None:
                runs[2] -= 1
                if runs[2] == 0:
                    del held[1][id(local)]
            if not held[1]:
                object.__setattr__(module, "__class__", held[0])
                del _answered[id(module)]
