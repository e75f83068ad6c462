"""Which of a pipeline's methods encode prompts, found by watching its text encoders, and what each was seen to do.

A pipeline's text encoders are the child modules whose input is token ids (see :mod:`.text_encoders`).
:class:`EncoderWatch` puts a forward pre-hook on each of their token embeddings; when one is called
with an integer tensor outside every method the cache already wraps, the methods of the pipeline on
the call stack, from the outermost inwards, become candidates (:func:`calling_methods`). The
wrapper tries the outermost one first and moves inwards as each is refuted on its first call
(:class:`Observation`): arguments that cannot be keyed, a call that returns nothing, runs another
child module (the DiT, the VAE), changes its arguments, or runs collectives. Class and module
names play no part: an adapter verl-omni adds tomorrow is found the same way.

:class:`MethodState` is what the cache knows about one wrapped method: how it was found, what
its calls read (see :mod:`.reads`), whether its first hit still has to be checked, or why it is
not cached. Nothing here knows about vLLM-Omni.
"""

from __future__ import annotations

import copy
import inspect
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_omni_prompt_cache.keys import Bypass, value_identity
from vllm_omni_prompt_cache.reads import (
    ABSENT,
    COMPONENT,
    DATA,
    Trace,
    classify,
    current_attribute,
    original_class,
    unreplayable,
)
from vllm_omni_prompt_cache.text_encoders import child_modules, token_embeddings

#: Operator namespaces whose ops are collectives (torch.distributed's, and vLLM's custom ones by name).
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_COLLECTIVE_WORDS = ("all_reduce", "allreduce", "all_gather", "allgather", "broadcast", "reduce_scatter", "all_to_all")


def has_token_ids(args: tuple) -> bool:
    """Return True when a call's positional arguments hold an integer tensor (what an embedding is fed)."""
    return any(
        isinstance(value, torch.Tensor)
        and value.dtype is not torch.bool
        and not value.is_floating_point()
        and not value.is_complex()
        for value in args
    )


def calling_methods(pipeline: Any, frame: Any) -> list[tuple[str, Any]]:
    """Return ``(name, frame)`` of each of ``pipeline``'s methods running on the stack above ``frame``,
    outermost first.

    A frame counts when its first argument is the pipeline and the pipeline's class resolves the
    frame's function name to that very code; ``torch.nn.Module``'s own machinery does not count.
    """
    kind = original_class(pipeline)
    calls: list[tuple[str, Any]] = []
    while frame is not None:
        code = frame.f_code
        if code.co_argcount >= 1 and frame.f_locals.get(code.co_varnames[0]) is pipeline:
            name = code.co_name
            if _defines(kind, name, code) and not _defines(torch.nn.Module, name, code):
                calls.append((name, frame))
        frame = frame.f_back
    return calls[::-1]


@dataclass
class OpenEncode:
    """The encoder calls seen so far of one encode: the frames they share, and which encoders ran.

    An encode runs each of its encoders once (SD3's CLIP-L, CLIP-G and T5): a call of an encoder
    already seen, or one under other frames, is the next encode. The deepest method the calls share
    is the encode's; the methods around it are its fallbacks, innermost first.
    """

    calls: list[tuple[str, Any]]
    encoders: set[str]
    #: the frames of each encoder's last call: another embedding of the same call (CLIP's position
    #: embedding after its token embedding) comes under the very same frames
    last: dict[str, list[Any]] = field(default_factory=dict)

    def joins(self, calls: list[tuple[str, Any]], encoder: str) -> bool:
        """Narrow to the frames shared with another encoder call of the same encode; False if it is not one."""
        frames = [frame for _, frame in calls]
        if encoder in self.encoders:
            previous = self.last.get(encoder, [])
            return len(previous) == len(frames) and all(a is b for a, b in zip(previous, frames, strict=True))
        self.last[encoder] = frames
        if not calls or not self.calls or calls[0][1] is not self.calls[0][1]:
            return False
        shared = []
        for (name, frame), (_, other) in zip(self.calls, calls, strict=False):
            if frame is not other:
                break
            shared.append((name, frame))
        self.calls, self.encoders = shared, self.encoders | {encoder}
        return True

    def candidates(self) -> list[str]:
        """Return the methods to try, the deepest shared one first (and drop the frames)."""
        names = list(dict.fromkeys(name for name, _ in reversed(self.calls)))
        self.calls, self.last = [], {}
        return names


