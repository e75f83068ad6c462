"""Which of a pipeline's methods encode prompts, found by watching its text encoders, and what each was seen to do.

A pipeline's text encoders are the child modules whose input is token ids (see :mod:`.text_encoders`).
:class:`EncoderWatch` puts a forward pre-hook on each of their token embeddings; when one is called
with an integer tensor outside every method the cache already wraps, the methods of the pipeline on
the call stack, from the outermost inwards, become candidates (:func:`calling_methods`). The
wrapper tries the outermost one first and moves inwards as each is refuted on its first call
(:class:`Observation`): arguments that cannot be keyed, a call that returns nothing, runs another
child module (the DiT, the VAE), changes its arguments, or runs collectives. Class and module
names play no part: an adapter verl-omni adds tomorrow is found the same way.

What the cache knows of each wrapped method, its :class:`~.method_state.MethodState`, is filled from the
traces of :mod:`.reads`. Nothing here knows about vLLM-Omni.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_omni_prompt_cache.encoders.text_encoders import child_modules, note_token_table, token_embeddings
from vllm_omni_prompt_cache.keys.reads import (
    original_class,
)

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


_EMBEDDING = torch.ops.aten.embedding.default


class _Collectives(TorchDispatchMode):
    """Notes every collective operator dispatched while active (the first call of each method)."""

    def __init__(self, known: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.known = known  # ids of the parameters of token tables recognised already
        self.tables: list[int] = []  # ids of parameters first seen fed token ids (see text_encoders.note_token_table)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if (  # a parameter looked up by token ids: a token table
            func is _EMBEDDING
            and len(args) > 1
            and isinstance(args[0], torch.nn.Parameter)
            and id(args[0]) not in self.known
            and not args[1].is_floating_point()
            and note_token_table(args[0])
        ):
            self.tables.append(id(args[0]))
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
    new_tables: int = 0  # token tables first recognised by this call: its encode ran encoders nothing watched

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
    mode = _Collectives(
        frozenset(id(p) for tables in embeddings.values() for table in tables for p in table.parameters())
    )
    try:
        with mode:
            yield observation
    finally:
        for handle in handles:
            handle.remove()
        observation.collectives = list(dict.fromkeys(mode.seen))
        if mode.tables:  # tables held by a child module the gate can watch from now on
            new = set(mode.tables)
            observation.new_tables = sum(
                1
                for name, module in child_modules(pipeline).items()
                if name not in embeddings and any(id(parameter) in new for parameter in module.parameters())
            )
