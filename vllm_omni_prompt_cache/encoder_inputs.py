"""What reached the text encoders: recorded when an entry is encoded, compared before a hit is served.

A key holds a call's arguments and what the encode read from its pipeline, but an adapter can keep a
request's token ids anywhere: on its tokenizer or text encoder, in a helper object, a config changed in
place, a ``ContextVar``, a module-level dict. Whatever the path, the ids end up as the inputs of a text
encoder's forward: that boundary is the one input no adapter can hide.

So every encode that makes an entry runs under an :class:`EncoderGate` that records its **encoder
input**: the arguments (positional and keyword) of its first call into a text encoder (a child module
whose input is token ids, see :mod:`.text_encoders`), or any module between it and its token embedding. The
record is a BLAKE2b-256 digest of their canonical form (:mod:`.keys`: dtype, shape and bytes of every
tensor, never the device), kept with the entry (:func:`seal`). Before a hit is served, the method runs
again up to that same point, and the gate compares what would reach the encoder now with the record:

* equal: the encoder would compute what it computed then; the run stops there (:class:`Proven`,
  raised from a forward pre-hook before the encoder runs or moves) and the entry is served;
* different: an entry kept beside it for that very input (:func:`with_encoder_input`) is served if
  there is one; else the run goes on through the encoder (a miss's encode, exactly), and its result
  is served and kept beside the first entry;
* not comparable (the inputs cannot be keyed, or no encoder was reached): the run goes on, its result
  is served and not kept.

What the proof cannot see: state read after the first encoder call (a later encoder's inputs, a crop
index) that is not an argument or a pipeline attribute, which the key holds. An encode that reaches
no text encoder the gate can see has no record: its entries are served on the key alone, as upstream
does. Nothing here knows about vLLM-Omni.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_prompt_cache.keys import Bypass, CallKey, value_key
from vllm_omni_prompt_cache.text_encoders import is_text_encoder, is_token_embedding

#: Marks an entry whose value carries its encoder-input record: ``(SEALED, record, value)``.
SEALED = "prompt-embed-cache:encoder-input"
#: Why a hit could not be proven (the ``reason`` label of ``unproven_reasons``).
DIFFERED = "another input reached the text encoder"
UNRECORDED = "the entry holds no encoder-input record"
#: What a proof run expects for an entry without a record, of a method whose encodes make records (a file
#: from another version, an entry made while a hook was being registered): no digest equals it.
NO_RECORD = ""
UNREADABLE = "the encoder's inputs cannot be keyed"
#: Why a found entry was not served, yet nothing was encoded: the method returned without calling an encoder
#: (its own cache, a precomputed input); its own result is served, counted as a bypass.
NOT_REACHED = "the call reached no text encoder: served by the method itself"


class Proven(BaseException):
    """Raised out of a forward pre-hook when what would reach the encoder equals the entry's record (no
    argument), or an entry made with that input was found beside it (its value the one argument): the run
    stops before the encoder runs. A BaseException, so that no handler of encoder failures takes it."""


class Refuted(BaseException):
    """Raised out of a forward pre-hook when the inputs differ and the run must not go on through the
    encoder itself (its encoders wait off the device; the caller encodes again, placed)."""


def seal(value: Any, record: str | None) -> Any:
    """Return what an entry holds for ``value`` encoded with encoder input ``record`` (None: no record)."""
    return value if record is None else (SEALED, record, value)


def unseal(value: Any) -> tuple[Any, str | None]:
    """Return an entry's value and its encoder-input record (None: it has none)."""
    if type(value) is tuple and len(value) == 3 and type(value[0]) is str and value[0] == SEALED:
        return value[2], value[1]
    return value, None


def with_encoder_input(key: CallKey, record: str) -> CallKey:
    """Return the key of the entry for ``key``'s call made with encoder input ``record``: a call whose key holds
    the same arguments and pipeline state while hidden state feeds its encoder another input is kept beside
    the first entry, not over it, so that each input is encoded once."""
    return CallKey((*key.identity, (SEALED, record)), key.witness)


def record_of(name: str, args: tuple, kwargs: dict) -> str | Bypass:
    """Return the digest of a call of encoder module ``name`` with ``args`` and ``kwargs``, or why it has none."""
    with torch.inference_mode(False):  # read as the call's arguments are, whatever mode the encode runs in
        key = value_key((name, args, kwargs))
    if type(key) is Bypass:
        return key
    identity, witness = key
    digest = hashlib.blake2b(repr(identity).encode("utf-8", "surrogatepass"), digest_size=32)
    for part in witness:  # the bytes themselves: the identity's xxh3 digests are not collision resistant
        digest.update(part)
    return digest.hexdigest()