def _defines(kind: type, name: str, code: Any) -> bool:
    attribute = inspect.getattr_static(kind, name, None)
    if isinstance(attribute, (staticmethod, classmethod)) or not callable(attribute):
        return False
    return getattr(inspect.unwrap(attribute), "__code__", None) is code


class EncoderWatch:
    """Forward pre-hooks on the token embeddings of a pipeline's text encoders that report encodes no
    wrapped method covers: an encoder whose embedding is fed integer ids ran, however it was called
    (with ids, or with text it tokenizes itself).

    ``covered()`` says whether the current thread is inside a method the cache serves;
    ``found(calls, encoder)`` receives the calling methods, ``(name, frame)`` outermost first.
    """

    def __init__(
        self, pipeline: Any, covered: Callable[[], bool], found: Callable[[list[tuple[str, Any]], str], None]
    ) -> None:
        self._covered = covered
        self._found = found
        self._pipeline = pipeline
        self.encoders = token_embeddings(pipeline)
        self._handles = [
            embedding.register_forward_pre_hook(self._hook(name))
            for name, embeddings in self.encoders.items()
            for embedding in embeddings
        ]

    def _hook(self, name: str) -> Callable[..., None]:
        def seen(module: torch.nn.Module, args: tuple) -> None:  # an embedding takes its ids positionally
            if self._covered() or not has_token_ids(args):
                return
            self._found(calling_methods(self._pipeline, sys._getframe(1)), name)

        return seen

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class _Collectives(TorchDispatchMode):
    """Notes every collective operator dispatched while active (the first call of each method)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        namespace = getattr(func, "namespace", "")
        if namespace in _COLLECTIVE_NAMESPACES or (
            namespace == "vllm" and any(word in str(func) for word in _COLLECTIVE_WORDS)
        ):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@dataclass
class Observation:
    """What the first call of a method did besides what :class:`~.reads.Trace` saw."""

    called: list[str] = field(default_factory=list)  # child modules called, in order
    encoders: list[str] = field(default_factory=list)  # those whose token embedding was fed integer ids
    collectives: list[str] = field(default_factory=list)

    def other_modules(self) -> list[str]:
        """Return the child modules called that fed no token embedding (the DiT, the VAE)."""
        return [name for name in self.called if name not in self.encoders]


@contextmanager
def observed(pipeline: Any) -> Iterator[Observation]:
    """Watch which child modules run, which of them embed token ids, and which collectives run, while
    the block runs on this thread."""
    observation = Observation()
    thread = threading.get_ident()
    handles = []

    # Hooks without keyword arguments: torch registers a hook and its with_kwargs flag in two steps, and
    # another thread may be calling the module in between.
    def noting(into: list[str], name: str, ids_only: bool) -> Callable[..., None]:
        def seen(module: torch.nn.Module, args: tuple) -> None:
            if threading.get_ident() == thread and name not in into and (not ids_only or has_token_ids(args)):
                into.append(name)

        return seen

    embeddings = token_embeddings(pipeline)
    for name, module in child_modules(pipeline).items():
        handles.append(module.register_forward_pre_hook(noting(observation.called, name, False)))
        for embedding in embeddings.get(name, ()):
            handles.append(embedding.register_forward_pre_hook(noting(observation.encoders, name, True)))
    mode = _Collectives()
    try:
        with mode:
            yield observation
    finally:
        for handle in handles:
            handle.remove()
        observation.collectives = list(dict.fromkeys(mode.seen))


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

    def relearn(self) -> None:
        """Serve its next call uncached and observed (a component it is guarded by was replaced)."""
        with self.lock:
            self.learning = True

    def finish_learning(self, *, check: bool) -> bool:
        """End its first use, its first hit checked when ``check``; return False when another call already ended
        it or refused the method (then that call confirmed it, and the first hit is not checked twice)."""
        with self.lock:
            if not self.learning or self.refusal is not None:
                return False
            self.learning, self.observed, self.check_pending = False, True, check
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
