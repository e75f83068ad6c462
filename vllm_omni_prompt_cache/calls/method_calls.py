"""How one wrapped method's calls are served: run for real, their text-encoder calls answered from the store; or,
for a method that reaches no text encoder the cache recognises, cached whole on its arguments, as upstream does.

A method's calls run as written: its text-encoder calls are served by :class:`~.encoder_calls.EncoderCalls`, and
this module only counts what they came to, once per call (a miss if any encoded, a hit if all were answered). A
method whose call reached no recognised text encoder (upstream's test doubles, an encode behind an object the cache
cannot see into) keeps upstream's contract: its result is kept under its arguments' key and served on that key
(``key_only_hits``, said once in the log). Such a method's later miss that reaches a text encoder turns it to the
first kind for good, and its kept results are dropped. A method found by watching is never cached whole: it is
wrapped only to count its calls.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from vllm_omni_prompt_cache.calls.encoder_calls import EncoderCalls, EncodeTally
from vllm_omni_prompt_cache.counts.counters import KEY_ONLY_HITS, Outcome, tally
from vllm_omni_prompt_cache.encoders.text_encoders import noting_token_tables
from vllm_omni_prompt_cache.keys.call_key import Bypass, CallKey, CallKeyBuilder, freeze_witness, value_key
from vllm_omni_prompt_cache.logs import warn_once
from vllm_omni_prompt_cache.store.prompt_embed_cache import PromptEmbedCache
from vllm_omni_prompt_cache.store.values import detach_value, unaliased

DISABLED_REASON = "cache disabled"
#: Why a call of a method found by watching reached no text encoder (it is never cached whole).
NOT_REACHED = "the call reached no text encoder"


class MethodCalls:
    """Serves one pipeline method's calls (see the module docstring); counts each call once."""

    def __init__(
        self,
        store: PromptEmbedCache,
        encode_fn: Callable[..., Any],
        key_builder: CallKeyBuilder,
        encoder_calls: EncoderCalls,
        *,
        method: str,
        source: str,
        tag: str,
        found: bool,
        instance: Any = None,
    ) -> None:
        self.store = store
        self.instance = instance  # what the method is bound to: whose data a whole call's key also holds
        self.encode_fn = encode_fn
        self.key_builder = key_builder
        self.encoder_calls = encoder_calls
        self.method = method
        self.source = source
        self.tag = tag
        self.found = found
        self.count = store.recorder(method)
        #: whether its calls reach a recognised text encoder: None until one call has run
        self.reaches_encoder: bool | None = True if found else None
        #: a method cached whole: the attributes of its instance its first call changed (counters, timings), which
        #: its key does not hold; every other data attribute it does
        self.instrumentation: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self.local = threading.local()  # .encoded: the last call on this thread ran a text encoder (or the method)

    def describe(self) -> dict[str, Any]:
        """Return what stats() says of it: how it was found; ``cached`` (its text-encoder calls are answered from
        the cache), ``cached whole`` (it reaches no text encoder the cache recognises) or ``learning``."""
        state = {True: "cached", False: "cached whole", None: "learning"}[self.reaches_encoder]
        return {"found": self.source, "state": state}

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        store = self.store
        if not store.enabled:
            return self._run(args, kwargs, bypass=store.off_reason or DISABLED_REASON)
        if self.reaches_encoder:  # the method runs as written, its text-encoder calls served
            result, done = self._encode(args, kwargs)
            counts = done.counts()
            self.count(counts if counts is not None else tally(Outcome.BYPASS, reason=self._not_reached(args, kwargs)))
            return result
        arguments = self.key_builder.bind(args, kwargs)
        if type(arguments) is not Bypass:
            precomputed = self.key_builder.precomputed(arguments)
            if precomputed is not None:
                return self._run(args, kwargs, bypass=precomputed.reason)
        if self.reaches_encoder is False:
            return self._whole(args, kwargs, arguments)
        # Its first call: a raw table its encoder looks ids up in is recognised as a text encoder's from now on.
        before = _data_attributes(self.instance)
        with noting_token_tables() as tables:
            result, done = self._encode(args, kwargs)
        counts = done.counts()
        if counts is None and tables.noted:  # a table recognised now: its encoder is served from the next call on
            hooked = set(self.encoder_calls.states)
            self.encoder_calls.refresh()
            if set(self.encoder_calls.states) - hooked:
                counts = tally(Outcome.MISS)
        if counts is not None:
            self.reaches_encoder = True
            self.count(counts)
            return result
        if _several_ranks():  # cached whole, a rank would skip the collectives its method runs with the others
            self.reaches_encoder = True
            self.count(tally(Outcome.BYPASS, reason=NOT_REACHED))
            return result
        after = _data_attributes(self.instance)
        with self._lock:
            # A number the call read and rewrote counts calls (upstream's tests count so): not keyed. Other state it
            # changed (a stash it consumed) is keyed as it was before the call.
            self.instrumentation = frozenset(
                name
                for name in before.keys() & after.keys()
                if before[name][0][0] != after[name][0][0] and before[name][1] and after[name][1]
            )
            self.reaches_encoder = False
        key = self._whole_key(arguments, before)
        if type(key) is Bypass:
            self.count(tally(Outcome.BYPASS, reason=key.reason))
            return result
        self.count(tally(Outcome.MISS))
        self.store.put(key, detach_value(unaliased(result, (args, kwargs))))
        return result

    def _not_reached(self, args: tuple, kwargs: dict) -> str:
        """Return why a call of a method that reaches a text encoder reached none: it was handed what the encoder
        makes (``prompt_embeds``), or it served itself."""
        arguments = self.key_builder.bind(args, kwargs)
        precomputed = None if type(arguments) is Bypass else self.key_builder.precomputed(arguments)
        return NOT_REACHED if precomputed is None else precomputed.reason

    def _encode(self, args: tuple, kwargs: dict) -> tuple[Any, EncodeTally]:
        """Run the method for real, its text-encoder calls served; return its result and what they came to."""
        calls = self.encoder_calls
        outer = calls.open_call(self.method)
        try:
            result = self.encode_fn(*args, **kwargs)
        finally:
            done = calls.close_call(outer)
            self.local.encoded = bool(done.encoded or done.bypassed)
        return result, done

    def _run(self, args: tuple, kwargs: dict, *, bypass: str) -> Any:
        """Run the method uncached, counted as a bypass with ``bypass``, its text-encoder calls not served."""
        self.count(tally(Outcome.BYPASS, reason=bypass))
        self.local.encoded = True
        with self.encoder_calls.passing():
            return self.encode_fn(*args, **kwargs)

    def _whole_key(self, arguments: dict | Bypass, attributes: dict[str, Any] | None = None) -> CallKey | Bypass:
        """Return the key of a call cached whole: its arguments, and the data its instance holds (but for what its
        calls change), since upstream's test doubles and encoders the cache cannot see into read it."""
        if type(arguments) is Bypass:
            return arguments
        attributes = _data_attributes(self.instance) if attributes is None else attributes
        held = tuple(
            (name, keyed) for name, (keyed, _) in sorted(attributes.items()) if name not in self.instrumentation
        )
        return self.key_builder.build_from_arguments(arguments, held=held or None)

    def _whole(self, args: tuple, kwargs: dict, arguments: dict | Bypass) -> Any:
        """Serve a call of a method that reaches no recognised text encoder on its arguments' key."""
        key = self._whole_key(arguments)
        if type(key) is Bypass:
            return self._run(args, kwargs, bypass=key.reason)
        ran: list[EncodeTally] = []

        def encode() -> Any:
            result, done = self._encode(args, kwargs)
            ran.append(done)
            return unaliased(result, (args, kwargs))

        def count(outcome: Outcome, reason: str | None) -> None:
            if ran and ran[0].counts() is not None:
                return  # counted below, as what its encoder calls came to
            self.count(tally(outcome, reason=reason))

        self.local.encoded = False
        value = self.store.lookups.serve(key, encode, count, self.method)
        reached = ran[0].counts() if ran else None
        if reached is not None:  # it reaches a text encoder now: never cached whole again
            with self._lock:
                self.reaches_encoder = True
            self.store.lookups.forget(key.identity)
            self.count(reached)
        elif not ran:
            warn_once(
                f"{self.tag}.{self.method}'s hits are served on its arguments alone (key_only_hits): its calls reach "
                "no text encoder the cache recognises"
            )
            self.count({**tally(Outcome.HIT), KEY_ONLY_HITS: 1})
        return value


