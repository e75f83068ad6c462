"""Which of a pipeline's methods encode prompts, and which of them must never be cached.

The cache wraps ``encode_prompt`` on every pipeline. Some pipelines encode through another method
that their ``forward`` calls instead, so wrapping ``encode_prompt`` alone leaves them uncached
(verl-omni's SD3 and LTX-2 adapters, vLLM-Omni's MAGI-2). Others read input that is not an
argument (verl-omni's MiniMax-H3 adapter reads the request's token ids from instance state): any
cache keyed on arguments would give every prompt the first prompt's embedding.

A method is recognised by the class that defines it: its name, and the package it lives in
(verl-omni's or vLLM-Omni's, or this package's stand-ins of that code, :data:`STAND_IN_PACKAGE`),
so a subclass inherits the decision. A class that defines the method again below the one listed,
under any name, has code nobody checked here: :data:`KNOWN_METHODS` then does not apply (a user
may still declare it), while a :data:`HIDDEN_INPUTS` refusal, matched by name alone, still does (an
override usually calls the method it replaces). Nothing here imports vLLM-Omni or verl-omni.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_omni_prompt_cache.config import METHODS, PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.counters import ENCODE_PROMPT
from vllm_omni_prompt_cache.proofs import class_path

#: Where this package's stand-ins of verl-omni's adapters live: recognised as the code they mirror.
STAND_IN_PACKAGE = "vllm_omni_prompt_cache.tiny"


@dataclass(frozen=True)
class KnownMethod:
    """An encode method other than ``encode_prompt`` that a pipeline's ``forward`` calls."""

    owner: str  # ``__name__`` of the class that defines it
    method: str
    package: str  # where that class is defined (a module or package prefix)
    where: str  # whose code it is and how forward reaches it (for docs and logs)

    def defined_by(self, kind: type) -> bool:
        """Return True when ``kind``'s ``method`` is the one this entry was read in (or its stand-in)."""
        owner = defining_class(kind, self.method)
        return (
            owner is not None
            and owner.__name__ == self.owner
            and any(_within(owner.__module__, package) for package in (self.package, STAND_IN_PACKAGE))
        )


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


@dataclass(frozen=True)
class HiddenInput:
    """An encode method whose result depends on input that is not an argument (state its caller set,
    or tensors another rank broadcasts)."""

    owner: str
    method: str
    hidden: str  # what it reads, as the bypass reason names it

    @property
    def reason(self) -> str:
        """Return the bypass reason every call of the method is counted under."""
        return (
            f"{self.method} reads {self.hidden}, which is not an argument: "
            "calls with equal arguments may need different embeddings, so none is cached"
        )


#: Encode methods read in the code that calls them (verl-omni main a1139baf, vLLM-Omni 0.30).
KNOWN_METHODS: tuple[KnownMethod, ...] = (
    KnownMethod(
        "SD3TokenIdPromptMixin",
        "encode_prompt_from_token_ids",
        "verl_omni.pipelines",
        "verl-omni's SD3 FlowGRPO adapter (sd3_flow_grpo/common.py): every token-ID request, CLIP-L, CLIP-G and T5",
    ),
    KnownMethod(
        "LTX23PipelineWithLogProb",
        "_encode_token_ids",
        "verl_omni.pipelines",
        "verl-omni's LTX-2 FlowGRPO adapter: each request's ids and its negative's, injected as prompt_embeds",
    ),
    KnownMethod(
        "Magi2Pipeline",
        "_encode_prompts",
        "vllm_omni.diffusion.models",
        "vLLM-Omni's MAGI-2 pipeline: its forward encodes through it and never calls encode_prompt",
    ),
)

#: Encode methods that read hidden input: refused, whatever else would cache them. The first that
#: applies to a class names the reason (verl-omni's MiniMax-H3 adapter subclasses vLLM-Omni's).
HIDDEN_INPUTS: tuple[HiddenInput, ...] = (
    # verl-omni's MiniMax-H3 DiffusionNFT adapter: the request's ids, behind encode_prompt(prompt="[pretokenized]").
    HiddenInput("MiniMaxH3RolloutWeightSyncMixin", "encode_prompt", "self._h3_prompt_ids (set by _ensure_prompt_text)"),
    # vLLM-Omni 0.30: rank 0 encodes the prepared inputs; every other DiT rank is called with
    # prepared=None and receives them by broadcast, so a hit there would skip rank 0's collectives.
    HiddenInput(
        "MiniMaxH3Pipeline", "encode_prompt", "its inputs by broadcast from rank 0 on every other rank (prepared=None)"
    ),
    # vLLM-Omni 0.30's Ming pipelines: forward stashes each request's thinker conditioning, then
    # calls encode_prompt with the same arguments for every request.
    HiddenInput("MingImagePipeline", "encode_prompt", "self._pending_prompt_embeds (set by forward)"),
    HiddenInput("MingImageDiffusionPipeline", "encode_prompt", "self._pending_prompt_embeds (set by forward)"),
)