@dataclass
class GateRun:
    """One run of a method under the gate, on one thread: what it expects, and what reached an encoder."""

    expected: str | None  # the entry's record when proving a hit; None when encoding
    abort_on_refute: bool = False
    reached: bool = False
    record: str | Bypass | None = None  # what reached the first encoder call (None: none was reached)
    on_refute: Callable[[], None] | None = None  # told when the run goes on through the encoder
    #: ``alternative(record)``: ``(True, value)`` for an entry made with that encoder input, else ``(False, None)``
    alternative: Callable[[str], tuple[bool, Any]] | None = None
    trace: Any = None  # the run's :class:`~.reads.Trace`, told when the encoder is reached
    #: set when the hook proved the run (and, for an entry kept beside, which): a Proven that the method's
    #: own code swallowed (a bare ``except``) still counts, and what the run went on to return is not kept
    proven: bool = False
    beside: Any = None
    grew: bool = False  # the key grew while it ran (set by the caller once the run has been learned from)

    @property
    def why_unproven(self) -> str:
        """Return why this proof run did not prove its hit."""
        if self.record is None:
            return NOT_REACHED
        if type(self.record) is Bypass:
            return UNREADABLE
        return UNRECORDED if self.expected in (None, NO_RECORD) else DIFFERED

    @property
    def kept_record(self) -> str | None:
        """Return the record an entry made by this run keeps (None: none to compare a hit with)."""
        return self.record if type(self.record) is str else None


class EncoderGate:
    """Forward pre-hooks on the pipeline's text encoders (:func:`~.text_encoders.text_encoders`, and every
    module between each and its token embeddings) that record or check the first encoder call of a run.

    The hooks are first in each module's list, before any hook that places the encoder on the device (an
    offload's, the cache's own placement), and cost one thread-local read outside a run.
    """

    def __init__(self, children: Callable[[], dict[str, torch.nn.Module]]) -> None:
        self._children = children  # the pipeline's child modules now, by attribute name
        self._local = threading.local()  # .run: the GateRun of this thread, if any
        self._handles: list[Any] = []
        self._hooked: dict[str, int] = {}  # child name -> id of the module hooked
        self._children_seen: dict[str, int] = {}  # every child's id when the gate last looked
        self._lock = threading.Lock()
        self.refresh()

    def refresh(self) -> None:
        """Hook the text encoders the pipeline holds now (again, if a child module was replaced since)."""
        every = self._children()
        seen = {name: id(module) for name, module in every.items()}
        if seen == self._children_seen:  # the common case, on every run: nothing was replaced
            return
        with self._lock:
            children = {name: module for name, module in every.items() if is_text_encoder(module)}
            if {name: id(module) for name, module in children.items()} == self._hooked:
                self._children_seen = seen  # another child changed (a DiT reloaded): the hooks stand
                return
            for handle in self._handles:
                handle.remove()
            self._handles = []
            for name, module in children.items():
                for path, part in _paths_to_embeddings(name, module):
                    hook = self._hook(path)
                    self._handles.append(part.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
            self._hooked = {name: id(module) for name, module in children.items()}
            self._children_seen = seen  # last: until the hooks are in place, every run takes the lock here

    def remove(self) -> None:
        with self._lock:
            for handle in self._handles:
                handle.remove()
            self._handles, self._hooked, self._children_seen = [], {}, {}

    @contextmanager
    def run(self, expected: str | None = None, *, abort_on_refute: bool = False) -> Iterator[GateRun]:
        """Run the block as one gate run on this thread: the first encoder call is recorded into the yielded
        :class:`GateRun`; with ``expected``, a call whose record equals it raises :class:`Proven`, and one that
        differs raises :class:`Refuted` when ``abort_on_refute``. A run inside a run records nothing. The
        encoders the pipeline holds now are hooked first (see :meth:`refresh`)."""
        outer = getattr(self._local, "run", None)
        if outer is None:
            self.refresh()
        gate_run = GateRun(expected, abort_on_refute)
        if outer is not None:  # a wrapped method called from another's encode: the outer run records
            gate_run.reached = True
        self._local.run = gate_run if outer is None else outer
        try:
            yield gate_run
        finally:
            self._local.run = outer

    def _hook(self, path: str) -> Callable[[torch.nn.Module, tuple, dict], None]:
        local = self._local

        def before_encoder(module: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> None:
            gate_run = getattr(local, "run", None)
            if gate_run is None or gate_run.reached or kwargs is None:  # None: torch is still registering it
                return
            gate_run.reached = True
            if gate_run.trace is not None:
                gate_run.trace.reach_encoder()
            record = gate_run.record = record_of(path, args, kwargs)
            if gate_run.expected is None:
                return
            if record == gate_run.expected:
                gate_run.proven = True
                raise Proven
            if type(record) is str and gate_run.alternative is not None:
                found, value = gate_run.alternative(record)
                if found:  # an entry made with the very input that would reach the encoder now
                    gate_run.proven, gate_run.beside = True, value
                    raise Proven(value)
            # Encoders waiting off the device: encode again, placed, unless this run already changed pipeline
            # state, which a second run would change twice; then it goes on, the encoders placed at their forward.
            if gate_run.abort_on_refute and not (gate_run.trace is not None and gate_run.trace.changed_state()):
                raise Refuted
            if gate_run.on_refute is not None:
                gate_run.on_refute()

        return before_encoder


def _paths_to_embeddings(name: str, module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Return ``(qualified name, module)`` for ``module`` and each module under it on the way to a token embedding."""
    on_the_way = {""}
    for path, part in module.named_modules(remove_duplicate=False):  # T5's embedding sits under two names
        if is_token_embedding(part):
            steps = path.split(".")
            on_the_way.update(".".join(steps[:depth]) for depth in range(1, len(steps) + 1))
    found: dict[int, tuple[str, torch.nn.Module]] = {}
    for path, part in module.named_modules(remove_duplicate=False):
        if path in on_the_way and id(part) not in found:
            found[id(part)] = (f"{name}.{path}" if path else name, part)
    return list(found.values())