def _several_ranks() -> bool:
    """Return True when this process is one of several torch.distributed ranks."""
    distributed = torch.distributed
    return distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1


def _data_attributes(instance: Any) -> dict[str, tuple[Any, bool]]:
    """Return the instance's attributes that a key can hold by value (strings, numbers, tensors, containers of them),
    each as the identity its key spells (not the object: what the call does to it later must not change it), and
    whether it is a number."""
    try:
        attributes = dict(vars(instance))
    except TypeError:
        return {}
    data = {}
    for name, value in attributes.items():
        if callable(value) or isinstance(value, torch.nn.Module):
            continue
        keyed = value_key(value)
        if type(keyed) is not Bypass:  # spelled as plain data: an identity holds sizes (torch.Size) no key reads
            data[name] = ((repr(keyed[0]), freeze_witness(keyed[1])), type(value) in (int, float))
    return data


def cached_method(
    calls: MethodCalls,
    encode_fn: Callable[..., Any],
    cache: PromptEmbedCache,
    report: Callable[[PromptEmbedCache], None] | None,
    inside: threading.local,
    pipeline: Any,
) -> Callable[..., Any]:
    """Return the function that replaces ``encode_fn`` on the pipeline.

    A wrapped method called from inside another (MAGI-2's ``encode_prompt`` calls its ``_encode_prompts``) runs
    straight through: the outer call is the one counted. A call runs in a session of the pipeline's encoder
    placement when it has one (the encoders leave the device when it ends; only an encoder call that misses
    places them); a call that encoded nothing counts the encoder moves it saved.
    """
    from vllm_omni_prompt_cache.encoders.residency import PLACEMENT_ATTRIBUTE

    @functools.wraps(encode_fn)
    def cached_encode(*args: Any, **kwargs: Any) -> Any:
        if getattr(inside, "active", False):
            return encode_fn(*args, **kwargs)
        inside.active = True
        try:
            moves = cache.moves
            placement = getattr(pipeline, PLACEMENT_ATTRIBUTE, None)
            if moves is None and placement is None:
                result = calls(args, kwargs)
            else:
                calls.local.encoded = True
                if placement is None:
                    result = calls(args, kwargs)
                else:
                    with placement.session():
                        result = calls(args, kwargs)
                if moves is not None and not calls.local.encoded:
                    moves.served_without_encoding()
        finally:
            inside.active = False
        if report is not None:
            report(cache)
        return result

    cached_encode.__wrapped__ = encode_fn  # type: ignore[attr-defined]
    return cached_encode
