"""Which of a pipeline's methods the cache wraps when it is installed: ``encode_prompt``, and the user's.

Every pipeline's ``encode_prompt`` is wrapped, and so are the methods a user declares for a class
(the ``prompt_embed_cache_methods`` setting; a declaration for a base class applies to its
subclasses). Any other method that hands the pipeline's text encoders their token ids is found
while the pipeline runs, by watching the encoders (see :mod:`vllm_omni_prompt_cache.proof.discovery`),
and what every wrapped method reads besides its arguments is seen on its calls (see
:mod:`vllm_omni_prompt_cache.keys.reads`): nothing here depends on a class or module name of
verl-omni's or vLLM-Omni's. Nothing here imports vLLM-Omni or verl-omni.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_omni_prompt_cache.counts.counters import ENCODE_PROMPT
from vllm_omni_prompt_cache.settings.schema import METHODS, PromptEmbedCacheConfigError


@dataclass(frozen=True)
class EncodeMethod:
    """One method the cache wraps on a pipeline when it is installed: its name, and why."""

    name: str
    source: str


def find_encode_methods(pipeline: Any, declared: Mapping[str, tuple[str, ...]] | None = None) -> list[EncodeMethod]:
    """Return the methods of ``pipeline`` to wrap at install, ``encode_prompt`` first, each with its source.

    ``declared``: the user's methods by class path, as :func:`resolve_declared_methods` returns
    them (the ``prompt_embed_cache_methods`` setting); a declaration for a base class applies to
    its subclasses.
    """
    kind = type(pipeline)
    found = {ENCODE_PROMPT: "every pipeline's"} if callable(getattr(pipeline, ENCODE_PROMPT, None)) else {}
    for ancestor in kind.__mro__:
        for name in (declared or {}).get(class_path(ancestor), ()):
            if name not in found:
                found[name] = f"declared for {class_path(ancestor)} by the {METHODS.name} setting"
    return [EncodeMethod(name, source) for name, source in found.items()]


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


def class_path(kind: type) -> str:
    """Return ``module.qualname``: how settings and logs name a pipeline class."""
    return f"{kind.__module__}.{kind.__qualname__}"