@dataclass(frozen=True)
class EncodeMethod:
    """One method the cache wraps on a pipeline: its name, why, and the refusal that applies, if any."""

    name: str
    source: str
    refusal: str | None = None  # a bypass reason for every call; None: the method is cached


def defining_class(kind: type, method: str) -> type | None:
    """Return the class in ``kind``'s MRO whose definition of ``method`` ``kind`` uses, or None."""
    return next((ancestor for ancestor in kind.__mro__ if method in vars(ancestor)), None)


def known_methods(kind: type) -> dict[str, str]:
    """Return the :data:`KNOWN_METHODS` class ``kind`` has, by name, with why they are cached."""
    return {known.method: f"known: {known.where}" for known in KNOWN_METHODS if known.defined_by(kind)}


def find_encode_methods(pipeline: Any, declared: Mapping[str, tuple[str, ...]] | None = None) -> list[EncodeMethod]:
    """Return the methods of ``pipeline`` to wrap, ``encode_prompt`` first, each with its source.

    ``declared``: the user's methods by class path, as :func:`resolve_declared_methods` returns
    them (the ``prompt_embed_cache_methods`` setting); a declaration for a base class applies to
    its subclasses.
    """
    kind = type(pipeline)
    found = {ENCODE_PROMPT: "every pipeline's"} if callable(getattr(pipeline, ENCODE_PROMPT, None)) else {}
    found.update(known_methods(kind))
    for ancestor in kind.__mro__:
        for name in (declared or {}).get(class_path(ancestor), ()):
            if name not in found:
                found[name] = f"declared for {class_path(ancestor)} by the {METHODS.name} setting"
    methods = []
    for name, source in found.items():
        hidden = hidden_input(kind, name)
        methods.append(EncodeMethod(name, source, None if hidden is None else hidden.reason))
    return methods


def hidden_input(kind: type, method: str) -> HiddenInput | None:
    """Return the hidden input ``kind.method`` reads, if a class in its MRO is known to read one."""
    names = {ancestor.__name__ for ancestor in kind.__mro__ if method in vars(ancestor)}
    return next((hidden for hidden in HIDDEN_INPUTS if hidden.method == method and hidden.owner in names), None)


def resolve_declared_methods(declared: Mapping[str, tuple[str, ...]], source: str) -> dict[str, tuple[str, ...]]:
    """Return ``declared`` keyed by each class's own path (``module.qualname``, where a pipeline's MRO
    finds it, whatever module re-exported it), once each class imports and has each method.

    Imports the classes: called where the pipeline loads (the diffusion worker), not in the
    process that only configures the engine. Raises PromptEmbedCacheConfigError naming the
    setting, ``source`` and what is wrong.
    """
    resolved: dict[str, tuple[str, ...]] = {}
    for given_path, names in declared.items():
        where = f"invalid {METHODS.name} entry {given_path}={'+'.join(names)} from {source}"
        try:
            found = _import_class(given_path)
        except Exception as error:  # a module that fails on import here: the setting's fault to report
            raise PromptEmbedCacheConfigError(
                f"{where}: importing it raised {type(error).__qualname__}: {error}"
            ) from error
        if not isinstance(found, type):
            raise PromptEmbedCacheConfigError(f"{where}: {given_path} is not an importable class")
        for name in names:
            if not callable(getattr(found, name, None)):
                raise PromptEmbedCacheConfigError(
                    f"{where}: {given_path} has no method {name!r}; expected methods of it that encode prompts"
                )
        resolved[class_path(found)] = tuple(dict.fromkeys((*resolved.get(class_path(found), ()), *names)))
    return resolved


def _import_class(path: str) -> Any:
    """Return what ``pkg.module.Qual.Name`` names (None if nothing): the longest importable prefix is the module."""
    module_name, _, qualname = path.rpartition(".")
    while module_name:
        try:
            found: Any = importlib.import_module(module_name)
            break
        except ModuleNotFoundError:
            module_name, _, outer = module_name.rpartition(".")
            qualname = f"{outer}.{qualname}"
    else:
        return None
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found
