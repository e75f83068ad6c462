"""One wrapped pipeline's state, and the function that replaces each of its encode methods.

:class:`Installation` is what the cache sets on a pipeline besides upstream's two attributes
(``_prompt_embed_cache``, ``_prompt_embed_cache_original_fn``) and, where the text encoders are placed on a
miss, the placement (:data:`~.residency.PLACEMENT_ATTRIBUTE`): the store, each wrapped
method's original, layout proof and state, and the encoder watch that finds more methods while the
pipeline runs (see :mod:`.discovery`). Each wrapped method's calls are served by a
:class:`~.method_calls.MethodCalls`, entered through :func:`~.method_calls.cached_method`.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from vllm_omni_prompt_cache.calls.layouts import layout_proof, method_layout_proof
from vllm_omni_prompt_cache.calls.method_calls import MethodCalls, cached_method, noting_encodes
from vllm_omni_prompt_cache.counts.counters import ENCODE_PROMPT
from vllm_omni_prompt_cache.keys.call_key import CallKeyBuilder
from vllm_omni_prompt_cache.keys.method_state import MethodState, instance_attributes
from vllm_omni_prompt_cache.logs import warn_once
from vllm_omni_prompt_cache.proof.discovery import EncoderWatch, OpenEncode, child_modules
from vllm_omni_prompt_cache.proof.encoder_gate import EncoderGate
from vllm_omni_prompt_cache.rows.layout import RowLayout
from vllm_omni_prompt_cache.rows.layout_proofs import LayoutProof
from vllm_omni_prompt_cache.store.prompt_embed_cache import PromptEmbedCache

logger = logging.getLogger(__name__)

#: Where a pipeline holds its :class:`Installation`.
INSTALLATION_ATTRIBUTE = "_prompt_embed_cache_installation"
#: Upstream's attributes: the cache, and the original ``encode_prompt`` (None when the pipeline has none).
CACHE_ATTRIBUTE = "_prompt_embed_cache"
ORIGINAL_ATTRIBUTE = "_prompt_embed_cache_original_fn"


class Installation:
    """Everything the cache keeps for one wrapped pipeline: its wrapped methods (original, layout proof, state),
    and the encoder watch that finds more (see :mod:`.discovery`)."""

    def __init__(
        self,
        pipeline: Any,
        cache: PromptEmbedCache,
        tag: str,
        digest: Callable[[Any], bytes] | None,
        report: Callable[[PromptEmbedCache], None] | None,
        row_layout: RowLayout | None,
        row_layouts: Mapping[str, RowLayout] | None,
    ) -> None:
        self.pipeline = pipeline
        self.cache = cache
        self.tag = tag
        self.digest = digest
        self.report = report
        self.row_layout = row_layout
        self.row_layouts = row_layouts
        self.inside = threading.local()  # set while a wrapped method of this pipeline runs on this thread
        self.originals: dict[str, Callable[..., Any]] = {}  # each wrapped method's original, by name
        self.methods: dict[str, MethodCalls] = {}  # what serves each wrapped method's calls, by name
        self.rejected: dict[str, str] = {}  # candidates found by watching that turned out not to be encodes
        self.unwrappable: dict[str, str] = {}  # encoder -> why no method could be wrapped for it
        self._inner: dict[str, list[str]] = {}  # candidate -> the methods around it, tried next
        self._open: OpenEncode | None = None  # the encode whose encoder calls are being gathered
        self._settle_hooks: list[Any] = []  # on the other child modules while an encode is open
        self._lock = threading.RLock()
        self._watch: EncoderWatch | None = None
        self.configuration = instance_attributes(pipeline)  # what the pipeline held at install (see MethodState)
        #: records what reaches the text encoders on an encode, and compares it before a hit is served
        self.gate = EncoderGate(pipeline)

    @property
    def encoders(self) -> list[str]:
        return [] if self._watch is None else list(self._watch.encoders)

    @property
    def proofs(self) -> dict[str, LayoutProof]:
        """Return each wrapped method's row layout proof, by name."""
        return {name: calls.proof for name, calls in self.methods.items()}

    @property
    def states(self) -> dict[str, MethodState]:
        """Return what the cache knows of each wrapped method, by name."""
        return {name: calls.state for name, calls in self.methods.items()}

    def wrap(
        self, name: str, source: str, encode_fn: Callable[..., Any], signature: inspect.Signature, *, inferred: bool
    ) -> None:
        """Wrap ``name`` on the pipeline with its own keys, layout, counters and :class:`MethodState`."""
        pipeline = self.pipeline
        if name == ENCODE_PROMPT:
            proof = layout_proof(pipeline, signature, self.tag, self.row_layout, self.row_layouts)
            method_tag = self.tag
        else:  # another method: its own keys (never an encode_prompt entry), layout and counters
            proof = method_layout_proof(pipeline, name, signature, self.tag)
            method_tag = f"{self.tag}.{name}"
        # A method found by watching is observed on its first call before anything is kept, and so is every
        # method where several ranks run: each rank's first call encodes, so all see its collectives at once
        # (a lower tier's hit on one rank could skip them). Elsewhere encode_prompt and declared methods are
        # served from their first call, their first encode observed (see FirstUse.encode_traced).
        instance = getattr(encode_fn, "__self__", pipeline)
        configuration = self.configuration if instance is pipeline else instance_attributes(instance)
        state = MethodState(name, source, inferred, learning=inferred or _several_ranks(), configuration=configuration)
        calls = MethodCalls(
            self.cache,
            noting_encodes(encode_fn, self.inside, pipeline),
            signature,
            CallKeyBuilder(signature, method_tag, digest=self.digest),
            proof,
            method=name,
            tag=self.tag,
            pipeline=pipeline,
            state=state,
            host=self,
            instance=instance,
            original=encode_fn,
            gate=self.gate,
        )
        if not inferred:
            self.cache.register(name)  # listed in stats() from now on; a candidate once it is confirmed
        _set_attribute(pipeline, name, cached_method(calls, encode_fn, self.cache, self.report, self.inside, pipeline))
        self.originals[name] = encode_fn
        self.methods[name] = calls

    def watch(self) -> None:
        """Start watching the text encoders for encodes that no wrapped method covers."""
        self._watch = EncoderWatch(self.pipeline, lambda: getattr(self.inside, "active", False), self._found)

    def _found(self, calls: list[tuple[str, Any]], encoder: str) -> None:
        """An encoder ran outside every wrapped method, called through ``calls`` (outermost first). The encode
        it belongs to is settled when the next one begins (see :class:`~.discovery.OpenEncode`)."""
        with self._lock:
            if not calls:  # another object's call (an encoder shared with a reference pipeline), or no method's
                return
            if self._open is not None and self._open.joins(calls, encoder):
                return
            self._settle_open()
            self._open = OpenEncode(calls, {encoder}, {encoder: [frame for _, frame in calls]})
            # The encode ends, at the latest, when another child module runs (the DiT after the encodes).
            self._settle_hooks = [
                module.register_forward_pre_hook(self._on_other_module)
                for name, module in child_modules(self.pipeline).items()
                if name not in self.encoders
            ]

    def _on_other_module(self, module: torch.nn.Module, args: tuple) -> None:
        with self._lock:
            self._settle_open()

    def _settle_open(self) -> None:
        """Settle the encode being gathered, if any; the lock is held."""
        for handle in self._settle_hooks:
            handle.remove()
        self._settle_hooks = []
        if self._open is not None:
            encode, self._open = self._open, None
            self._settle(encode)

    def _settle(self, encode: OpenEncode) -> None:
        names = encode.candidates()
        if any(name in self.methods for name in names):  # a method it runs under is wrapped (or being tried)
            return
        candidates = [name for name in names if name not in self.rejected]
        if candidates:
            self._try(candidates)
        else:
            why = f"no method that calls it is an encode ({', '.join(names)})"
            for encoder in encode.encoders - set(self.unwrappable):
                self.unwrappable[encoder] = why
                warn_once(f"{self.tag}.{encoder} runs uncached: {why}")

    def _try(self, candidates: list[str]) -> None:
        """Wrap the first of ``candidates`` that can be, remembering the rest for when it is refuted."""
        for index, name in enumerate(candidates):
            encode_fn = getattr(self.pipeline, name, None)
            try:
                signature = inspect.signature(encode_fn)
            except (TypeError, ValueError) as why:
                self.rejected[name] = f"its signature cannot be read ({why})"
                continue
            encoders = ", ".join(self.encoders)
            self._inner[name] = candidates[index + 1 :]
            self.wrap(name, f"found: it hands {encoders} their token ids", encode_fn, signature, inferred=True)
            return

    def reject(self, name: str, why: str) -> None:
        """Unwrap a candidate that is not an encode, and try the method around it."""
        with self._lock:
            if name not in self.methods:
                return
            self.rejected[name] = why
            original = self.originals.pop(name)
            del self.methods[name]
            restore(self.pipeline, name, original)
            logger.debug("Prompt-embed cache: %s.%s is not an encode: %s.", self.tag, name, why)
            following = [inner for inner in self._inner.pop(name, []) if inner not in self.methods]
            if following:
                self._try([inner for inner in following if inner not in self.rejected])

    def describe(self) -> dict[str, Any]:
        """Return what stats() says of the encode methods: found, how, keyed on what; and the rejected."""
        with self._lock:
            described = {name: state.describe() for name, state in self.states.items()}
            for name, why in self.rejected.items():
                described[name] = {"found": "a candidate", "state": "not an encode", "refusal": why}
            for encoder, why in self.unwrappable.items():
                described[f"<{encoder}>"] = {"found": "an encoder call", "state": "uncached", "refusal": why}
            return described

    def attach(self) -> None:
        """Set this installation on the pipeline, with upstream's two attributes."""
        object.__setattr__(self.pipeline, CACHE_ATTRIBUTE, self.cache)
        object.__setattr__(self.pipeline, ORIGINAL_ATTRIBUTE, self.originals.get(ENCODE_PROMPT))
        object.__setattr__(self.pipeline, INSTALLATION_ATTRIBUTE, self)

    def remove(self) -> None:
        """Stop watching the encoders (the wrapped methods are restored by the caller)."""
        if self._watch is not None:
            self._watch.remove()
        self.gate.remove()
        with self._lock:
            for handle in self._settle_hooks:
                handle.remove()
            self._settle_hooks, self._open = [], None


def restore(pipeline: Any, name: str, original: Callable[..., Any]) -> None:
    """Put ``original`` back as ``pipeline.name``."""
    if getattr(original, "__self__", None) is pipeline and name in vars(pipeline):
        object.__delattr__(pipeline, name)  # the original was the class's bound method
    else:
        _set_attribute(pipeline, name, original)


def _several_ranks() -> bool:
    """Return True when this process is one of several torch.distributed ranks."""
    distributed = torch.distributed
    return distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1


def _set_attribute(pipeline: Any, name: str, value: Any) -> None:
    # diffusers / torch.nn.Module pipelines may refuse plain assignment of some values.
    try:
        setattr(pipeline, name, value)
    except Exception:
        object.__setattr__(pipeline, name, value)
